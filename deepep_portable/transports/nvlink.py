"""`nvlink` transport: intranode kernels over CUDA IPC load/store.

Every rank of the group must be on one node (NVLink or, for testing, several ranks on one GPU).
Normal-mode ops (dispatch, cached dispatch, combine) run the CUDA kernels of
csrc/common/kernels/intranode; low-latency ops the kernels of csrc/common/kernels/low_latency over
an IPC window (DEEPEP_PORTABLE_LL_KERNELS=0 serves them with the reference implementation instead,
for A/B checks).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ..contract import (BufferContext, CachedDispatchArgs, Capabilities, CombineArgs, DispatchArgs, DispatchResult,
                        LowLatencyCombineArgs, LowLatencyDispatchArgs, LowLatencyDispatchResult)
from ..engines.intranode import IntranodeEngine
from ..handles import LowLatencyHandle
from .reference import ReferenceTransport


def low_latency_kernels_enabled() -> bool:
    return os.environ.get("DEEPEP_PORTABLE_LL_KERNELS", "1") != "0"


class NvlinkTransport(ReferenceTransport):
    name = "nvlink"
    ll_window = "nvlink"    # which LowLatencyEngine build serves the low-latency ops
    capabilities = Capabilities(peer_load_store=True, remote_atomics=False, ordered_delivery=True, max_channels=1,
                                graph_safe=True, network="none")   # backends/nvlink/device.cuh

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        # Every rank passes the same sizes and environment, so all ranks take the same branches of
        # these collective set-ups. A Buffer with num_nvl_bytes=0 has no normal-mode buffer (Buffer
        # rejects normal-mode calls on it with the size they need).
        self.normal_engine = IntranodeEngine(ctx) if ctx.num_nvl_bytes > 0 else None
        self.ll_engine = None
        if ctx.num_rdma_bytes > 0 and low_latency_kernels_enabled():
            from ..engines.low_latency import LowLatencyEngine

            self.ll_engine = LowLatencyEngine(ctx, self.ll_window)

    # ---- normal mode ----------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        return self.normal_engine.dispatch(args)

    def cached_dispatch(self, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        state = args.handle.transport_state
        if not isinstance(state, dict) or "send_pos" not in state:
            raise ValueError("handle was not produced by the nvlink transport")
        return self.normal_engine.cached_dispatch(args)

    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.normal_engine.combine(args)

    # ---- low-latency mode ---------------------------------------------------------------------
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs) -> LowLatencyDispatchResult:
        if self.ll_engine is None:
            return super().low_latency_dispatch(args)
        return self.ll_engine.dispatch(args)

    def low_latency_combine(self, args: LowLatencyCombineArgs):
        if self.ll_engine is None:
            return super().low_latency_combine(args)
        return self.ll_engine.combine(args)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        if self.ll_engine is None:
            return super().get_next_low_latency_combine_buffer(handle)
        return self.ll_engine.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        if self.ll_engine is None:
            return super().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.ll_engine.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def engine(self, mode: str):
        return {"normal": self.normal_engine, "low_latency": self.ll_engine}[mode]

    def destroy(self) -> None:
        for engine in (self.normal_engine, self.ll_engine):
            if engine is not None:
                engine.destroy()
        super().destroy()
