"""Zero-copy inputs of the normal-mode ops (not DeepEP V1 APIs): where a caller writes an op's rows so that
the op reads them in place instead of first copying them into this Buffer. A mixin of Buffer
(deepep_portable/buffer.py), which owns the state these read: `_live()`, `_ctx`, `_inner`.

Over the intranode kernels (transports nvlink, nvshmem and nccl_gin on one node) each op starts by copying
its rows into the rank's own send area, where the peers pull them from; a caller that writes the rows
there itself (the producing kernel's output, e.g. an FP8 cast's `out=`) saves that pass. Each call waits, on
the GPU and ordered before the caller's later work, until every peer has finished reading this Buffer's last
op (every rank calls it before the op, as the op itself is collective). Any op on this Buffer closes the rows,
and the next op may overwrite them (e.g. a combine stages its rows there): keep a copy of anything still
needed after the op (the dispatch's tokens for a shared expert or a residual). Call again before each op
that is to read them in place (also to reuse the same contents). Other engines
(reference transport, several nodes) return a fresh tensor, which the op then copies as any input."""
from __future__ import annotations

from typing import Optional

import torch

from . import _validate as check
from .handles import DispatchHandle


class ZeroCopyInputs:
    def get_next_dispatch_buffer(self, num_tokens: int, hidden: int,
                                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A [num_tokens, hidden] tensor of `dtype` (torch.bfloat16, or torch.float8_e4m3fn for an FP8
        dispatch) to write this rank's tokens into, then pass as `dispatch`'s x (FP8: as x[0], with scales
        from anywhere). Over the intranode kernels it is a view of this Buffer: the dispatch's peers read the
        rows there, and its stage copies only the scales and top-k (one pass over the payload instead of two).
        A fresh dispatch and a cached one (handle=...) both read it in place. Every rank calls it before the
        dispatch it is for."""
        backend = self._live()
        num_tokens = check.positive_int("num_tokens", num_tokens, minimum=0)
        hidden = check.positive_int("hidden", hidden)
        if dtype not in (torch.bfloat16, *check.FP8_DTYPES):
            raise TypeError(f"get_next_dispatch_buffer: dtype must be torch.bfloat16 or one of {check.FP8_DTYPES}, "
                            f"got {dtype}")
        check.hidden(hidden, fp8=dtype != torch.bfloat16)
        return backend.get_next_dispatch_buffer(num_tokens, hidden, dtype)

    def get_next_combine_buffer(self, handle: DispatchHandle, hidden: Optional[int] = None) -> torch.Tensor:
        """A [num_recv_rows, hidden] bf16 tensor (hidden: the dispatch's by default) to write the expert outputs
        of `handle`'s rows into, then pass as `combine`'s x (the normal-mode analogue of
        `get_next_low_latency_combine_buffer`). Over the intranode kernels it is a view of this Buffer: the
        combine reads the rows there instead of first copying them in (one pass over them instead of two).
        Every rank calls it after its dispatch and before its combine; it waits (on the GPU) until every peer
        has finished reading this Buffer's last op."""
        backend = self._live()
        handle = self._inner(handle)
        check.dispatch_handle(handle, self._ctx.uid)
        hidden = handle.hidden if hidden is None else check.positive_int("hidden", hidden)
        check.hidden(hidden, fp8=False)
        return backend.get_next_combine_buffer(handle, hidden)
