"""`EPHandle`: DeepEP V2's dispatch handle, and V2's receive layout derived from a V1 dispatch.

ElasticBuffer (buffers/elastic.py) dispatches through V1's `Buffer`, whose received rows are ordered by
source rank, then source token. Everything V2's handle carries is a function of that V1 result: this
module computes it (`build_handle`) and moves rows between V2's two receive layouts:
  - plain: one row per received token (V1's rows, as they are);
  - expanded (`do_expand`): one row per (received token, local expert it selected), grouped by local
    expert, each expert's rows padded up to `expert_alignment`; a token's row for its k-th top-k choice
    is `recv_src_metadata[row, 2 + k]` (-1 where that choice is another rank's expert).
Each token's top-k experts are assumed distinct (V2's kernels assert it).
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import torch

from .handles import DispatchHandle, InternodeHandle

SF_ALIGNMENT = 4   # rows of column-major scales are padded to 16 bytes (4 packs of 4 bytes), as V2's TMA needs


class EPHandle:
    """What a dispatch leaves for a cached dispatch and for the combine (V2's fields, same names and order).

    do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
    topk_idx: [num_tokens, num_topk] the dispatch's top-k (a copy unless do_handle_copy=False).
    num_recv_tokens: rows of the plain receive layout (the worst case without CPU sync).
    num_expanded_tokens: rows of the expanded layout (the worst case without CPU sync).
    num_recv_tokens_per_expert_list: received tokens per local expert, each padded to expert_alignment
        (empty without CPU sync).
    psum_num_recv_tokens_per_scaleup_rank: [num_scaleup_ranks] int32 inclusive prefix sum of the tokens
        received from each scale-up rank index; its last entry is the number of real rows.
    psum_num_recv_tokens_per_expert: [num_local_experts] int32: plain layout, inclusive prefix sum of the
        padded counts; expanded, each expert's padded start plus its real count.
    num_unaligned_recv_tokens_per_expert: [num_local_experts] int32 real counts.
    recv_src_metadata: [num_recv_tokens, num_topk + 2] int32 per received row: source token's global index
        (source rank * num_max_tokens_per_rank + its index there; -1 on padding rows), source rank * num_topk
        + the first top-k position choosing an expert here, then per top-k position the row that holds it
        (expanded layout: its expert's row; plain layout: the token's row) or -1.
    dst_buffer_slot_idx: [num_tokens, num_topk] int32: row of each of my tokens at the rank holding its k-th
        expert, -1 where k chose none.
    token_metadata_at_forward, channel_linked_list: None (V2's hierarchical kernels' private state).
    Ours: buffer_handle (the V1 handle that cached dispatch and combine hand to V1's Buffer) and
    recv_topk_idx (the plain layout's received top-k, returned again by a cached dispatch).
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int], psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: Optional[torch.Tensor], channel_linked_list: Optional[torch.Tensor],
                 *, buffer_handle=None, recv_topk_idx: Optional[torch.Tensor] = None) -> None:
        if topk_idx is None:
            raise ValueError("EPHandle needs the dispatch's topk_idx")
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.buffer_handle = buffer_handle
        self.recv_topk_idx = recv_topk_idx

    @property
    def row_slots(self) -> torch.Tensor:
        """[num_recv_tokens, num_topk] int32: per received token and top-k position, the row holding it, or -1."""
        return self.recv_src_metadata[:, 2:]


def _align(n: torch.Tensor, alignment: int) -> torch.Tensor:
    return (n + alignment - 1) // alignment * alignment


def worst_case_expanded_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int,
                             expert_alignment: int) -> int:
    """Rows of the expanded layout that any dispatch fits (no CPU sync): every token of every rank choosing
    min(top-k, local experts) of mine, plus each expert's padding."""
    rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    rows += (expert_alignment - 1) * num_local_experts
    return (rows + expert_alignment - 1) // expert_alignment * expert_alignment


class HandleFields(NamedTuple):
    """The handle's tensors that a fresh dispatch derives (EPHandle's names in the docstring above)."""
    metadata: torch.Tensor            # recv_src_metadata [rows, K + 2] int32
    dst_slot: torch.Tensor            # dst_buffer_slot_idx [num_tokens, K] int32
    counts: torch.Tensor              # num_unaligned_recv_tokens_per_expert [L] int32
    psum_per_expert: torch.Tensor     # psum_num_recv_tokens_per_expert [L] int32
    psum_per_scaleup: torch.Tensor    # psum_num_recv_tokens_per_scaleup_rank [S] int32


