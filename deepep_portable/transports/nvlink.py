"""`nvlink` transport: intranode high-throughput kernels over CUDA IPC load/store.

Every rank of the group must be on one node (NVLink or, for testing, several ranks on one GPU).
Normal-mode ops (dispatch, cached dispatch, combine) run the CUDA kernels of
csrc/common/kernels/intranode; low-latency ops are served by the reference implementation until
the low-latency kernels land (issue 4), which `available_transports()` states.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..handles import DispatchHandle
from ..intranode import IntranodeEngine
from .base import BufferContext, DispatchArgs, DispatchResult
from .reference import ReferenceTransport


class NvlinkTransport(ReferenceTransport):
    name = "nvlink"

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        # A low-latency-only Buffer (num_nvl_bytes=0) has no normal-mode buffer; Buffer rejects
        # normal-mode calls on it with the size they need. Every rank passes the same size, so all
        # ranks take the same branch of this collective setup.
        self.engine = IntranodeEngine(ctx) if ctx.num_nvl_bytes > 0 else None

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

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        super().destroy()
