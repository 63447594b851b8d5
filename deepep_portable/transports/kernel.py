"""KernelTransport: a backend whose ops run this package's kernels.

Normal-mode ops run the intranode kernels over peer-mapped buffers (engines/intranode.py) when every rank is on
one node, whatever the backend; over several nodes, the internode kernels (engines/internode.py) on a
window of the backend (`make_ll_window`, with a peer table limited to the node: a backend whose window
has no network path refuses). Low-latency ops run the kernels written against the transport contract
(engines/low_latency.py) on a window the backend makes (`make_ll_window`): that window decides where
the bytes live, how the kernels are built for the backend (its device header and Transport struct) and
what the kernels receive. So a backend is a window, a Capabilities record and a probe; nothing here
names one. DEEPEP_PORTABLE_LL_KERNELS=0 serves the low-latency ops with the reference transport
instead: a way out for a low-latency kernel that fails on a system while the normal-mode kernels work
(docs/CONFIGURATION.md).
"""
from __future__ import annotations

import abc
import os
from typing import Optional, Tuple

import torch

from ..contract import (BufferContext, CachedDispatchArgs, CombineArgs, DispatchArgs, DispatchResult,
                        LowLatencyCombineArgs, LowLatencyDispatchArgs, LowLatencyDispatchResult, Transport)
from ..engines.internode import InternodeEngine
from ..engines.intranode import IntranodeEngine
from ..engines.low_latency import LowLatencyEngine
from ..failures import KernelFailures
from ..handles import DispatchHandle, InternodeRounds, InternodeState, IntranodeState, LowLatencyHandle
from ..windows.base import Window
from .reference import ReferenceTransport


def low_latency_kernels_enabled() -> bool:
    """False with DEEPEP_PORTABLE_LL_KERNELS=0 (a fallback: the reference serves the low-latency ops)."""
    return os.environ.get("DEEPEP_PORTABLE_LL_KERNELS", "1") != "0"


class KernelTransport(Transport):
    @classmethod
    @abc.abstractmethod
    def make_ll_window(cls, ctx: BufferContext, nbytes: int) -> Window:
        """Collective: this backend's window of `nbytes` for the kernels over the contract, all zero
        (the low-latency engine's; the conformance self-test's)."""

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        # Every rank passes the same sizes and environment, so all ranks take the same branches of these
        # collective set-ups. A Buffer with num_nvl_bytes=0 has no normal-mode buffer (Buffer rejects
        # normal-mode calls on it with the size they need).
        self.normal_engine = None
        self.ll_engine: Optional[LowLatencyEngine] = None   # before the engines: runtime_capabilities reads it
        if ctx.num_nvl_bytes > 0:
            if ctx.num_nodes > 1:
                self.normal_engine = InternodeEngine(ctx, self.make_ll_window, self.runtime_capabilities().max_channels)
            else:
                self.normal_engine = IntranodeEngine(ctx)
        # Over several nodes the network window belongs to the internode engine unless the Buffer is made
        # for low-latency ops too (then each engine has its own window of num_rdma_bytes).
        wants_ll = ctx.num_nodes == 1 or ctx.low_latency_mode or ctx.num_nvl_bytes == 0
        if ctx.num_rdma_bytes > 0 and low_latency_kernels_enabled() and wants_ll:
            try:
                self.ll_engine = LowLatencyEngine(ctx, self.make_ll_window)
            except BaseException:
                # Same sizes and environment on every rank: all fail here together, so the normal-mode
                # window's collective close meets every peer.
                if self.normal_engine is not None:
                    self.normal_engine.destroy()
                raise
        self.reference = ReferenceTransport(ctx)   # low-latency ops without the kernels
        self.failures = KernelFailures(ctx)
        # DEEPEP_PORTABLE_EAGER_COMBINE=0 sends every combine through the full host path: a fallback that rules the
        # short path for the common call out when a combine misbehaves (docs/CONFIGURATION.md).
        self.combine_eager = getattr(self.normal_engine, "combine_eager", None) \
            if os.environ.get("DEEPEP_PORTABLE_EAGER_COMBINE", "1") != "0" else None

    # ---- normal mode ----------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        return self.normal_engine.dispatch(args)

    def cached_dispatch(self, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not isinstance(args.handle.transport_state, (IntranodeState, InternodeState, InternodeRounds)):
            raise ValueError(f"handle was not produced by the {self.name} transport")
        return self.normal_engine.cached_dispatch(args)

    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.normal_engine.combine(args)

    # Zero-copy inputs: the intranode engine's; any other engine gets the contract's fresh tensor.
    def get_next_dispatch_buffer(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        zero_copy = getattr(self.normal_engine, "next_dispatch_buffer", None)
        if zero_copy is None:
            return super().get_next_dispatch_buffer(num_tokens, hidden, dtype)
        return zero_copy(num_tokens, hidden, dtype)

    def get_next_combine_buffer(self, handle: DispatchHandle, hidden: int) -> torch.Tensor:
        zero_copy = getattr(self.normal_engine, "next_combine_buffer", None)
        return super().get_next_combine_buffer(handle, hidden) if zero_copy is None else zero_copy(handle, hidden)

    # ---- low-latency mode ---------------------------------------------------------------------
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs) -> LowLatencyDispatchResult:
        if self.ll_engine is None:
            return self.reference.low_latency_dispatch(args)
        return self.ll_engine.dispatch(args)

    def low_latency_combine(self, args: LowLatencyCombineArgs):
        if self.ll_engine is None:
            return self.reference.low_latency_combine(args)
        return self.ll_engine.combine(args)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        if self.ll_engine is None:
            return self.reference.get_next_low_latency_combine_buffer(handle)
        return self.ll_engine.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        if self.ll_engine is None:
            return self.reference.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.ll_engine.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def shrink_mask(self) -> Optional[torch.Tensor]:
        return None if self.ll_engine is None else self.ll_engine.shrink_mask()

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        engine = self.ll_engine if use_rdma_buffer else self.normal_engine
        if engine is None:   # the reference serves the low-latency ops (DEEPEP_PORTABLE_LL_KERNELS=0)
            return self.reference.local_buffer(use_rdma_buffer)
        nbytes = self.ctx.num_rdma_bytes if use_rdma_buffer else self.ctx.num_nvl_bytes
        return engine.window.view(0, nbytes, self.ctx.device)

    # ---- failures (failures.py) -------------------------------------------------------------------
    def _served_by_reference(self, op: str) -> bool:
        return op.startswith("low_latency") and self.ll_engine is None

    def refuse(self, op: str, call: int, reason: str) -> None:
        if self._served_by_reference(op):
            return self.reference.refuse(op, call, reason)
        self.failures.refuse(op, call, reason)

    def failed(self, op: str, call: int, error: Exception) -> Exception:
        if self._served_by_reference(op):
            return self.reference.failed(op, call, error)
        return self.failures.failed(op, call, error)

    def synchronize(self) -> None:
        """Wait for this Buffer's device work, then raise what a kernel recorded (a CommError)."""
        if self.ctx.comm_stream is not None:
            self.ctx.comm_stream.synchronize()
        for engine in (self.normal_engine, self.ll_engine):
            if engine is not None:
                engine.check()

    # ---- tools ----------------------------------------------------------------------------------
    def engine(self, mode: str):
        return {"normal": self.normal_engine, "low_latency": self.ll_engine}[mode]

    def destroy(self) -> None:
        for engine in (self.normal_engine, self.ll_engine):
            if engine is not None:
                engine.destroy()
        self.reference.destroy()
