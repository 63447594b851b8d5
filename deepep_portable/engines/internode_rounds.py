"""An internode call larger than the window, in rounds (docs/INTERNODE.md, "Rounds").

The window holds N tokens per rank and op for a shape (internode_layout). A call with more runs as K rounds,
each a whole op of the internode kernels: round k moves every rank's tokens [k * N, (k + 1) * N) (fewer, or
none, on a rank with fewer tokens), so the window never grows with the token count. Every rank must run the
same K: the first round's count messages carry each rank's tokens in the whole call, and every rank reads the
largest (`rounds_for`), so a rank with few tokens takes part in the later rounds with none.

Each round's receive rows come out ordered by source rank, then source token, as one op's do. The call's rows
must be in that order over the whole call: the rows of source s are those of round 0, then round 1, and so
on. `offsets` turns the rounds' rank prefix matrices (every rank holds all of them) into where each round's
rows go, at the receiver and, for the handle's send_rows, at the sender. Everything here is torch on the
tensors the kernels wrote, with no host synchronisation, so a cached dispatch in rounds stays capturable.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from ..contract import CachedDispatchArgs, CombineArgs, DispatchArgs, DispatchResult
from ..failures import after_launch
from ..handles import DispatchHandle, InternodeRounds


def rounds_for(most_call_tokens: int, tokens_per_round: int) -> int:
    """Rounds of a call whose largest rank has `most_call_tokens` tokens (at least one round)."""
    return max(1, -(-most_call_tokens // tokens_per_round))


def round_span(k: int, num_tokens: int, tokens_per_round: int) -> slice:
    """My tokens in round k (empty past my last token)."""
    lo = min(k * tokens_per_round, num_tokens)
    return slice(lo, min(lo + tokens_per_round, num_tokens))


def offsets(rank_prefix_matrices: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [K, R, R]: [k, s, r] = what to add to a row's index in round k's receive rows at rank r, for a row from
    source s, to get its index in the call's receive rows at r. Each matrix is one round's [s, r] = rows ranks
    0..s send rank r in that round."""
    cum = torch.stack([m.to(torch.int64) for m in rank_prefix_matrices])          # [K, S, R]
    counts = torch.diff(cum, dim=1, prepend=torch.zeros_like(cum[:, :1]))          # rows s -> r in round k
    total = counts.sum(dim=0)                                                      # [S, R] over the call
    before_source = total.cumsum(dim=0) - total                                    # rows r gets from ranks < s
    earlier_rounds = counts.cumsum(dim=0) - counts                                 # s -> r in rounds < k
    return before_source.unsqueeze(0) + earlier_rounds - (cum - counts)


def call_rank_prefix_matrix(rank_prefix_matrices: Sequence[torch.Tensor]) -> torch.Tensor:
    """The call's [s, r] = rows ranks 0..s send rank r: the rounds' matrices summed (int32)."""
    return torch.stack([m.to(torch.int64) for m in rank_prefix_matrices]).sum(dim=0).to(torch.int32)


def receive_rows(offs: torch.Tensor, rank_prefix_matrices: Sequence[torch.Tensor], rank: int,
                 round_rows: Sequence[int]) -> List[torch.Tensor]:
    """Per round, int64 [its rows]: where each of its receive rows at `rank` lands among the call's rows.
    `round_rows` (host ints) are the rounds' row counts at `rank`."""
    out = []
    for k, (m, rows) in enumerate(zip(rank_prefix_matrices, round_rows)):
        col = m[:, rank].to(torch.int64)
        per_source = torch.diff(col, prepend=col.new_zeros(1))
        source = torch.repeat_interleave(torch.arange(col.numel(), device=col.device), per_source, output_size=rows)
        out.append(torch.arange(rows, device=col.device) + offs[k, :, rank][source])
    return out


