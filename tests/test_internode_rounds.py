"""engines/internode_rounds.py: a call's rounds put back together as one op's results would be, checked against
the call computed whole (plain torch: which source token each receive row holds, at every rank)."""
from __future__ import annotations

import pytest
import torch

from deepep_portable.engines import internode_rounds as rounds


def _receive(in_rank, spans):
    """One op over each source's tokens in `spans[s]`: per rank, its receive rows as (source, token), ordered by
    source then token; the rank prefix matrix; each source's send rows [its span's tokens, R]."""
    num_ranks = len(in_rank)
    recv = [[(s, t) for s in range(num_ranks) for t in range(spans[s].start, spans[s].stop) if in_rank[s][t, r]]
            for r in range(num_ranks)]
    counts = torch.tensor([[sum(1 for t in range(spans[s].start, spans[s].stop) if in_rank[s][t, r])
                            for r in range(num_ranks)] for s in range(num_ranks)])
    matrix = counts.cumsum(0).to(torch.int32)
    send_rows = []
    for s in range(num_ranks):
        rows = torch.full((spans[s].stop - spans[s].start, num_ranks), -1, dtype=torch.int32)
        for r in range(num_ranks):
            where = {st: i for i, st in enumerate(recv[r])}
            for t in range(spans[s].start, spans[s].stop):
                if in_rank[s][t, r]:
                    rows[t - spans[s].start, r] = where[(s, t)]
        send_rows.append(rows)
    return recv, matrix, send_rows


@pytest.mark.parametrize("num_ranks,tokens,n", [(4, [37, 5, 0, 64], 16), (2, [3, 3], 1), (8, [40] * 8, 40),
                                                (3, [100, 7, 55], 32)])
def test_rounds_give_the_calls_rows_order_and_send_rows(num_ranks, tokens, n):
    gen = torch.Generator().manual_seed(num_ranks * 1000 + n)
    in_rank = [torch.rand(t, num_ranks, generator=gen) < 0.4 for t in tokens]
    whole, whole_matrix, whole_send = _receive(in_rank, [slice(0, t) for t in tokens])
    k_rounds = rounds.rounds_for(max(tokens), n)
    assert k_rounds == max(1, -(-max(tokens) // n))
    per_round = [_receive(in_rank, [rounds.round_span(k, t, n) for t in tokens]) for k in range(k_rounds)]
    matrices = [m for _, m, _ in per_round]
    offs = rounds.offsets(matrices)
    assert torch.equal(rounds.call_rank_prefix_matrix(matrices), whole_matrix)
    for r in range(num_ranks):
        rows = rounds.receive_rows(offs, matrices, r, [len(recv[r]) for recv, _, _ in per_round])
        ids = [torch.tensor([s * 1000 + t for s, t in recv[r]], dtype=torch.int64).view(-1, 1)
               for recv, _, _ in per_round]
        out = rounds.scatter_rows(ids, rows, torch.full((len(whole[r]), 1), -7, dtype=torch.int64))
        assert out.view(-1).tolist() == [s * 1000 + t for s, t in whole[r]]
    for s in range(num_ranks):
        got = rounds.call_send_rows(offs, [send[s] for _, _, send in per_round], s)
        assert torch.equal(got, whole_send[s])


def test_round_spans_cover_every_token_once():
    for num_tokens in (0, 1, 15, 16, 17, 100):
        spans = [rounds.round_span(k, num_tokens, 16) for k in range(rounds.rounds_for(130, 16))]
        covered = [t for sp in spans for t in range(sp.start, sp.stop)]
        assert covered == list(range(num_tokens))
    assert rounds.rounds_for(0, 16) == 1 and rounds.rounds_for(16, 16) == 1 and rounds.rounds_for(17, 16) == 2


def test_scatter_moves_fp8_rows_bit_for_bit():
    raw = torch.randint(0, 256, (6, 32), dtype=torch.uint8)
    parts = [raw[:4].view(torch.float8_e4m3fn), raw[4:].view(torch.float8_e4m3fn)]
    rows = [torch.tensor([5, 0, 2, 3]), torch.tensor([1, 4])]
    out = rounds.scatter_rows(parts, rows, torch.empty(6, 32, dtype=torch.float8_e4m3fn))
    expected = torch.empty_like(raw)
    expected[rows[0]], expected[rows[1]] = raw[:4], raw[4:]
    assert torch.equal(out.view(torch.uint8), expected)
