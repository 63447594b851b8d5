"""Plain-torch oracle for every op, computed from all-gathered inputs.

Each function gets what every rank passed in (lists indexed by rank) and returns what rank `rank`
must get back. Pure torch, device-agnostic (CPU or CUDA tensors), no import of deepep_portable:
this is an independent statement of DeepEP V1's semantics, written directly from the definitions
(masks and loops over ranks/experts), not by packing and sorting like the reference transport.

Reduction orders are part of the specification, so results are exact (bit for bit) for any
implementation that follows them:
- normal combine: float32 acc = +0.0, += bias_0, += bias_1, += the row of each receiving rank in
  rank order, then cast to bf16; top-k weights: +0.0, += each receiving rank's row in rank order.
- low-latency combine: float32 acc = +0.0, then for k ascending with topk_idx != -1:
  acc += float(x_expert_row) * weight (a rounded product, then a rounded sum: no FMA); cast to bf16.
Implementations that fuse multiply-add (GPU kernels) should compare LL combine within bf16 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

FP8_MAX = 448.0
FP8_AMAX_MIN = 1e-4
FP8_BLOCK = 128


# ---- FP8 cast ------------------------------------------------------------------------------------
def fp8_cast(x: torch.Tensor, round_scale: bool = False,
             use_ue8m0: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, H] -> (float8_e4m3fn [N, H], scales).

    Per token and per 128 channels: amax = max(|x|) clamped to >= 1e-4, scale = amax / 448; with
    `round_scale` the scale becomes 2 ** ceil(log2(scale)). data = float8(x / scale) (round to nearest
    even). Scales: float32 [N, H/128]; with `use_ue8m0` (needs round_scale) int32 [N, H/512] whose
    byte b (little end first) of word i is the biased exponent (log2(scale) + 127) of block 4*i + b.
    """
    assert not use_ue8m0 or round_scale, "use_ue8m0 requires round_scale"
    n, h = x.shape
    blocks = x.to(torch.float32).reshape(n, h // FP8_BLOCK, FP8_BLOCK)
    amax = torch.clamp(blocks.abs().amax(dim=2), min=FP8_AMAX_MIN)
    # A tensor divisor: on CUDA, torch divides by a Python scalar as a multiplication by its reciprocal,
    # one ulp off the correctly rounded quotient (seen in the GPU fuzz at amax 3.28125 = 448 * 0.00732421875).
    scale = amax / torch.full_like(amax, FP8_MAX)
    exponent = None
    if round_scale:
        mantissa, exponent = torch.frexp(scale)          # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    data = (blocks / scale[:, :, None]).to(torch.float8_e4m3fn).reshape(n, h)
    if not use_ue8m0:
        return data, scale
    biased = (exponent.to(torch.int64) + 127).reshape(n, h // (4 * FP8_BLOCK), 4)   # explicit: n may be 0
    word = biased[:, :, 0] | (biased[:, :, 1] << 8) | (biased[:, :, 2] << 16) | (biased[:, :, 3] << 24)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
    return data, word.to(torch.int32)


def fp8_dequant(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 view of FP8 data with float32 per-128 scales (for sanity checks only)."""
    n, h = data.shape
    return (data.float().reshape(n, h // FP8_BLOCK, FP8_BLOCK) * scales[:, :, None]).reshape(n, h)


# ---- helpers -------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for any dtype (fp8 goes through a byte view)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)[index].view(t.dtype)
    return t[index]


def _empty_like_rows(t: torch.Tensor, num_rows: int, fill: int = 0) -> torch.Tensor:
    out = torch.full((num_rows, *t.shape[1:]), fill, dtype=torch.uint8 if t.element_size() == 1 else t.dtype,
                     device=t.device)
    return out.view(t.dtype) if out.dtype != t.dtype else out


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---- layout --------------------------------------------------------------------------------------
def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `get_dispatch_layout` returns (num_tokens_per_rank [R] int32,
    num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool), from one rank's topk_idx."""
    experts_per_rank = num_experts // num_ranks
    num_tokens = topk_idx.shape[0]
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
    for e in range(num_experts):
        per_expert[e] = int((topk_idx == e).any(dim=1).sum())
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
    for j in range(num_ranks):
        lo = j * experts_per_rank
        in_rank[:, j] = ((topk_idx >= lo) & (topk_idx < lo + experts_per_rank)).any(dim=1)
    return in_rank.sum(dim=0).to(torch.int32), per_expert, in_rank


# ---- normal dispatch / combine -------------------------------------------------------------------
@dataclass
class DispatchExpect:
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: List[int]
    recv_src_idx: torch.Tensor          # [num_rows] int32, -1 on padding rows
    rank_prefix_matrix: torch.Tensor    # [R, R] int32
    send_rows: torch.Tensor             # [N, R] int32: row of my token t at rank j, -1 if not sent
    num_recv_tokens: int


def dispatch(rank: int, num_experts: int, x_all: Sequence[torch.Tensor],
             is_token_in_rank_all: Sequence[torch.Tensor],
             x_scales_all: Optional[Sequence[torch.Tensor]] = None,
             topk_idx_all: Optional[Sequence[torch.Tensor]] = None,
             topk_weights_all: Optional[Sequence[torch.Tensor]] = None,
             num_tokens_per_expert_all: Optional[Sequence[torch.Tensor]] = None,
             expert_alignment: int = 1, num_worst_tokens: int = 0) -> DispatchExpect:
    """Normal-mode dispatch as seen by `rank` (inputs: every rank's arguments, indexed by rank)."""
    num_ranks = len(x_all)
    local = num_experts // num_ranks
    lo = rank * local
    device = x_all[rank].device

    x_parts, s_parts, i_parts, w_parts, src_parts = [], [], [], [], []
    for src in range(num_ranks):
        sent = is_token_in_rank_all[src][:, rank].nonzero().flatten()
        x_parts.append(_rows(x_all[src], sent))
        src_parts.append(sent.to(torch.int32))
        if x_scales_all is not None:
            s_parts.append(x_scales_all[src][sent])
        if topk_idx_all is not None:
            idx = topk_idx_all[src][sent]
            mine = (idx >= lo) & (idx < lo + local)
            i_parts.append(torch.where(mine, idx - lo, torch.full_like(idx, -1)))
            w_parts.append(torch.where(mine, topk_weights_all[src][sent], torch.zeros_like(topk_weights_all[src][sent])))
    num_recv = sum(p.shape[0] for p in src_parts)
    if num_worst_tokens > 0 and num_recv > num_worst_tokens:
        raise RuntimeError(f"rank {rank} receives {num_recv} > num_worst_tokens={num_worst_tokens}")
    num_rows = num_worst_tokens if num_worst_tokens > 0 else num_recv

    def stack(parts: List[torch.Tensor], like: torch.Tensor, fill: int) -> torch.Tensor:
        out = _empty_like_rows(like, num_rows, fill)
        offset = 0
        for p in parts:
            if out.element_size() == 1:
                out.view(torch.uint8)[offset:offset + p.shape[0]] = p.view(torch.uint8)
            else:
                out[offset:offset + p.shape[0]] = p
            offset += p.shape[0]
        return out

    recv_x = stack(x_parts, x_all[rank], 0)
    recv_x_scales = stack(s_parts, x_scales_all[rank], 0) if x_scales_all is not None else None
    recv_topk_idx = recv_topk_weights = None
    if topk_idx_all is not None:
        recv_topk_idx = stack(i_parts, topk_idx_all[rank], -1)
        recv_topk_weights = stack(w_parts, topk_weights_all[rank], 0)
    recv_src_idx = stack(src_parts, torch.empty(0, dtype=torch.int32, device=device), -1)

    per_expert_list: List[int] = []
    if num_worst_tokens == 0:
        for e in range(local):
            if topk_idx_all is not None:
                count = int((recv_topk_idx == e).any(dim=1).sum())
            else:
                count = sum(int(num_tokens_per_expert_all[src][lo + e]) for src in range(num_ranks))
            per_expert_list.append(_align(count, max(1, expert_alignment)))

    counts = torch.tensor([[int(is_token_in_rank_all[i][:, j].sum()) for j in range(num_ranks)]
                           for i in range(num_ranks)], dtype=torch.int64)
    rank_prefix_matrix = torch.zeros(num_ranks, num_ranks, dtype=torch.int32)
    for i in range(num_ranks):
        for j in range(num_ranks):
            rank_prefix_matrix[i, j] = int(counts[:i + 1, j].sum())
    mine = is_token_in_rank_all[rank]
    send_rows = torch.full(mine.shape, -1, dtype=torch.int32, device=device)
    for j in range(num_ranks):
        sent = mine[:, j].nonzero().flatten()
        base = int(counts[:rank, j].sum())
        send_rows[sent, j] = torch.arange(base, base + sent.numel(), dtype=torch.int32, device=device)
    return DispatchExpect(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list,
                          recv_src_idx, rank_prefix_matrix.to(device), send_rows, num_recv)


def combine(rank: int, combine_x_all: Sequence[torch.Tensor], is_token_in_rank_all: Sequence[torch.Tensor],
            topk_weights_all: Optional[Sequence[torch.Tensor]] = None,
            bias_0: Optional[torch.Tensor] = None, bias_1: Optional[torch.Tensor] = None,
            ranks_per_node: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Normal-mode combine as seen by `rank`: combine_x_all[j] is what rank j passed to combine (its
    rows in dispatched order, padding rows allowed), topk_weights_all[j] likewise. With ranks_per_node
    (several nodes, docs/INTERNODE.md): each node's rows summed first from +0.0 (bf16-rounded for x),
    then added node by node."""
    num_ranks = len(combine_x_all)
    mine = is_token_in_rank_all[rank]
    num_tokens = mine.shape[0]
    hidden = combine_x_all[rank].shape[1]
    device = combine_x_all[rank].device
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    if bias_0 is not None:
        acc = acc + bias_0.to(torch.float32)
    if bias_1 is not None:
        acc = acc + bias_1.to(torch.float32)
    weights = None
    if topk_weights_all is not None:
        weights = torch.zeros(num_tokens, topk_weights_all[rank].shape[1], dtype=torch.float32, device=device)
    step = ranks_per_node if 0 < ranks_per_node < num_ranks else num_ranks
    for first in range(0, num_ranks, step):
        part_x = acc if step == num_ranks else torch.zeros_like(acc)
        part_w = weights if (step == num_ranks or weights is None) else torch.zeros_like(weights)
        for j in range(first, first + step):
            sent = mine[:, j].nonzero().flatten()
            base = sum(int(is_token_in_rank_all[i][:, j].sum()) for i in range(rank))
            rows = torch.arange(base, base + sent.numel(), device=device)
            part_x[sent] = part_x[sent] + combine_x_all[j][rows].to(torch.float32)
            if weights is not None:
                part_w[sent] = part_w[sent] + topk_weights_all[j][rows]
        if step != num_ranks:
            acc = acc + part_x.to(torch.bfloat16).to(torch.float32)
            if weights is not None:
                weights = weights + part_w
    return acc.to(torch.bfloat16), weights


# ---- low-latency dispatch / combine --------------------------------------------------------------
@dataclass
class LowLatencyDispatchExpect:
    recv_x: torch.Tensor                 # [E_local, R*T, H]; only rows < recv_count[e] are defined
    recv_x_scales: Optional[torch.Tensor]  # [E_local, R*T, S] (row-major); only rows < recv_count[e]
    recv_count: torch.Tensor             # [E_local] int32
    src_info: torch.Tensor               # [E_local, R*T] int32; -1 past recv_count[e]
    layout_range: torch.Tensor           # [E_local, R] int64: (begin << 32) | count


def low_latency_dispatch(rank: int, num_experts: int, num_max_dispatch_tokens_per_rank: int,
                         x_all: Sequence[torch.Tensor], topk_idx_all: Sequence[torch.Tensor],
                         use_fp8: bool = False, round_scale: bool = False,
                         use_ue8m0: bool = False) -> LowLatencyDispatchExpect:
    """Low-latency dispatch as seen by `rank`: for each local expert, the tokens that selected it,
    source rank 0 first (source token order), then rank 1, ..., packed from slot 0. Slots past
    recv_count are left uninitialized (like the real buffers): compare only rows < recv_count[e]."""
    num_ranks = len(x_all)
    local = num_experts // num_ranks
    slots = num_ranks * num_max_dispatch_tokens_per_rank
    device = x_all[rank].device
    hidden = x_all[rank].shape[1]
    if use_fp8:
        cast = [fp8_cast(x, round_scale, use_ue8m0) for x in x_all]
        payload_all, scales_all = [c[0] for c in cast], [c[1] for c in cast]
        recv_x = torch.empty(local, slots, hidden, dtype=torch.uint8, device=device)
        recv_x_scales = torch.empty(local, slots, scales_all[rank].shape[1], dtype=scales_all[rank].dtype,
                                    device=device)
    else:
        payload_all, scales_all = list(x_all), None
        recv_x = torch.empty(local, slots, hidden, dtype=torch.bfloat16, device=device)
        recv_x_scales = None
    recv_count = torch.zeros(local, dtype=torch.int32, device=device)
    src_info = torch.full((local, slots), -1, dtype=torch.int32, device=device)
    layout_range = torch.zeros(local, num_ranks, dtype=torch.int64, device=device)
    for e in range(local):
        expert = rank * local + e
        filled = 0
        for src in range(num_ranks):
            tokens = (topk_idx_all[src] == expert).any(dim=1).nonzero().flatten()
            n = tokens.numel()
            if use_fp8:
                recv_x[e, filled:filled + n] = payload_all[src].view(torch.uint8)[tokens]
                recv_x_scales[e, filled:filled + n] = scales_all[src][tokens]
            else:
                recv_x[e, filled:filled + n] = payload_all[src][tokens]
            src_info[e, filled:filled + n] = tokens.to(torch.int32)
            layout_range[e, src] = (filled << 32) | n
            filled += n
        recv_count[e] = filled
    if use_fp8:
        recv_x = recv_x.view(torch.float8_e4m3fn)
    return LowLatencyDispatchExpect(recv_x, recv_x_scales, recv_count, src_info, layout_range)


def low_latency_row_map(layout_range: torch.Tensor, expected_layout_range: torch.Tensor) -> List[torch.Tensor]:
    """For a dispatch whose (expert, source) blocks may sit in any order (the kernels place them in the
    order their reservations arrived, as DeepEP does), map every received row to the oracle's row:
    out[e][r] = the oracle row of expert e holding what row r of `layout_range`'s layout holds. Raises
    AssertionError unless every block has the oracle's count and the non-empty blocks tile rows
    [0, recv_count[e]) exactly (no gap, no overlap); the begin of an empty block is not checked."""
    got, exp = layout_range.detach().cpu(), expected_layout_range.detach().cpu()
    assert got.shape == exp.shape, f"layout_range shape {list(got.shape)}, expected {list(exp.shape)}"
    mask = (1 << 32) - 1
    out = []
    for e in range(got.shape[0]):
        counts, exp_counts = (got[e] & mask).tolist(), (exp[e] & mask).tolist()
        assert counts == exp_counts, f"expert {e}: block sizes per source {counts}, expected {exp_counts}"
        total = sum(counts)
        rows = torch.full((total,), -1, dtype=torch.int64)
        for s, n in enumerate(counts):
            if n == 0:
                continue
            begin, exp_begin = int(got[e, s]) >> 32, int(exp[e, s]) >> 32
            assert 0 <= begin and begin + n <= total, f"expert {e} source {s}: rows [{begin}, {begin + n}) " \
                                                      f"outside [0, {total})"
            assert bool((rows[begin:begin + n] == -1).all()), f"expert {e} source {s}: block overlaps another"
            rows[begin:begin + n] = torch.arange(exp_begin, exp_begin + n)
        out.append(rows)
    return out


def low_latency_combine(rank: int, num_experts: int, num_max_dispatch_tokens_per_rank: int,
                        combine_x_all: Sequence[torch.Tensor], topk_idx_all: Sequence[torch.Tensor],
                        topk_weights: torch.Tensor, decode=None) -> torch.Tensor:
    """Low-latency combine as seen by `rank`: combine_x_all[j] is rank j's [E_local, R*T, H] expert
    output (only the slots filled by the matching dispatch are read); topk_weights are this rank's.
    `decode`: bf16 rows -> the float32 values the receiver reads (use_logfmt: deepep_portable.logfmt.roundtrip)."""
    num_ranks = len(combine_x_all)
    local = num_experts // num_ranks
    topk_idx = topk_idx_all[rank]
    num_tokens, num_topk = topk_idx.shape
    hidden = combine_x_all[rank].shape[2]
    device = combine_x_all[rank].device
    # slot_of[t, g]: slot of my token t in expert g's packed rows (valid where t selected g).
    slot_of = torch.full((num_tokens, num_experts), -1, dtype=torch.int64, device=device)
    for expert in range(num_experts):
        before = sum(int((topk_idx_all[src] == expert).any(dim=1).sum()) for src in range(rank))
        tokens = (topk_idx == expert).any(dim=1).nonzero().flatten()
        slot_of[tokens, expert] = torch.arange(before, before + tokens.numel(), device=device)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    for k in range(num_topk):
        expert = topk_idx[:, k]
        valid = expert >= 0
        rows = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16 if decode is None else torch.float32,
                           device=device)
        for j in range(num_ranks):
            sel = (valid & (expert // local == j)).nonzero().flatten()
            e = expert[sel] % local
            got = combine_x_all[j][e, slot_of[sel, expert[sel]]]
            rows[sel] = got if decode is None else decode(got)
        term = rows.to(torch.float32) * topk_weights[:, k:k + 1]
        acc = acc + torch.where(valid[:, None], term, torch.zeros_like(term))
    return acc.to(torch.bfloat16)
