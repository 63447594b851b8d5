"""Single-process tests of tests/oracle.py itself, and of the reference transport in a 1-rank world.

The multi-rank oracle tests simulate R ranks in one process (the oracle needs no communication):
they check properties that follow from the definitions (dispatch then combine returns each token
times the number of ranks it visited, LL dispatch then combine is the weighted sum, ...), so a bug in
the oracle cannot hide behind an identical bug in the transport.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _topk(n, k, e, gen, p_none=0.15, all_none_token=True):
    idx = torch.rand(n, e, generator=gen).argsort(dim=1)[:, :k].to(torch.int64).contiguous()
    idx[torch.rand(n, k, generator=gen) < p_none] = -1
    if all_none_token and n > 1:
        idx[n // 2] = -1
    return idx


# ---- FP8 cast --------------------------------------------------------------------------------------
def _fp8_inputs():
    gen = _gen(1)
    x = torch.randn(64, 1024, generator=gen) * torch.logspace(-6, 4, 64).unsqueeze(1)
    x[0, :128] = 0                                  # amax clamped to 1e-4
    x[1, 128:256] = 448.0 * 2.0 ** -3               # scale exactly a power of two
    x[2, 256:384] = -1e-30                          # far below the clamp
    x[3, :] = 3.0e38 / 1e30                         # large values
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_cast_matches_reference_transport_bit_for_bit(round_scale, use_ue8m0):
    from deepep_portable.transports.reference import _fp8_cast, _pack_ue8m0

    x = _fp8_inputs()
    data, scales = oracle.fp8_cast(x, round_scale, use_ue8m0)
    ref_data, ref_scales = _fp8_cast(x, round_scale)
    if use_ue8m0:
        ref_scales = _pack_ue8m0(ref_scales)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert scales.dtype == ref_scales.dtype and torch.equal(scales, ref_scales)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, True)])
def test_fp8_cast_of_zero_tokens(round_scale, use_ue8m0):
    """A rank with no tokens casts an empty [0, H] tensor (found on the GPU: reshape(0, -1, 4) is ambiguous)."""
    data, scales = oracle.fp8_cast(torch.empty(0, 1024, dtype=torch.bfloat16), round_scale, use_ue8m0)
    assert data.shape == (0, 1024)
    assert scales.shape == ((0, 2) if use_ue8m0 else (0, 8))


def test_fp8_cast_definition():
    x = _fp8_inputs()
    data, scales = oracle.fp8_cast(x)
    assert data.dtype == torch.float8_e4m3fn and scales.shape == (64, 8) and scales.dtype == torch.float32
    assert not torch.isnan(data.float()).any()
    amax = x.float().reshape(64, 8, 128).abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(scales, amax / 448.0)
    assert data.float().abs().max() <= 448
    deq = oracle.fp8_dequant(data, scales)
    # e4m3: relative error <= 2^-4 for normals, absolute <= half the smallest subnormal (2^-10) * scale
    err = (deq - x.float()).abs().reshape(64, 8, 128)
    bound = torch.maximum(x.float().abs().reshape(64, 8, 128) * 2.0 ** -4, scales[:, :, None] * 2.0 ** -10)
    assert (err <= bound).all()
    # round_scale: powers of two, never smaller than the exact scale, at most twice it
    _, rounded = oracle.fp8_cast(x, round_scale=True)
    assert torch.equal(torch.frexp(rounded).mantissa, torch.full_like(rounded, 0.5))
    assert (rounded >= scales).all() and (rounded < 2 * scales).all()
    assert torch.equal(rounded[1, 1], torch.tensor(2.0 ** -3))


def test_ue8m0_packing():
    x = _fp8_inputs()
    _, rounded = oracle.fp8_cast(x, round_scale=True)
    _, packed = oracle.fp8_cast(x, round_scale=True, use_ue8m0=True)
    assert packed.shape == (64, 2) and packed.dtype == torch.int32
    exps = torch.stack([(packed.to(torch.int64) >> (8 * b)) & 0xFF for b in range(4)], dim=2).reshape(64, 8)
    assert torch.equal(exps - 127, torch.log2(rounded).to(torch.int64))


# ---- multi-rank properties (R ranks simulated in one process) ---------------------------------------
def _world(num_ranks, num_experts, k, hidden, seed, tokens=None):
    gen = _gen(seed)
    tokens = tokens or [int(torch.randint(0, 9, (1,), generator=gen)) for _ in range(num_ranks)]
    x = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
    idx = [_topk(n, k, num_experts, gen) for n in tokens]
    w = [torch.rand(n, k, generator=gen) for n in tokens]
    layout = [oracle.dispatch_layout(i, num_experts, num_ranks) for i in idx]
    return x, idx, w, layout


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_layout(num_ranks):
    x, idx, w, layout = _world(num_ranks, 12, 3, 128, 5, tokens=[7] * num_ranks)
    for i, (per_rank, per_expert, in_rank) in zip(idx, layout):
        for t in range(i.shape[0]):
            ranks = {int(e) // (12 // num_ranks) for e in i[t] if e >= 0}
            assert set(in_rank[t].nonzero().flatten().tolist()) == ranks
        assert int(per_expert.sum()) == int((i >= 0).sum())
        assert torch.equal(per_rank, in_rank.sum(0).to(torch.int32))


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_dispatch_then_combine_counts_each_visit(num_ranks):
    num_experts = 12
    x, idx, w, layout = _world(num_ranks, num_experts, 3, 128, 10 + num_ranks, tokens=[5, 0, 9, 3][:num_ranks])
    in_rank = [l[2] for l in layout]
    per_expert = [l[1] for l in layout]
    got = [oracle.dispatch(r, num_experts, x, in_rank, topk_idx_all=idx, topk_weights_all=w,
                           num_tokens_per_expert_all=per_expert) for r in range(num_ranks)]
    no_topk = [oracle.dispatch(r, num_experts, x, in_rank, num_tokens_per_expert_all=per_expert)
               for r in range(num_ranks)]
    local = num_experts // num_ranks
    for r, g in enumerate(got):
        assert g.num_recv_tokens == sum(int(m[:, r].sum()) for m in in_rank)
        assert g.num_recv_tokens_per_expert_list == no_topk[r].num_recv_tokens_per_expert_list
        # every received row is the source's token, with its local experts only
        for row in range(g.num_recv_tokens):
            src = int((g.rank_prefix_matrix[:, r] <= row).sum())
            t = int(g.recv_src_idx[row])
            assert torch.equal(g.recv_x[row], x[src][t])
            ids = idx[src][t]
            mine = (ids >= r * local) & (ids < (r + 1) * local)
            assert torch.equal(g.recv_topk_idx[row], torch.where(mine, ids - r * local, -1))
            assert int(got[src].send_rows[t, r]) == row
    combined = [oracle.combine(r, [g.recv_x for g in got], in_rank, [g.recv_topk_weights for g in got])
                for r in range(num_ranks)]
    for r, (cx, cw) in enumerate(combined):
        visits = in_rank[r].sum(1, keepdim=True).float()
        assert torch.equal(cx, (x[r].float() * visits).to(torch.bfloat16))
        assert torch.equal(cw, torch.where(idx[r] >= 0, w[r], 0.0))


def test_dispatch_alignment_and_worst_tokens():
    x, idx, w, layout = _world(2, 12, 3, 128, 3, tokens=[6, 4])
    in_rank = [l[2] for l in layout]
    per_expert = [l[1] for l in layout]
    plain = oracle.dispatch(0, 12, x, in_rank, topk_idx_all=idx, topk_weights_all=w, num_tokens_per_expert_all=per_expert)
    aligned = oracle.dispatch(0, 12, x, in_rank, topk_idx_all=idx, topk_weights_all=w,
                              num_tokens_per_expert_all=per_expert, expert_alignment=4)
    assert aligned.num_recv_tokens_per_expert_list == [(c + 3) // 4 * 4 for c in plain.num_recv_tokens_per_expert_list]
    worst = oracle.dispatch(0, 12, x, in_rank, topk_idx_all=idx, topk_weights_all=w,
                            num_tokens_per_expert_all=per_expert, num_worst_tokens=plain.num_recv_tokens + 3)
    n = plain.num_recv_tokens
    assert worst.num_recv_tokens_per_expert_list == [] and worst.recv_x.shape[0] == n + 3
    assert torch.equal(worst.recv_x[:n], plain.recv_x) and not worst.recv_x[n:].any()
    assert (worst.recv_topk_idx[n:] == -1).all() and not worst.recv_topk_weights[n:].any()
    with pytest.raises(RuntimeError):
        oracle.dispatch(0, 12, x, in_rank, topk_idx_all=idx, topk_weights_all=w,
                        num_tokens_per_expert_all=per_expert, num_worst_tokens=max(1, n - 1))


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_low_latency_dispatch_then_combine_is_weighted_sum(num_ranks):
    num_experts, k, hidden, max_tokens = 8, 3, 256, 6
    x, idx, w, _ = _world(num_ranks, num_experts, k, hidden, 20 + num_ranks, tokens=[6, 0, 4, 5][:num_ranks])
    got = [oracle.low_latency_dispatch(r, num_experts, max_tokens, x, idx) for r in range(num_ranks)]
    local = num_experts // num_ranks
    for r, g in enumerate(got):
        for e in range(local):
            expected_tokens = [(src, t) for src in range(num_ranks) for t in range(idx[src].shape[0])
                               if (idx[src][t] == r * local + e).any()]
            assert int(g.recv_count[e]) == len(expected_tokens)
            for slot, (src, t) in enumerate(expected_tokens):
                assert int(g.src_info[e, slot]) == t and torch.equal(g.recv_x[e, slot], x[src][t])
            begin = 0
            for src in range(num_ranks):
                count = sum(1 for s, _ in expected_tokens if s == src)
                assert int(g.layout_range[e, src]) == (begin << 32) | count
                begin += count
    for r in range(num_ranks):
        out = oracle.low_latency_combine(r, num_experts, max_tokens, [g.recv_x for g in got], idx, w[r])
        expected = torch.zeros(x[r].shape)
        for kk in range(k):
            expected = expected + torch.where(idx[r][:, kk:kk + 1] >= 0, x[r].float() * w[r][:, kk:kk + 1], 0.0)
        assert torch.equal(out, expected.to(torch.bfloat16))


def test_low_latency_row_map_accepts_any_block_order_and_only_that():
    """The kernels place (expert, source) blocks in reservation order: the row map must accept any
    order of exactly the oracle's blocks, and refuse wrong sizes, gaps and overlaps."""
    def rng(*blocks):   # [(begin, count)] per source of one expert
        return torch.tensor([[(b << 32) | n for b, n in blocks]], dtype=torch.int64)

    exp = rng((0, 2), (2, 0), (2, 3))                 # oracle: source 0 rows 0-1, source 2 rows 2-4
    (rows,) = oracle.low_latency_row_map(rng((3, 2), (9, 0), (0, 3)), exp)   # source 2 first
    assert rows.tolist() == [2, 3, 4, 0, 1]
    assert oracle.low_latency_row_map(exp, exp)[0].tolist() == [0, 1, 2, 3, 4]
    for bad in (rng((0, 2), (2, 1), (3, 3)),          # a block size differs
                rng((0, 2), (2, 0), (1, 3)),          # overlap (and a row past the end left out)
                rng((0, 2), (2, 0), (3, 3))):         # past the end
        with pytest.raises(AssertionError):
            oracle.low_latency_row_map(bad, exp)


