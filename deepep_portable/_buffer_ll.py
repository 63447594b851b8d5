"""The low-latency half of `Buffer` (DeepEP's decode-time calls): dispatch, combine, clean, the shrink
mode's mask, the zero-copy buffer. A mixin of Buffer (deepep_portable/buffer.py), which owns the state
these read: `_live()`, `_ctx`, `_op`, `group_size`, `device`, `_comm_stream`, and the class attribute
`num_sms`."""
from __future__ import annotations

from typing import Optional

import torch

from . import _validate as check
from .contract import LowLatencyCombineArgs, LowLatencyDispatchArgs
from .failures import collective_op
from .handles import LowLatencyHandle
from .logfmt import chunk_channels as logfmt_chunk

topk_idx_t = torch.int64


class LowLatencyOps:
    # ---- low-latency mode ---------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        check.low_latency(self._ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._live().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @collective_op("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send each (token, expert) pair to the expert's rank, packed per local expert.

        Returns (recv_x, recv_count, handle, event, hook) as DeepEP; recv_x is (fp8, scales) with use_fp8.
        Rows [0, recv_count[e]) of expert e hold one block per source rank, contiguous and in that rank's
        token order; handle.layout_range[e][s] = begin << 32 | count says where each block starts. The
        blocks' order is the order the sources reserved their rows (the LL kernels, as in DeepEP) or the
        source order (reference transport; nvlink with DEEPEP_PORTABLE_LL_VMM=0). With the LL kernels
        recv_x is a view of this Buffer's memory (the peers write it directly; not with
        DEEPEP_PORTABLE_LL_VMM=0): as DeepEP warns, at most two LL results are valid at a time; the
        next dispatch on the same buffer half (normally the next dispatch when dispatches and combines
        alternate) overwrites it. Copy it to keep it longer."""
        backend = self._live()
        check.tensor("x", x, torch.bfloat16, (None, None), self.device)
        num_tokens, hidden = x.shape
        check.low_latency(self._ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank}")
        check.tensor("topk_idx", topk_idx, topk_idx_t, (num_tokens, None), self.device)
        check.topk_width(topk_idx)
        check.expert_indices("topk_idx", topk_idx, num_experts)
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0=True needs use_fp8=True and round_scale=True")
        if use_ue8m0 and (hidden // 128) % 4 != 0:
            raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden/128 ({hidden // 128}) must be divisible by 4")
        num_local_experts = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            check.tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
                         (num_local_experts,), self.device)
        if dispatch_wait_recv_cost_stats is not None:
            check.tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64,
                         (self.group_size,), self.device)
        args = LowLatencyDispatchArgs(x=x, topk_idx=topk_idx,
                                      num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                      num_experts=num_experts,
                                      cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                                      dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
                                      use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                      return_recv_hook=return_recv_hook, num_sms=type(self).num_sms)
        result: list = [x, topk_idx]
        with self._op(None, async_finish, False, result):
            res = backend.low_latency_dispatch(args)
            result += [res.recv_x, res.recv_x_scales, res.recv_count]
        out_x = (res.recv_x, res.recv_x_scales) if use_fp8 else res.recv_x
        return out_x, res.recv_count, res.handle, result[0], res.hook

    @collective_op("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Weighted sum of each token's expert outputs. Returns (combined_x, event, hook)."""
        backend = self._live()
        handle = check.low_latency_handle(handle)
        T, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        check.low_latency(self._ctx, T, hidden, num_experts)
        if use_logfmt:
            logfmt_chunk(hidden)   # hidden % 512 == 0, or a ValueError naming it
            if zero_copy:
                raise ValueError("use_logfmt=True cannot be combined with zero_copy=True (as in DeepEP): the "
                                 "rows are encoded on the way out")
        num_local_experts = num_experts // self.group_size
        check.tensor("x", x, torch.bfloat16, (num_local_experts, self.group_size * T, hidden), self.device)
        check.tensor("topk_idx", topk_idx, topk_idx_t, (None, None), self.device)
        num_tokens, num_topk = topk_idx.shape
        check.topk_width(topk_idx)
        if num_tokens > T:
            raise ValueError(f"topk_idx has {num_tokens} tokens, more than the handle's maximum {T}")
        check.expert_indices("topk_idx", topk_idx, num_experts)
        check.tensor("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk), self.device)
        if out is not None:
            check.tensor("out", out, torch.bfloat16, (num_tokens, hidden), self.device)
        if combine_wait_recv_cost_stats is not None:
            check.tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64,
                         (self.group_size,), self.device)
        args = LowLatencyCombineArgs(x=x, topk_idx=topk_idx, topk_weights=topk_weights, handle=handle,
                                     zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out,
                                     combine_wait_recv_cost_stats=combine_wait_recv_cost_stats,
                                     num_sms=type(self).num_sms, use_logfmt=bool(use_logfmt))
        result: list = [x, topk_idx, topk_weights]
        with self._op(None, async_finish, False, result):
            combined_x, hook = backend.low_latency_combine(args)
            result.append(combined_x)
        return combined_x, result[0], hook

    # ---- shrink mode (enable_shrink=True): ranks the low-latency ops leave out ------------------------
    def _mask(self) -> torch.Tensor:
        mask = self._live().shrink_mask()
        if mask is None:
            raise RuntimeError("the mask buffer needs a Buffer created with enable_shrink=True")
        # The kernels write it on the comm stream (a peer that timed out): order the caller's stream after.
        if self._comm_stream is not None:
            torch.cuda.current_stream().wait_stream(self._comm_stream)
        return mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask a rank for the low-latency ops of this Buffer: a masked rank is neither
        sent to nor waited for, and its rows count as absent. Unmasking takes a rank back only if it made
        the same low-latency calls as every other rank meanwhile (clean_low_latency_buffer on every rank,
        it included, resets the calls)."""
        check.positive_int("rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask must be < {self.group_size}, got {rank_to_mask}")
        self._mask()[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write every rank's mask status (1 = masked) into `mask_status` (int32 [num_ranks])."""
        check.tensor("mask_status", mask_status, torch.int32, (self.group_size,), self.device)
        mask_status.copy_(self._mask())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._mask().zero_()

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        handle = check.low_latency_handle(handle)
        check.low_latency(self._ctx, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        return self._live().get_next_low_latency_combine_buffer(handle)
