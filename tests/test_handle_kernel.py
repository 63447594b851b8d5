"""The handle kernel's host side without a GPU (engines/handle_kernel.py): its parameters packed as the ctypes
mirror lays them out, field by field, and the inputs it refuses before a launch (tests/gpu/test_handle_kernel_gpu.py
runs the kernel)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from deepep_portable.engines import handle_kernel as hk


def test_packed_params_are_the_mirror_field_by_field():
    # distinct values per field, so two swapped fields of one type show
    fields = {name: (i + 1) * (1 << 36 if ctype in (ctypes.c_uint64, ctypes.c_int64) else 7)
              for i, (name, ctype) in enumerate(hk.HandleParams._fields_)}
    assert hk.pack_params(fields) == bytes(hk.HandleParams(**fields))


def _inputs(R=8, rows=5, tokens=3, K=4, topk_dtype=torch.int64):
    return (torch.zeros(R, R, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
            torch.zeros(rows, K, dtype=topk_dtype), torch.zeros(tokens, R, dtype=torch.int32),
            torch.zeros(tokens, K, dtype=torch.int64))


def test_inputs_it_would_misread_are_refused():
    hk._check(*_inputs(), 4, 2)   # a V1 handle's shapes
    with pytest.raises(ValueError, match="int64"):
        hk._check(*_inputs(topk_dtype=torch.int32), 4, 2)
    prefix, src, recv, send, topk = _inputs()
    with pytest.raises(ValueError, match=r"recv_src_idx \(4,\) is not \[5\]"):
        hk._check(prefix, src[:4], recv, send, topk, 4, 2)
    with pytest.raises(ValueError, match=r"send_rows \(3, 7\) is not \[3, 8\]"):
        hk._check(prefix, src, recv, send[:, :7], topk, 4, 2)
    with pytest.raises(ValueError, match="do not divide"):
        hk._check(prefix, src, recv, send, topk, 3, 2)
    with pytest.raises(ValueError, match="shared memory"):
        hk._check(prefix, src, recv, send, topk, 4, 1 << 14)