def build_handle(buffer_handle, recv_topk_idx: torch.Tensor, topk_idx: torch.Tensor, *, rank: int,
                 num_scaleup_ranks: int, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, do_expand: bool, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int], keep_topk_idx: torch.Tensor,
                 kernel: Optional[Callable[..., "HandleFields"]] = None) -> EPHandle:
    """V2's handle of a V1 dispatch (`buffer_handle`, with its received top-k `recv_topk_idx`, local expert
    ids or -1). Device work only: no host sync. `kernel`: engines.handle_kernel.handle_fields, which the caller
    (above the engines) passes for CUDA tensors: the plain layout's fields then take one launch (the torch of
    handle_fields_torch is some thirty, whose host time bound the dispatch)."""
    inner: DispatchHandle = buffer_handle.inner if isinstance(buffer_handle, InternodeHandle) else buffer_handle
    num_local_experts = num_experts // inner.rank_prefix_matrix.size(0)
    args = (inner.rank_prefix_matrix, inner.recv_src_idx, recv_topk_idx, inner.send_rows, topk_idx)
    kwargs = dict(rank=rank, num_scaleup_ranks=num_scaleup_ranks, num_local_experts=num_local_experts,
                  num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment)
    if kernel is not None and recv_topk_idx.is_cuda and not do_expand:
        f = kernel(*args, **kwargs)
    else:
        f = handle_fields_torch(*args, **kwargs, do_expand=do_expand)
    return EPHandle(do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, keep_topk_idx,
                    recv_topk_idx.size(0), num_expanded_tokens, num_recv_tokens_per_expert_list, f.psum_per_scaleup,
                    f.psum_per_expert, f.counts, f.metadata, f.dst_slot, None, None,
                    buffer_handle=buffer_handle, recv_topk_idx=None if do_expand else recv_topk_idx)


