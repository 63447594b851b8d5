"""The reference transport: every op in plain torch over `Comm.all_to_all_bytes`.

It is the executable specification of DeepEP V1's semantics (the GPU backends must agree with it),
the fallback on machines without a GPU (gloo), and the benchmark baseline. Clarity beats speed here:
metadata is computed with ordinary torch ops (host syncs are fine), and each op moves its rows with
one variable all-to-all of packed bytes: every row destined to a rank is the concatenation of the
raw bytes of its pieces (payload, scales, top-k, source index, ...), so FP8 data and scales travel
bit for bit and nothing is ever converted on the way.

Device handling: inputs may be CPU or CUDA tensors; all work is enqueued on the *current* stream
and outputs are allocated there, on x's device. `Comm.all_to_all_bytes` stages CUDA tensors through
host memory when the process group cannot move them (its `.to("cpu")` waits for the packing kernels
of the current stream). The reference works synchronously: before an op (or its receive hook)
returns, the current stream is synchronized, so events that Buffer records on `ctx.comm_stream`
are truthful even though nothing was enqueued there.

Failures: every op begins with an arrival (agreement.arrive): each rank tells every other that it runs call
s of this op, or that it refused it and why. A rank that refused a call before its arrival (Buffer's checks)
still arrives, with its reason (`refuse`), so every rank ends that call together, the others with a
PeerFailedError, and the Buffer works for the next call. Every exchange after the arrival has the Buffer's
timeout; one that passes it (a rank failed in the middle of the op) leaves the Buffer unusable.

Determinism: every reduction has a fixed order (see `combine` and `low_latency_combine`), so results
are reproducible bit for bit and equal to `tests/oracle.py`, which implements the same
specification independently.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import logfmt
from ..agreement import arrive
from ..comm import DeadlinePassed
from ..errors import CommError, PeerFailedError
from ..fp8 import FP8_BLOCK, cast as _fp8_cast, pack_ue8m0 as _pack_ue8m0
from ..contract import (BufferContext, CachedDispatchArgs, Capabilities, CombineArgs, DispatchArgs, DispatchResult,
                        LowLatencyCombineArgs, LowLatencyDispatchArgs, LowLatencyDispatchResult, Transport,
                        TransportStatus,
                        allocate_low_latency_outputs)
from ..handles import DispatchHandle, LowLatencyHandle


# ---- byte packing ---------------------------------------------------------------------------------
def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a [M, ...] tensor as [M, bytes per row] uint8 (no copy when already contiguous)."""
    per_row = t.element_size()
    for d in t.shape[1:]:
        per_row *= d
    if t.dim() > 1 and t.stride(-1) != 1:
        # contiguous() keeps odd strides on size-1 dims (e.g. [N, 1] column-major scales): make them dense
        t = t.clone(memory_format=torch.contiguous_format)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], per_row)


def _from_bytes(u8: torch.Tensor, dtype: torch.dtype, tail: Sequence[int]) -> torch.Tensor:
    """Inverse of `_row_bytes`: [M, nbytes] uint8 -> [M, *tail] of `dtype` (a copy if needed)."""
    return u8.contiguous().view(dtype).reshape(u8.shape[0], *tail)


def _unpack_rows(u8: torch.Tensor, num_rows: int, dtype: torch.dtype, tail: Sequence[int],
                 pad_byte: int = 0) -> torch.Tensor:
    """[num_real, nbytes] uint8 -> a fresh [num_rows, *tail] `dtype` tensor: the real rows first, then
    padding rows whose every byte is `pad_byte` (0 gives zeros, 0xFF gives -1 for integers)."""
    out = torch.empty(num_rows, u8.shape[1], dtype=torch.uint8, device=u8.device)
    out[:u8.shape[0]] = u8
    out[u8.shape[0]:] = pad_byte
    return out.view(dtype).reshape(num_rows, *tail)


def _split_columns(u8: torch.Tensor, widths: Sequence[int]) -> List[torch.Tensor]:
    out, offset = [], 0
    for w in widths:
        out.append(u8[:, offset:offset + w])
        offset += w
    assert offset == u8.shape[1]
    return out


