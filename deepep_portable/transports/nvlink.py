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

from ..handles import DispatchHandle, LowLatencyHandle
from ..intranode import IntranodeEngine
from .base import (BufferContext, Capabilities, DispatchArgs, DispatchResult, LowLatencyCombineArgs,
                   LowLatencyDispatchArgs, LowLatencyDispatchResult)
from .reference import ReferenceTransport


def low_latency_kernels_enabled() -> bool:
    return os.environ.get("DEEPEP_PORTABLE_LL_KERNELS", "1") != "0"


class NvlinkTransport(ReferenceTransport):
    name = "nvlink"
    ll_window = "nvlink"    # which LowLatencyEngine build serves the low-latency ops
    capabilities = Capabilities(True, False, True, 1, True, "none")   # backends/nvlink/device.cuh

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        # Every rank passes the same sizes and environment, so all ranks take the same branches of
        # these collective set-ups. A Buffer with num_nvl_bytes=0 has no normal-mode buffer (Buffer
        # rejects normal-mode calls on it with the size they need).
        self.engine = IntranodeEngine(ctx) if ctx.num_nvl_bytes > 0 else None
        self.ll_engine = None
        if ctx.num_rdma_bytes > 0 and low_latency_kernels_enabled():
            from ..low_latency import LowLatencyEngine

            self.ll_engine = LowLatencyEngine(ctx, self.ll_window)

    # ---- normal mode ----------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        return self.engine.dispatch(args)

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                        num_sms: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        state = handle.transport_state
        if not isinstance(state, dict) or "send_pos" not in state:
            raise ValueError("handle was not produced by the nvlink transport")
        args = DispatchArgs(x=x, x_scales=x_scales, topk_idx=None, topk_weights=None,
                            num_tokens_per_rank=state["num_tokens_per_rank"], is_token_in_rank=handle.is_token_in_rank,
                            num_tokens_per_expert=None, num_experts=self.ctx.num_ranks, expert_alignment=1,
                            num_worst_tokens=0, num_sms=num_sms, config=None)
        res = self.engine.dispatch(args, handle=handle)
        return res.recv_x, res.recv_x_scales

    def combine(self, x, handle, topk_weights, bias_0, bias_1, num_sms):
        return self.engine.combine(x, handle, topk_weights, bias_0, bias_1, num_sms)

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

    def destroy(self) -> None:
        for engine in (self.engine, self.ll_engine):
            if engine is not None:
                engine.destroy()
        super().destroy()