def test_low_latency_fp8_payload_is_the_cast():
    x, idx, _, _ = _world(2, 8, 2, 512, 4, tokens=[5, 3])
    g = oracle.low_latency_dispatch(1, 8, 5, x, idx, use_fp8=True, round_scale=True, use_ue8m0=True)
    data, scales = oracle.fp8_cast(x[0], True, True)
    t = int(g.src_info[0, 0])
    assert int(g.layout_range[0, 0]) & 0xFFFFFFFF > 0 or int(g.recv_count[0]) == 0
    if int(g.layout_range[0, 0]) & 0xFFFFFFFF:
        assert torch.equal(g.recv_x[0, 0].view(torch.uint8), data[t].view(torch.uint8))
        assert torch.equal(g.recv_x_scales[0, 0], scales[t])


# ---- the reference transport in a 1-rank world -------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank_ctx(one_rank_group):
    from deepep_portable.comm import Comm
    from deepep_portable.contract import BufferContext

    return BufferContext(comm=Comm(dist.group.WORLD), rank=0, num_ranks=1, device=torch.device("cpu"),
                         num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=True, uid=12345, timeout_s=30.0)


@pytest.mark.parametrize("fp8,worst,use_topk", [(False, 0, True), (True, 0, True), (False, 3, True), (True, 0, False)])
def test_reference_normal_one_rank(one_rank_ctx, fp8, worst, use_topk):
    from deepep_portable.contract import CachedDispatchArgs, CombineArgs, DispatchArgs
    from deepep_portable.transports.reference import ReferenceTransport

    tr = ReferenceTransport(one_rank_ctx)
    x, idx, w, layout = _world(1, 12, 3, 256, 99, tokens=[7])
    per_rank, per_expert, in_rank = layout[0]
    xd, xs = (oracle.fp8_cast(x[0]) if fp8 else (x[0], None))
    num_worst = (int(in_rank.sum()) + worst) if worst else 0
    res = tr.dispatch(DispatchArgs(xd, xs, idx[0] if use_topk else None, w[0] if use_topk else None, per_rank,
                                   in_rank, per_expert, 12, 4, num_worst, 20, None))
    exp = oracle.dispatch(0, 12, [xd], [in_rank], [xs] if fp8 else None, [idx[0]] if use_topk else None,
                          [w[0]] if use_topk else None, [per_expert], 4, num_worst)
    assert torch.equal(res.recv_x.view(torch.uint8), exp.recv_x.view(torch.uint8))
    if fp8:
        assert torch.equal(res.recv_x_scales, exp.recv_x_scales)
    if use_topk:
        assert torch.equal(res.recv_topk_idx, exp.recv_topk_idx)
        assert torch.equal(res.recv_topk_weights, exp.recv_topk_weights)
    else:
        assert res.recv_topk_idx is None and res.recv_topk_weights is None
    assert res.num_recv_tokens_per_expert_list == exp.num_recv_tokens_per_expert_list
    h = res.handle
    assert torch.equal(h.recv_src_idx, exp.recv_src_idx) and torch.equal(h.rank_prefix_matrix, exp.rank_prefix_matrix)
    assert torch.equal(h.send_rows, exp.send_rows) and h.num_recv_tokens == exp.num_recv_tokens
    again, again_scales = tr.cached_dispatch(CachedDispatchArgs(xd, xs, h, 20))
    assert torch.equal(again.view(torch.uint8), res.recv_x.view(torch.uint8))
    y = torch.randn(h.num_recv_rows, 256, generator=_gen(3)).to(torch.bfloat16)
    bias = torch.randn(7, 256, generator=_gen(4)).to(torch.bfloat16)
    cx, cw = tr.combine(CombineArgs(y, h, res.recv_topk_weights, bias, bias, 20))
    ex, ew = oracle.combine(0, [y], [in_rank], [res.recv_topk_weights] if use_topk else None, bias, bias)
    assert torch.equal(cx, ex)
    assert (cw is None and ew is None) or torch.equal(cw, ew)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-round", "fp8-ue8m0"])