def _done(device: torch.device) -> None:
    """All device work of this op has finished (the reference is synchronous; see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class ReferenceTransport(Transport):
    """Pure torch.distributed implementation of every op (see the module docstring)."""

    internode_normal = True

    name = "reference"
    # torch.distributed collectives staged through the host: no peer pointers, not capturable.
    capabilities = Capabilities(peer_load_store=False, remote_atomics=False, ordered_delivery=True, max_channels=1,
                                graph_safe=False, network="none")

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        # Low-latency double buffer: which half the next low-latency call uses (flips on every call,
        # like DeepEP), and the per-half zero-copy combine send buffers, keyed by shape.
        self._ll_idx = 0
        self._ll_combine_buffers: Dict[Tuple[int, int, int], List[torch.Tensor]] = {}
        self._local_buffers: Dict[bool, torch.Tensor] = {}   # get_local_buffer_tensor, made on first use
        self._arrived = 0   # the last call this rank arrived at (ctx.calls)
        self._op = "?"

    # ---- arrival and failures --------------------------------------------------------------------
    def _arrive(self, op: str) -> None:
        """Every rank runs this call, or PeerFailedError naming those that refused it (nothing moved)."""
        self._op = op
        call = self.ctx.calls
        if self.ctx.num_ranks == 1 or self._arrived == call:
            return
        self._arrived = call
        refused = arrive(self._comm, self.ctx.tag, op, call, None, self.ctx.timeout_s)
        if refused:
            raise PeerFailedError(op, self.ctx.rank, refused)

    def refuse(self, op: str, call: int, reason: str) -> None:
        if self.ctx.num_ranks == 1 or self._arrived == call:
            return   # it arrived already: the peers meet its failure in the exchanges that follow (timeout_s)
        self._arrived = call
        arrive(self._comm, self.ctx.tag, op, call, reason, self.ctx.timeout_s)

    def _timed(self, exchange, *args):
        try:
            return exchange(*args, timeout_s=self.ctx.timeout_s)
        except DeadlinePassed:
            raise CommError(f"{self._op} on rank {self.ctx.rank}: an exchange of the op did not complete within "
                            f"{self.ctx.timeout_s:g} s after every rank had arrived (a rank failed or stopped in the "
                            f"middle of the op); this Buffer cannot be used again, create a new one on every rank") \
                from None

    # ---- helpers -------------------------------------------------------------------------------
    @property
    def _comm(self):
        return self.ctx.comm

    def _exchange_rows(self, rows: torch.Tensor, send_rows: Sequence[int],
                       recv_rows: Sequence[int]) -> torch.Tensor:
        """All-to-all of [M, B] uint8 rows: the first send_rows[0] rows go to rank 0, and so on.
        Returns [sum(recv_rows), B], ordered by source rank."""
        width = rows.shape[1]
        flat = self._timed(self._comm.all_to_all_bytes, rows.reshape(-1), [int(c) * width for c in send_rows],
                           [int(c) * width for c in recv_rows])
        return flat.view(-1, width)

    @staticmethod
    def _send_order(is_token_in_rank: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """Token indices in send order (destination rank ascending, then token ascending) and the
        number of tokens per destination."""
        _, tokens = is_token_in_rank.t().nonzero(as_tuple=True)
        return tokens, is_token_in_rank.sum(dim=0).tolist()

    def _recv_counts_from_prefix(self, rank_prefix_matrix: torch.Tensor) -> List[int]:
        column = rank_prefix_matrix[:, self.ctx.rank].to("cpu", torch.int64)
        return torch.diff(column, prepend=column.new_zeros(1)).tolist()

    # ---- normal mode ---------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        self._arrive("dispatch")
        rank, num_ranks = self.ctx.rank, self.ctx.num_ranks
        x, x_scales, topk_idx, topk_weights = args.x, args.x_scales, args.topk_idx, args.topk_weights
        device = x.device
        num_tokens, hidden = x.shape
        num_local_experts = args.num_experts // num_ranks
        expert_begin = rank * num_local_experts
        in_rank = args.is_token_in_rank

        # 1. Metadata: the full [src, dst] token-count matrix and every rank's per-expert counts.
        tokens, send_counts = self._send_order(in_rank)
        gathered = self._timed(self._comm.allgather_object, (send_counts, args.num_tokens_per_expert.tolist()))
        counts = torch.tensor([g[0] for g in gathered], dtype=torch.int64)        # [R, R]
        recv_counts = counts[:, rank].tolist()
        num_recv = sum(recv_counts)
        if args.num_worst_tokens > 0:
            # Every rank checks every rank, so all raise together and nobody is left waiting.
            totals = counts.sum(dim=0).tolist()
            over = [(j, n) for j, n in enumerate(totals) if n > args.num_worst_tokens]
            if over:
                raise RuntimeError(
                    f"dispatch: num_worst_tokens={args.num_worst_tokens} is too small: "
                    + ", ".join(f"rank {j} would receive {n} tokens" for j, n in over))
        num_rows = args.num_worst_tokens if args.num_worst_tokens > 0 else num_recv
        rank_prefix_matrix = counts.cumsum(dim=0).to(torch.int32).to(device)

        # 2. Pack and move the rows: payload | scales | topk idx | topk weights | source index.
        pieces = [x] + ([x_scales] if x_scales is not None else [])
        if topk_idx is not None:
            pieces += [topk_idx, topk_weights]
        pieces.append(torch.arange(num_tokens, dtype=torch.int32, device=device))
        pieces_u8 = [_row_bytes(p) for p in pieces]
        rows = torch.cat([p.index_select(0, tokens) for p in pieces_u8], dim=1)
        recv = self._exchange_rows(rows, send_counts, recv_counts)

        # 3. Unpack into outputs of num_rows rows (real rows first, then padding).
        cols = _split_columns(recv, [p.shape[1] for p in pieces_u8])
        recv_x = _unpack_rows(cols.pop(0), num_rows, x.dtype, (hidden,))
        recv_x_scales = None
        if x_scales is not None:
            recv_x_scales = _unpack_rows(cols.pop(0), num_rows, x_scales.dtype, tuple(x_scales.shape[1:]))
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            num_topk = topk_idx.shape[1]
            global_idx = _unpack_rows(cols.pop(0), num_rows, topk_idx.dtype, (num_topk,), pad_byte=0xFF)  # -1
            weights = _unpack_rows(cols.pop(0), num_rows, topk_weights.dtype, (num_topk,))
            local = global_idx - expert_begin
            is_local = (global_idx >= expert_begin) & (global_idx < expert_begin + num_local_experts)
            recv_topk_idx = torch.where(is_local, local, torch.full_like(local, -1))
            recv_topk_weights = torch.where(is_local, weights, torch.zeros_like(weights))
        recv_src_idx = _unpack_rows(cols.pop(0), num_rows, torch.int32, (1,), pad_byte=0xFF).view(num_rows)

        # 4. Tokens per local expert (aligned); empty with num_worst_tokens (no CPU sync in DeepEP).
        num_recv_tokens_per_expert_list: List[int] = []
        if args.num_worst_tokens == 0:
            if topk_idx is not None:
                hits = torch.zeros(num_recv, num_local_experts, dtype=torch.bool, device=device)
                valid = recv_topk_idx >= 0
                row_ids = torch.arange(num_recv, device=device).unsqueeze(1).expand_as(recv_topk_idx)
                hits[row_ids[valid], recv_topk_idx[valid]] = True
                per_expert = hits.sum(dim=0).tolist()
            else:
                per_expert = [sum(g[1][expert_begin + e] for g in gathered) for e in range(num_local_experts)]
            align = max(1, args.expert_alignment)
            num_recv_tokens_per_expert_list = [(c + align - 1) // align * align for c in per_expert]

        # 5. Handle: where each of my tokens landed at each destination.
        base = (counts[:rank].sum(dim=0) if rank > 0 else torch.zeros(num_ranks, dtype=torch.int64)).to(device)
        position = in_rank.to(torch.int64).cumsum(dim=0) - 1 + base.unsqueeze(0)
        send_rows = torch.where(in_rank, position, torch.full_like(position, -1)).to(torch.int32)
        handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix_matrix, recv_src_idx=recv_src_idx, is_token_in_rank=in_rank,
            send_rows=send_rows, num_recv_tokens=num_recv, num_recv_rows=num_rows, num_tokens=num_tokens,
            hidden=hidden, buffer_uid=self.ctx.uid, transport_state=None)
        _done(device)
        return DispatchResult(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
                              num_recv_tokens_per_expert_list, handle)

    def cached_dispatch(self, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self._arrive("dispatch")
        x, x_scales, handle = args.x, args.x_scales, args.handle
        device = x.device
        tokens, send_counts = self._send_order(handle.is_token_in_rank)
        recv_counts = self._recv_counts_from_prefix(handle.rank_prefix_matrix)
        num_rows = handle.num_recv_rows
        pieces_u8 = [_row_bytes(x)] + ([_row_bytes(x_scales)] if x_scales is not None else [])
        rows = torch.cat([p.index_select(0, tokens) for p in pieces_u8], dim=1)
        recv = self._exchange_rows(rows, send_counts, recv_counts)
        cols = _split_columns(recv, [p.shape[1] for p in pieces_u8])
        recv_x = _unpack_rows(cols[0], num_rows, x.dtype, tuple(x.shape[1:]))
        recv_x_scales = None
        if x_scales is not None:
            recv_x_scales = _unpack_rows(cols[1], num_rows, x_scales.dtype, tuple(x_scales.shape[1:]))
        _done(device)
        return recv_x, recv_x_scales

    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Reduction order (fixed, hence deterministic): acc = +0.0 (float32), then += bias_0, += bias_1,
        then += the row returned by each rank that received the token, rank ascending; cast to bf16.
        Top-k weights: +0.0, then += each receiving rank's row, rank ascending. No weights are applied.
        Over several nodes (docs/INTERNODE.md) the rows of each node are summed first (float32 from +0.0,
        rank ascending, rounded to bf16: what crosses the network), then acc += those, node ascending;
        the weights the same way without the rounding."""
        self._arrive("combine")
        x, handle, topk_weights, bias_0, bias_1 = args.x, args.handle, args.topk_weights, args.bias_0, args.bias_1
        device = x.device
        in_rank = handle.is_token_in_rank
        num_tokens, hidden = handle.num_tokens, x.shape[1]
        num_recv = handle.num_recv_tokens
        # What I send back to each source (my received rows are grouped by source, in order) and what
        # each destination of my tokens sends back to me (my tokens it received, in token order).
        send_counts = self._recv_counts_from_prefix(handle.rank_prefix_matrix)
        tokens, recv_counts = self._send_order(in_rank)
        pieces_u8 = [_row_bytes(x[:num_recv])]
        if topk_weights is not None:
            pieces_u8.append(_row_bytes(topk_weights[:num_recv]))
        rows = torch.cat(pieces_u8, dim=1) if len(pieces_u8) > 1 else pieces_u8[0]
        back = self._exchange_rows(rows, send_counts, recv_counts)
        cols = _split_columns(back, [p.shape[1] for p in pieces_u8])

        values = _from_bytes(cols[0], torch.bfloat16, (hidden,)).float()
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        for bias in (bias_0, bias_1):
            if bias is not None:
                acc += bias.float()
        # index_add_ per destination: indices are unique within one destination, so each element gets
        # one addition per rank, in rank order, on CPU and CUDA alike.
        per_node = self.ctx.ranks_per_node if self.ctx.num_nodes > 1 else 0
        self._sum_by_rank(acc, values, tokens, recv_counts, per_node, torch.bfloat16)
        combined_x = acc.to(torch.bfloat16)

        combined_weights = None
        if topk_weights is not None:
            w = _from_bytes(cols[1], torch.float32, (topk_weights.shape[1],))
            combined_weights = torch.zeros(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=device)
            self._sum_by_rank(combined_weights, w, tokens, recv_counts, per_node, None)
        _done(device)
        return combined_x, combined_weights

    @staticmethod
    def _sum_by_rank(acc: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, counts: Sequence[int],
                     ranks_per_node: int, node_dtype: Optional[torch.dtype]) -> None:
        """acc[token] += the rows each rank sent back (`counts[r]` rows of `values`, tokens `tokens`), rank
        ascending; with ranks_per_node > 0, per node first (a partial from +0.0, rounded through
        node_dtype if given), then the partials, node ascending."""
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        step = ranks_per_node or len(counts)
        for first in range(0, len(counts), step):
            part = acc if not ranks_per_node else torch.zeros_like(acc)
            for r in range(first, first + step):
                part.index_add_(0, tokens[offsets[r]:offsets[r + 1]], values[offsets[r]:offsets[r + 1]])
            if ranks_per_node:
                acc += part if node_dtype is None else part.to(node_dtype).to(acc.dtype)

    # ---- low-latency mode ----------------------------------------------------------------------
    def _flip_half(self) -> int:
        half = self._ll_idx
        self._ll_idx ^= 1
        return half

    def low_latency_dispatch(self, args: LowLatencyDispatchArgs) -> LowLatencyDispatchResult:
        self._arrive("low_latency_dispatch")
        num_ranks = self.ctx.num_ranks
        x, topk_idx = args.x, args.topk_idx
        device = x.device
        num_tokens, hidden = x.shape
        max_tokens = args.num_max_dispatch_tokens_per_rank
        num_local_experts = args.num_experts // num_ranks
        slots = num_ranks * max_tokens
        self._flip_half()

        # Send side: one message per (token, k) with an expert, ordered by destination rank, then
        # token, then k. Message = [source token (int32) | local expert (int32) | payload].
        if args.use_fp8:
            data, scales = _fp8_cast(x, args.round_scale)
            payload_u8 = torch.cat([_row_bytes(data), _row_bytes(scales)], dim=1)
        else:
            payload_u8 = _row_bytes(x)
        token, k = (topk_idx >= 0).nonzero(as_tuple=True)
        expert = topk_idx[token, k]
        dst = torch.div(expert, num_local_experts, rounding_mode="floor")
        order = torch.argsort(dst, stable=True)
        token, expert, dst = token[order], expert[order], dst[order]
        header = torch.stack([token, expert - dst * num_local_experts], dim=1).to(torch.int32)
        rows = torch.cat([_row_bytes(header), payload_u8.index_select(0, token)], dim=1)
        send_counts = torch.bincount(dst, minlength=num_ranks).tolist()

        # Outputs are allocated now (like DeepEP's buffer views) but hold data only after the receive.
        num_scales = hidden // FP8_BLOCK
        recv_x, recv_x_scales, recv_count, src_info, layout_range = allocate_low_latency_outputs(
            num_local_experts, num_ranks, max_tokens, hidden, args.use_fp8, args.use_ue8m0, device)

        start = time.perf_counter_ns()
        recv_counts = self._timed(self._comm.all_to_all_counts, send_counts)
        recv = self._exchange_rows(rows, send_counts, recv_counts)
        wait_ns = time.perf_counter_ns() - start

        def receive() -> None:
            num_msgs = recv.shape[0]
            header_u8, body_u8 = recv[:, :8], recv[:, 8:]
            hdr = _from_bytes(header_u8, torch.int32, (2,))
            src_token, local_expert = hdr[:, 0], hdr[:, 1].to(torch.int64)
            src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                               torch.tensor(recv_counts, device=device))
            # [local expert, source rank] message counts; slots of an expert are packed by source rank,
            # and within a source rank keep the arrival order (source token ascending).
            per_pair = torch.bincount(local_expert * num_ranks + src_rank,
                                      minlength=num_local_experts * num_ranks).view(num_local_experts, num_ranks)
            per_expert = per_pair.sum(dim=1)
            begin = per_pair.cumsum(dim=1) - per_pair
            layout_range.copy_((begin << 32) | per_pair)
            recv_count.copy_(per_expert)
            order = torch.argsort(local_expert, stable=True)
            e_sorted = local_expert[order]
            slot = torch.arange(num_msgs, device=device) - (per_expert.cumsum(0) - per_expert)[e_sorted]
            flat_slot = e_sorted * slots + slot
            src_info.view(-1)[flat_slot] = src_token[order]
            body = body_u8.index_select(0, order)
            if args.use_fp8:
                data_u8, scale_u8 = _split_columns(body, [hidden, num_scales * 4])
                recv_x.view(torch.uint8).view(-1, hidden)[flat_slot] = data_u8
                scale = _from_bytes(scale_u8, torch.float32, (num_scales,))
                recv_x_scales[e_sorted, slot] = _pack_ue8m0(scale) if args.use_ue8m0 else scale
            else:
                recv_x.view(torch.uint8).view(-1, hidden * 2)[flat_slot] = body
            if args.cumulative_local_expert_recv_stats is not None:
                args.cumulative_local_expert_recv_stats += recv_count
            if args.dispatch_wait_recv_cost_stats is not None:
                # The reference waits for all sources at once in one collective and cannot tell them
                # apart, so the whole wait is attributed to every source rank.
                args.dispatch_wait_recv_cost_stats += wait_ns
            _done(device)

        handle = LowLatencyHandle(src_info, layout_range, max_tokens, hidden, args.num_experts)
        if args.return_recv_hook:
            _done(device)
            return LowLatencyDispatchResult(recv_x, recv_x_scales, recv_count, handle, receive)
        receive()
        return LowLatencyDispatchResult(recv_x, recv_x_scales, recv_count, handle, None)

    def low_latency_combine(self, args: LowLatencyCombineArgs) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
        """out[t] = sum over k with topk_idx[t, k] != -1 (k ascending, from +0.0, float32) of
        topk_weights[t, k] * x_expert[slot of (this rank, t)], cast to bf16."""
        self._arrive("low_latency_combine")
        rank, num_ranks = self.ctx.rank, self.ctx.num_ranks
        x, topk_idx, topk_weights, handle = args.x, args.topk_idx, args.topk_weights, args.handle
        device = x.device
        num_local_experts, slots, hidden = x.shape
        num_tokens, num_topk = topk_idx.shape
        self._flip_half()
        # With zero_copy, x is the buffer from get_next_low_latency_combine_buffer: the reference reads
        # it in place exactly like any other x, so both paths are the same code.

        # Send side: for every (local expert, source rank) block of the dispatch layout, return the
        # rows to the source, ordered by source rank, then local expert, then slot.
        # Message = [source token (int32) | global expert (int32) | bf16 row].
        layout = handle.layout_range.to(torch.int64)
        begin_er, count_er = layout >> 32, layout & 0xFFFFFFFF
        count = count_er.t().reshape(-1)                 # pairs ordered (source rank, local expert)
        begin = begin_er.t().reshape(-1)
        pair = torch.repeat_interleave(torch.arange(num_ranks * num_local_experts, device=device), count)
        within = torch.arange(pair.numel(), device=device) - (count.cumsum(0) - count)[pair]
        local_expert = pair % num_local_experts
        slot = begin[pair] + within
        header = torch.stack([handle.src_info[local_expert, slot].to(torch.int64),
                              local_expert + rank * num_local_experts], dim=1).to(torch.int32)
        rows = torch.cat([_row_bytes(header), _row_bytes(x[local_expert, slot])], dim=1)
        send_counts = count_er.sum(dim=0).tolist()

        # What comes back to me: one row per (token, k) with an expert, from the expert's rank.
        valid = topk_idx >= 0
        recv_counts = torch.bincount(torch.div(topk_idx[valid], num_local_experts, rounding_mode="floor"),
                                     minlength=num_ranks).tolist()
        out = args.out if args.out is not None else torch.empty(num_tokens, hidden, dtype=torch.bfloat16,
                                                                  device=device)
        start = time.perf_counter_ns()
        back = self._exchange_rows(rows, send_counts, recv_counts)
        wait_ns = time.perf_counter_ns() - start

        def receive() -> None:
            acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
            if back.shape[0]:
                hdr = _from_bytes(back[:, :8], torch.int32, (2,)).to(torch.int64)
                values = _from_bytes(back[:, 8:], torch.bfloat16, (hidden,))
                if args.use_logfmt:   # what a LogFMT-10 receiver decodes
                    values = logfmt.roundtrip(values)
                key = hdr[:, 1] * (num_tokens + 1) + hdr[:, 0]
                key_sorted, key_order = torch.sort(key)
                token_ids = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(topk_idx)
                want = topk_idx * (num_tokens + 1) + token_ids
                pos = torch.searchsorted(key_sorted, want.clamp(min=0)).clamp(max=key.numel() - 1)
                found = key_sorted[pos] == want
                if bool((found != valid).any()):
                    raise RuntimeError(f"low_latency_combine (rank {rank}): topk_idx does not match the "
                                       "dispatch this handle came from")
                row = key_order[pos]
                for k in range(num_topk):
                    term = values.index_select(0, row[:, k]).float() * topk_weights[:, k:k + 1]
                    acc += torch.where(valid[:, k:k + 1], term, torch.zeros_like(term))
            out.copy_(acc.to(torch.bfloat16))
            if args.combine_wait_recv_cost_stats is not None:
                # One collective for all sources: the whole wait is attributed to every source rank.
                args.combine_wait_recv_cost_stats += wait_ns
            _done(device)

        if args.return_recv_hook:
            _done(device)
            return out, receive
        receive()
        return out, None

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        num_local_experts = handle.num_experts // self.ctx.num_ranks
        key = (num_local_experts, self.ctx.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        if key not in self._ll_combine_buffers:
            self._ll_combine_buffers[key] = [torch.empty(key, dtype=torch.bfloat16, device=self.ctx.device)
                                             for _ in range(2)]
        return self._ll_combine_buffers[key][self._ll_idx]

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: the reference keeps no signals or counters between calls (every exchange
        is a self-contained collective), so a dirty buffer cannot exist. Kept callable for the API."""

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """The ops here move data by collectives, not through a buffer: this rank's buffer of that size
        is plain memory, made on first request (the kernels' transports return their window)."""
        if use_rdma_buffer not in self._local_buffers:
            nbytes = self.ctx.num_rdma_bytes if use_rdma_buffer else self.ctx.num_nvl_bytes
            self._local_buffers[use_rdma_buffer] = torch.zeros(nbytes, dtype=torch.uint8, device=self.ctx.device)
        return self._local_buffers[use_rdma_buffer]

    def destroy(self) -> None:
        self._ll_combine_buffers.clear()
        self._local_buffers.clear()


def probe_reference() -> TransportStatus:
    """Its registry row's probe: torch.distributed is there (never raises: transports/probe.py)."""
    from .probe import _status

    details: Dict = {}
    problems: List[str] = []
    try:
        import torch
        import torch.distributed as dist
        details["torch"] = torch.__version__
        if not dist.is_available():
            problems.append("torch.distributed is not available in this torch build")
        backends = [b for b, f in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"),
                                   ("mpi", "is_mpi_available")) if getattr(dist, f, lambda: False)()]
        details["process_group_backends"] = ",".join(backends)
        cuda = torch.cuda.is_available()
        details["cuda_visible"] = str(cuda)
        if cuda:
            details["device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # pragma: no cover
        problems.append(f"torch.distributed unusable: {type(e).__name__}: {e}")
    where = f"CUDA device {details['device']}" if "device" in details else "CPU tensors (no CUDA)"
    return _status("reference", problems, f"torch.distributed all_to_all on {where}", details)