def handle_fields_torch(rank_prefix_matrix: torch.Tensor, recv_src_idx: torch.Tensor, recv_topk_idx: torch.Tensor,
                        send_rows: torch.Tensor, topk_idx: torch.Tensor, *, rank: int, num_scaleup_ranks: int,
                        num_local_experts: int, num_max_tokens_per_rank: int, expert_alignment: int,
                        do_expand: bool) -> HandleFields:
    """The handle's fields with torch (any device): V1's prefix matrix [R, R], source indices [rows], received
    top-k [rows, K] (local ids or -1), send rows [num_tokens, R] and my top-k [num_tokens, K]."""
    device = recv_topk_idx.device
    num_ranks = rank_prefix_matrix.size(0)
    rows, num_topk = recv_topk_idx.shape
    # Source of each row: rows come grouped by source rank (the prefix column says where each group ends).
    column = rank_prefix_matrix[:, rank].contiguous()
    row_ids = torch.arange(rows, device=device, dtype=torch.int32)
    src_rank = torch.searchsorted(column, row_ids, right=True).to(torch.int64)
    real = recv_src_idx >= 0
    src_global = torch.where(real, src_rank * num_max_tokens_per_rank + recv_src_idx.to(torch.int64),
                             torch.full_like(src_rank, -1))
    per_source = torch.diff(column, prepend=column.new_zeros(1))
    per_scaleup = per_source.view(num_ranks // num_scaleup_ranks, num_scaleup_ranks).sum(dim=0)
    psum_per_scaleup = per_scaleup.cumsum(0).to(torch.int32)

    chosen = recv_topk_idx >= 0
    # Received tokens per local expert (entries choosing none counted in a spare bin): fixed shapes, no host sync.
    bins = torch.where(chosen, recv_topk_idx, torch.full_like(recv_topk_idx, num_local_experts)).view(-1)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=device)
    counts = counts.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))[:num_local_experts]
    padded = _align(counts, expert_alignment)
    if do_expand:
        starts = padded.cumsum(0) - padded
        psum_per_expert = (starts + counts).to(torch.int32)
        slots = expanded_slots(recv_topk_idx, counts, starts)
    else:
        psum_per_expert = padded.cumsum(0).to(torch.int32)
        slots = torch.where(chosen, row_ids.unsqueeze(1), torch.full_like(row_ids, -1).unsqueeze(1))
    first_choice = chosen.to(torch.int8).argmax(dim=1)
    master = torch.where(real, src_rank * num_topk + first_choice, torch.full_like(src_rank, -1))
    metadata = torch.cat([src_global.unsqueeze(1), master.unsqueeze(1), slots.to(torch.int64)], dim=1)

    dst_rank = torch.where(topk_idx >= 0, topk_idx // num_local_experts, torch.zeros_like(topk_idx))
    dst_slot = send_rows.to(torch.int32).gather(1, dst_rank)
    dst_slot = torch.where(topk_idx >= 0, dst_slot, torch.full_like(dst_slot, -1))
    return HandleFields(metadata.to(torch.int32).contiguous(), dst_slot.contiguous(), counts, psum_per_expert,
                        psum_per_scaleup)


def expanded_slots(recv_topk_idx: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[rows, num_topk] int32: the expanded row of each (row, top-k position), -1 where it chose no local
    expert. Within an expert, rows keep the order of the plain layout (source rank, then source token)."""
    rows, num_topk = recv_topk_idx.shape
    flat = recv_topk_idx.reshape(-1)
    chosen = flat >= 0
    positions = torch.arange(flat.numel(), device=flat.device)
    experts = flat.clamp(min=0)
    # Sort by expert, then by row; entries choosing none go last (fixed shapes: no host sync).
    keys = torch.where(chosen, experts * flat.numel() + positions, torch.full_like(positions, 1 << 62))
    order = torch.sort(keys).indices
    sorted_experts = experts[order]
    first_of_expert = counts.to(torch.int64).cumsum(0) - counts.to(torch.int64)
    rank_in_expert = positions - first_of_expert[sorted_experts]
    sorted_slots = torch.where(chosen[order], starts.to(torch.int64)[sorted_experts] + rank_in_expert,
                               torch.full_like(positions, -1))
    slots = torch.empty_like(positions)
    slots[order] = sorted_slots
    return slots.view(rows, num_topk).to(torch.int32)


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """Row indexing for any dtype (one-byte floats go through a uint8 view)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _targets(slots: torch.Tensor, num_rows: int) -> torch.Tensor:
    """slots flattened, with -1 sent to the spare row num_rows (fixed shapes instead of a mask: no host sync)."""
    return torch.where(slots >= 0, slots.to(torch.int64), torch.full_like(slots, num_rows, dtype=torch.int64)).view(-1)


def expand_rows(plain: torch.Tensor, slots: torch.Tensor, num_rows: int, zero_padding: bool) -> torch.Tensor:
    """[num_rows, ...]: row slots[r, k] of the result is plain[r] (rows no slot names: zero with zero_padding,
    else unspecified)."""
    out = torch.empty((num_rows + 1, *plain.shape[1:]), dtype=plain.dtype, device=plain.device)
    targets = _targets(slots, num_rows)
    rows = torch.arange(slots.size(0), device=slots.device).repeat_interleave(slots.size(1))
    dst = _byte_rows(out)
    dst[targets] = _byte_rows(plain)[rows]
    if zero_padding:
        unused = torch.ones(num_rows + 1, dtype=torch.bool, device=plain.device)
        unused[targets] = False
        dst.masked_fill_(unused.view(-1, *([1] * (dst.dim() - 1))), 0)
    return out[:num_rows]


def expand_weights(weights: torch.Tensor, slots: torch.Tensor, num_rows: int, zero_padding: bool) -> torch.Tensor:
    """[num_rows] float32: the weight of each expanded row (its token's weight for that expert)."""
    make = torch.zeros if zero_padding else torch.empty
    out = make(num_rows + 1, dtype=weights.dtype, device=weights.device)
    out[_targets(slots, num_rows)] = weights.reshape(-1)
    return out[:num_rows]


def reduce_expanded(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[rows, hidden] bf16: per received token, the sum of its expanded rows (float32 from +0.0, top-k
    position ascending, rounded once to bf16); padding tokens get zeros. (Adding +0.0 where a position chose
    no local expert leaves the sum's bits unchanged: it never is -0.0.)"""
    acc = torch.zeros((slots.size(0), x.size(1)), dtype=torch.float32, device=x.device)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    for k in range(slots.size(1)):
        chosen = slots[:, k:k + 1] >= 0
        acc += torch.where(chosen, x[slots[:, k].clamp(min=0).to(torch.int64)].to(torch.float32), zero)
    return acc.to(torch.bfloat16)


def gather_expanded_weights(weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[rows, num_topk] float32: the expanded rows' weights back at their top-k positions (0 elsewhere)."""
    chosen = slots >= 0
    return torch.where(chosen, weights[slots.clamp(min=0).to(torch.int64)], torch.zeros((), dtype=weights.dtype,
                                                                                         device=weights.device))


def column_major_scales(scales: torch.Tensor) -> torch.Tensor:
    """The same [rows, packs] values with V2's TMA-aligned column-major strides (1, rows padded to 4)."""
    rows, packs = scales.shape
    padded = (rows + SF_ALIGNMENT - 1) // SF_ALIGNMENT * SF_ALIGNMENT
    out = torch.empty((packs, padded), dtype=scales.dtype, device=scales.device).T[:rows]
    out.copy_(scales)
    return out