@pytest.mark.parametrize("hook", [False, True])
def test_reference_low_latency_one_rank(one_rank_ctx, mode, hook):
    from deepep_portable.contract import LowLatencyCombineArgs, LowLatencyDispatchArgs
    from deepep_portable.transports.reference import ReferenceTransport

    tr = ReferenceTransport(one_rank_ctx)
    fp8, rs, ue = mode != "bf16", mode in ("fp8-round", "fp8-ue8m0"), mode == "fp8-ue8m0"
    E, T = 8, 9
    x, idx, w, _ = _world(1, E, 3, 512, 7, tokens=[7])
    stats = torch.zeros(E, dtype=torch.int32)
    wait = torch.zeros(1, dtype=torch.int64)
    res = tr.low_latency_dispatch(LowLatencyDispatchArgs(x[0], idx[0], T, E, stats, wait, fp8, rs, ue, hook, 20))
    assert (res.hook is not None) == hook
    if hook:
        res.hook()
    exp = oracle.low_latency_dispatch(0, E, T, x, idx, fp8, rs, ue)
    assert torch.equal(res.recv_count, exp.recv_count) and torch.equal(stats, exp.recv_count) and int(wait) > 0
    assert torch.equal(res.handle.layout_range, exp.layout_range)
    for e in range(E):
        c = int(exp.recv_count[e])
        assert torch.equal(res.recv_x[e, :c].view(torch.uint8), exp.recv_x[e, :c].view(torch.uint8))
        assert torch.equal(res.handle.src_info[e, :c], exp.src_info[e, :c])
        if fp8:
            assert torch.equal(res.recv_x_scales[e, :c], exp.recv_x_scales[e, :c])
    if fp8:
        assert res.recv_x_scales.stride(1) == 1   # column-major like DeepEP
    buf = tr.get_next_low_latency_combine_buffer(res.handle)
    buf.copy_(torch.randn(buf.shape, generator=_gen(8)).to(torch.bfloat16))
    out = torch.empty(7, 512, dtype=torch.bfloat16)
    got, h2 = tr.low_latency_combine(LowLatencyCombineArgs(buf, idx[0], w[0], res.handle, True, hook, out, wait, 20))
    if hook:
        h2()
    assert got is out
    assert torch.equal(out, oracle.low_latency_combine(0, E, T, [buf], idx, w[0]))
    tr.clean_low_latency_buffer(T, 512, E)


def test_torch_layout_ignores_entries_outside_the_experts():
    """The CPU layout (engines/dispatch_layout.py) selects nothing for entries outside [0, E), as the kernel does."""
    from deepep_portable.engines.dispatch_layout import dispatch_layout_torch

    idx = torch.tensor([[0, 5, -1], [11, 12, 40], [-7, 3, 3 + 12]], dtype=torch.int64)
    per_rank, per_expert, in_rank = dispatch_layout_torch(idx, 12, 3)
    assert per_expert.tolist() == [1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1] and per_expert.dtype == torch.int32
    assert in_rank.tolist() == [[True, True, False], [False, False, True], [True, False, False]]
    assert per_rank.tolist() == [2, 1, 1]