def call_send_rows(offs: torch.Tensor, round_send_rows: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """int32 [T, R]: the row of each of my tokens at each rank in the call's receive rows (-1: not sent), from
    each round's [its tokens, R] rows in that round's receive rows."""
    parts = [torch.where(rows >= 0, rows.to(torch.int64) + offs[k, rank].unsqueeze(0), -1).to(torch.int32)
             for k, rows in enumerate(round_send_rows)]
    return torch.cat(parts, dim=0)


def scatter_rows(parts: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """`out` (the call's rows) with each round's part placed at its rows."""
    raw = _bytes if out.element_size() == 1 and out.dtype not in (torch.uint8, torch.int8) else (lambda t: t)
    for part, where in zip(parts, rows):
        if part.size(0):
            raw(out).index_copy_(0, where, raw(part))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:   # FP8 rows move as bytes (index_copy_ has no FP8 kernels)
    return t.view(torch.uint8)


# ---- the engine's calls in rounds (engines/internode.py: dispatch_op / combine_op are one op each) ----------------

def round_args(args: DispatchArgs, k: int, tokens_per_round: int, no_counts: torch.Tensor) -> DispatchArgs:
    """Round k's part of a dispatch call. The call's expert counts travel in round 0 and `no_counts` (zeros) in the
    others, so the counts each rank learns add up to the call's (aligned once)."""
    span = round_span(k, args.x.size(0), tokens_per_round)
    cut = lambda t: None if t is None else t[span]   # noqa: E731
    return replace(args, x=args.x[span], x_scales=cut(args.x_scales), topk_idx=cut(args.topk_idx),
                   topk_weights=cut(args.topk_weights), is_token_in_rank=args.is_token_in_rank[span],
                   num_tokens_per_expert=args.num_tokens_per_expert if k == 0 else no_counts,
                   expert_alignment=args.expert_alignment if k == 0 else 1)


def round_failed(exc: BaseException, k: int, num_rounds: int) -> None:
    """Round k of num_rounds raised `exc`. A failure after a round's launch (its outputs could not be allocated) is this
    rank's alone only in the last round: before it, the peers wait for this rank's later rounds, so the call counts as
    refused (failures.py tells the peers) instead."""
    if k < num_rounds - 1:
        exc.after_launch = False


def dispatch(engine, args: DispatchArgs, tokens_per_round: int) -> DispatchResult:
    """A fresh dispatch (its receive count learned by the host): one op when every rank's tokens fit a round, else
    as many rounds as the largest rank needs (the first round's count messages say how many)."""
    call_tokens = args.x.size(0)
    first = args if call_tokens <= tokens_per_round else round_args(args, 0, tokens_per_round, None)
    try:
        result = engine.dispatch_op(first.x, first.x_scales, args.num_sms, fresh=first, call_tokens=call_tokens,
                                    tokens_per_round=tokens_per_round)
    except BaseException as e:
        round_failed(e, 0, rounds_for(engine.most_call_tokens, tokens_per_round))   # the count came before outputs
        raise
    num_rounds = rounds_for(engine.most_call_tokens, tokens_per_round)
    if num_rounds == 1:
        return result
    with torch.cuda.stream(engine.ctx.comm_stream):   # read by the comm stream's kernels alone
        no_counts = torch.zeros_like(args.num_tokens_per_expert)
    results = [result]
    for k in range(1, num_rounds):
        part = round_args(args, k, tokens_per_round, no_counts)
        try:
            results.append(engine.dispatch_op(part.x, part.x_scales, args.num_sms, fresh=part,
                                              call_tokens=call_tokens, tokens_per_round=tokens_per_round))
        except BaseException as e:
            round_failed(e, k, num_rounds)
            raise
    try:
        return _merged_dispatch(engine, args, results, tokens_per_round, call_tokens)
    except BaseException:
        raise after_launch(sys.exc_info()[1])   # every round ran: nobody waits for this rank


def _merged_dispatch(engine, args: DispatchArgs, results: List[DispatchResult], tokens_per_round: int,
                     call_tokens: int) -> DispatchResult:
    """The call's outputs and handle from its rounds' (on the caller's stream, filled on the comm stream)."""
    rank, comm = engine.rank, engine.ctx.comm_stream
    result = results[0]
    handles = [r.handle for r in results]
    num_rows = sum(h.num_recv_rows for h in handles)
    dev = args.x.device

    def outputs(parts):   # the call's tensor, on the caller's stream like every output; filled on the comm stream
        first_part = next((t for t in parts if t is not None), None)
        return None if first_part is None else torch.empty((num_rows, *first_part.shape[1:]), dtype=first_part.dtype,
                                                           device=dev)
    merged = [outputs([getattr(r, f) for r in results]) for f in ("recv_x", "recv_x_scales", "recv_topk_idx",
                                                                  "recv_topk_weights")]
    src_idx = torch.empty(num_rows, dtype=torch.int32, device=dev)
    with torch.cuda.stream(comm):
        matrices = [h.rank_prefix_matrix for h in handles]
        offs = offsets(matrices)
        rows = receive_rows(offs, matrices, rank, [h.num_recv_rows for h in handles])
        for out, field in zip(merged, ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights")):
            if out is not None:
                scatter_rows([getattr(r, field) for r in results], rows, out)
        scatter_rows([h.recv_src_idx + k * tokens_per_round for k, h in enumerate(handles)], rows, src_idx)
        send_rows = call_send_rows(offs, [h.send_rows for h in handles], rank)
        matrix = call_rank_prefix_matrix(matrices)
    _read_on(comm, [t for r in results for t in (r.recv_x, r.recv_x_scales, r.recv_topk_idx, r.recv_topk_weights,
                                                 r.handle.recv_src_idx)])
    handle = DispatchHandle(
        rank_prefix_matrix=matrix, recv_src_idx=src_idx, is_token_in_rank=args.is_token_in_rank, send_rows=send_rows,
        num_recv_tokens=num_rows, num_recv_rows=num_rows, num_tokens=call_tokens, hidden=args.x.size(1),
        buffer_uid=engine.ctx.uid, transport_state=InternodeRounds(tokens_per_round, tuple(handles), tuple(rows)))
    return DispatchResult(*merged, result.num_recv_tokens_per_expert_list, handle)


def cached_dispatch(engine, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The rounds of the handle's dispatch again, each with its own handle; no host synchronisation."""
    state: InternodeRounds = args.handle.transport_state
    parts = []
    for k, handle in enumerate(state.rounds):
        span = round_span(k, args.x.size(0), state.tokens_per_round)
        try:
            parts.append(engine.dispatch_op(args.x[span], None if args.x_scales is None else args.x_scales[span],
                                            args.num_sms, handle=handle))
        except BaseException as e:
            round_failed(e, k, len(state.rounds))
            raise
    try:
        return _merged_cached(engine, args, parts)
    except BaseException:
        raise after_launch(sys.exc_info()[1])   # every round ran: nobody waits for this rank


def _merged_cached(engine, args: CachedDispatchArgs, parts) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The call's received rows (and scales) from its rounds' (on the caller's stream, filled on the comm stream)."""
    state: InternodeRounds = args.handle.transport_state
    num_rows, dev = args.handle.num_recv_rows, args.x.device
    recv_x = torch.empty((num_rows, args.x.size(1)), dtype=args.x.dtype, device=dev)
    recv_scales = None if args.x_scales is None else \
        torch.empty((num_rows, args.x_scales.size(1)), dtype=args.x_scales.dtype, device=dev)
    comm = engine.ctx.comm_stream
    with torch.cuda.stream(comm):
        scatter_rows([p.recv_x for p in parts], state.rows, recv_x)
        if recv_scales is not None:
            scatter_rows([p.recv_x_scales for p in parts], state.rows, recv_scales)
    _read_on(comm, [t for p in parts for t in (p.recv_x, p.recv_x_scales)])
    return recv_x, recv_scales


def _read_on(stream, tensors) -> None:
    """The rounds' outputs were made on the caller's stream and are read on the comm stream: keep their memory
    from the caller's next allocations until the comm stream is past them (the caller may not wait for it). While a
    graph captures, the allocator holds such a block until the capture ends, so the replayed graph never reuses it
    under the comm stream's copy either."""
    if stream is None:
        return
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(stream)


def combine(engine, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Round k reduces the call's tokens of round k: its rows gathered from the call's rows (the dispatch's order),
    its partials written into the call's outputs in place. Every round is checked before the first launches."""
    state: InternodeRounds = args.handle.transport_state
    hidden = args.x.size(1)
    topk = 0 if args.topk_weights is None else args.topk_weights.size(1)
    for handle in state.rounds:
        engine.check_combine(handle, hidden, topk, state.tokens_per_round)
    num_tokens, n, dev = args.handle.num_tokens, state.tokens_per_round, args.x.device
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=dev)
    out_w = None if topk == 0 else torch.empty(num_tokens, topk, dtype=torch.float32, device=dev)
    for k, (handle, rows) in enumerate(zip(state.rounds, state.rows)):
        span = round_span(k, num_tokens, n)
        with torch.cuda.stream(engine.ctx.comm_stream):   # temporaries of the comm stream alone
            x = args.x.index_select(0, rows)
            weights = None if args.topk_weights is None else args.topk_weights.index_select(0, rows)
        cut = lambda t: None if t is None else t[span]   # noqa: E731
        engine.combine_op(replace(args, x=x, handle=handle, topk_weights=weights, bias_0=cut(args.bias_0),
                                  bias_1=cut(args.bias_1)), out=out[span], out_w=cut(out_w), layout_tokens=n)
    return out, out_w
