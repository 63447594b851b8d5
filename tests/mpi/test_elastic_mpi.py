"""DeepEP V2's `ElasticBuffer` on every rank of the MPI job, against tests/oracle.py.

Run:  mpirun --allow-run-as-root --oversubscribe -n 4 .venv/bin/python -m pytest --with-mpi -q \
          tests/mpi/test_elastic_mpi.py
Transport: reference on the CPU; on a GPU DEEPEP_TEST_TRANSPORT (default nvlink), every call with a small SM
budget so that the blocks of all ranks sharing the GPU are resident at once.

The oracle states V1's dispatch and combine; V2's receive layout is stated here from its definitions
(every token sent once to each rank holding one of its experts, rows by source rank then source token;
expanded: one row per (token, local expert), grouped by expert, padded to expert_alignment). Payloads are
compared bit for bit, combines bit for bit too (the oracle fixes the reduction order).
"""
from __future__ import annotations

import os
from typing import List, Optional

import pytest
import torch

import oracle
from deepep_portable.buffers.elastic import ElasticBuffer
from deepep_portable.utils import EventHandle, EventOverlap
from test_reference_mpi import Checker, allgather, generator, make_topk, num_experts_for, world

pytestmark = pytest.mark.mpi

HIDDEN, TOPK, EXPERTS, MAX_TOKENS = 256, 4, 16, 48
ON_GPU = torch.cuda.is_available()
TRANSPORT = os.environ.get("DEEPEP_TEST_TRANSPORT", "nvlink") if ON_GPU else "reference"
NUM_SMS = 4 if ON_GPU else 0


@pytest.fixture(scope="module")
def buf(pg):
    buffer = ElasticBuffer(pg, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                           transport=TRANSPORT, explicitly_destroy=True)
    yield buffer
    buffer.destroy()


class Inputs:
    """One rank's random inputs, everyone's (all-gathered), and what V1's oracle says this rank receives."""

    def __init__(self, pg, gen, device, *, num_tokens: int, fp8: bool = False, alignment: int = 1,
                 num_max: int = MAX_TOKENS) -> None:
        self.rank, self.num_ranks = world(pg)
        self.experts = num_experts_for(EXPERTS, self.num_ranks)
        self.local = self.experts // self.num_ranks
        self.num_max, self.alignment = num_max, alignment
        x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        self.scales = None
        if fp8:
            x, self.scales = oracle.fp8_cast(x)
            self.scales = self.scales.to(device)
        self.x = x.to(device)
        self.idx = make_topk(num_tokens, TOPK, self.experts, gen).to(device)
        self.weights = torch.rand(num_tokens, TOPK, generator=gen).to(device)
        self.in_rank = oracle.dispatch_layout(self.idx, self.experts, self.num_ranks)[2]
        self.x_all, self.scales_all = allgather(self.x, pg), allgather(self.scales, pg)
        self.idx_all, self.weights_all = allgather(self.idx, pg), allgather(self.weights, pg)
        self.in_rank_all = allgather(self.in_rank, pg)
        self.expected = oracle.dispatch(self.rank, self.experts, self.x_all, self.in_rank_all, self.scales_all,
                                        self.idx_all, self.weights_all, None, alignment)
        exp = self.expected
        self.num_recv = exp.num_recv_tokens
        self.counts = [int((exp.recv_topk_idx == e).any(dim=1).sum()) for e in range(self.local)]

    @property
    def x_arg(self):
        return (self.x, self.scales) if self.scales is not None else self.x

    def src_global(self) -> torch.Tensor:
        """V2's source global index of each row: source rank * num_max + token index there."""
        parts = [src * self.num_max + m[:, self.rank].nonzero().flatten() for src, m in enumerate(self.in_rank_all)]
        return torch.cat(parts).to(torch.int32)

    def expanded_slots(self) -> List[List[int]]:
        """Per plain row, per top-k position: the expanded row (-1 where not this rank's expert)."""
        idx = self.expected.recv_topk_idx.tolist()
        slots = [[-1] * TOPK for _ in idx]
        start = 0
        for e in range(self.local):
            rows = [r for r, choice in enumerate(idx) if e in choice]
            for j, r in enumerate(rows):
                slots[r][idx[r].index(e)] = start + j
            start += -(-len(rows) // self.alignment) * self.alignment
        return slots


def same_routing(pg, gen, device, like: Inputs, fp8: bool = False) -> Inputs:
    """New payload and weights on `like`'s routing (what a cached handle replays), with the oracle's answer."""
    new = Inputs(pg, gen, device, num_tokens=like.x.size(0), fp8=fp8)
    new.idx, new.in_rank, new.in_rank_all, new.idx_all = like.idx, like.in_rank, like.in_rank_all, like.idx_all
    new.expected = oracle.dispatch(new.rank, new.experts, new.x_all, new.in_rank_all, new.scales_all, new.idx_all,
                                   new.weights_all)
    new.num_recv = new.expected.num_recv_tokens
    return new


def check_handle(ck: Checker, inp: Inputs, h, num_scaleup: int, expanded: bool) -> None:
    rows = inp.num_recv
    meta = h.recv_src_metadata
    ck.bits(meta[:rows, 0].contiguous(), inp.src_global().to(meta.device), "recv_src_metadata[:, 0]")
    ck.true(bool((meta[:rows, 0][1:] > meta[:rows, 0][:-1]).all()), "rows are not in source order")
    src_rank = torch.cat([torch.full((int(m[:, inp.rank].sum()),), src) for src, m in enumerate(inp.in_rank_all)])
    first_local = (inp.expected.recv_topk_idx >= 0).to(torch.int8).argmax(dim=1).cpu()
    ck.bits(meta[:rows, 1].cpu(), (src_rank * TOPK + first_local).to(torch.int32), "recv_src_metadata[:, 1]")
    per_src = [int(m[:, inp.rank].sum()) for m in inp.in_rank_all]
    per_scaleup = [sum(per_src[s::num_scaleup]) for s in range(num_scaleup)]
    psum = torch.tensor(per_scaleup, dtype=torch.int64).cumsum(0).to(torch.int32)
    ck.bits(h.psum_num_recv_tokens_per_scaleup_rank.cpu(), psum, "psum_num_recv_tokens_per_scaleup_rank")
    counts = torch.tensor(inp.counts, dtype=torch.int32)
    padded = (counts + inp.alignment - 1) // inp.alignment * inp.alignment
    ck.bits(h.num_unaligned_recv_tokens_per_expert.cpu(), counts, "num_unaligned_recv_tokens_per_expert")
    want = (padded.cumsum(0) - padded + counts) if expanded else padded.cumsum(0)
    ck.bits(h.psum_num_recv_tokens_per_expert.cpu(), want.to(torch.int32), "psum_num_recv_tokens_per_expert")
    dst = inp.idx.div(inp.local, rounding_mode="floor").clamp(min=0)
    want_slot = torch.where(inp.idx >= 0, inp.expected.send_rows.gather(1, dst), torch.full_like(dst, -1))
    ck.bits(h.dst_buffer_slot_idx, want_slot.to(torch.int32), "dst_buffer_slot_idx")
    if expanded:
        ck.bits(meta[:rows, 2:].cpu(), torch.tensor(inp.expanded_slots(), dtype=torch.int32).view(rows, TOPK),
                "recv_src_metadata[:, 2:] (expanded rows)")


def expected_combine(inp: Inputs, pg, y: torch.Tensor, recv_w: Optional[torch.Tensor], bias, ranks_per_node=0):
    y_all, w_all = allgather(y, pg), allgather(recv_w, pg)
    b0, b1 = (bias if isinstance(bias, tuple) else (bias, None))
    return oracle.combine(inp.rank, y_all, inp.in_rank_all, w_all, b0, b1, ranks_per_node)


def combine_weights_expected(inp: Inputs) -> torch.Tensor:
    """V2: position k of the combined weights comes back from the rank holding expert k (0 where none)."""
    return torch.where(inp.idx >= 0, inp.weights, torch.zeros_like(inp.weights))


def overlap_args(buf, overlap) -> dict:
    if overlap is None:
        return {}
    return dict(previous_event=buf.capture(), async_with_compute_stream=overlap == "async",
                allocate_on_comm_stream=overlap == "comm")


def waited(values, overlap):
    if overlap == "async":
        assert isinstance(values[-1], EventOverlap)
        values[-1].current_stream_wait()
    return values


# ---- plain layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("num_bias", [0, 1, 2])
@pytest.mark.parametrize("overlap", [None, "async", "comm"])
def test_dispatch_combine(buf, pg, device, request, base_seed, fp8, alignment, num_bias, overlap):
    gen = generator(request, base_seed, world(pg)[0])
    inp = Inputs(pg, gen, device, num_tokens=int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen)), fp8=fp8,
                 alignment=alignment)
    ck, exp = Checker(pg), inp.expected
    recv_x, recv_idx, recv_w, h, _ = waited(buf.dispatch(
        inp.x_arg, inp.idx, inp.weights, num_experts=inp.experts, expert_alignment=alignment, num_sms=NUM_SMS,
        use_tma_aligned_col_major_sf=fp8, **overlap_args(buf, overlap)), overlap)
    if fp8:
        recv_x, recv_sf = recv_x
        ck.bits(recv_sf.contiguous(), exp.recv_x_scales, "recv_sf")
        ck.true(inp.num_recv == 0 or recv_sf.stride() == (1, -(-inp.num_recv // 4) * 4),
                f"recv_sf strides {recv_sf.stride()}")
    ck.bits(recv_x, exp.recv_x, "recv_x")
    ck.bits(recv_idx, exp.recv_topk_idx, "recv_topk_idx")
    ck.bits(recv_w, exp.recv_topk_weights, "recv_topk_weights")
    ck.true(h.num_recv_tokens_per_expert_list == exp.num_recv_tokens_per_expert_list,
            f"num_recv_tokens_per_expert_list {h.num_recv_tokens_per_expert_list}")
    ck.true(h.num_recv_tokens == inp.num_recv and h.num_expanded_tokens == sum(exp.num_recv_tokens_per_expert_list),
            f"num_recv_tokens {h.num_recv_tokens} / num_expanded_tokens {h.num_expanded_tokens}")
    ck.true(h.topk_idx is not inp.idx and torch.equal(h.topk_idx, inp.idx), "handle.topk_idx is not a copy")
    check_handle(ck, inp, h, buf.num_scaleup_ranks, expanded=False)

    y = torch.randn(recv_x.shape, generator=gen).to(torch.bfloat16).to(device)
    bias = tuple(torch.randn(inp.x.shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(num_bias))
    bias = None if num_bias == 0 else bias[0] if num_bias == 1 else bias
    combined, combined_w, _ = waited(buf.combine(y, h, recv_w, bias=bias, **overlap_args(buf, overlap)), overlap)
    want_x, _ = expected_combine(inp, pg, y, recv_w, bias)
    ck.bits(combined, want_x, "combined_x")
    ck.bits(combined_w, combine_weights_expected(inp), "combined_topk_weights")
    ck.done()


def test_combine_takes_each_weight_from_its_experts_rank(buf, pg, device, request, base_seed):
    """V2 callers may pass every top-k weight on every row: only the rank holding expert k counts for k."""
    gen = generator(request, base_seed, world(pg)[0])
    inp = Inputs(pg, gen, device, num_tokens=MAX_TOKENS)
    ck = Checker(pg)
    recv_x, _, recv_w, h, _ = buf.dispatch(inp.x, inp.idx, inp.weights, num_experts=inp.experts, num_sms=NUM_SMS)
    unmasked = recv_w + torch.where(recv_w == 0, torch.full_like(recv_w, 7.0), torch.zeros_like(recv_w))
    _, combined_w, _ = buf.combine(recv_x, h, unmasked)
    ck.bits(combined_w, combine_weights_expected(inp), "combined_topk_weights from unmasked weights")
    ck.done()


# ---- cached handle -----------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("do_handle_copy", [True, False])
def test_cached_dispatch(buf, pg, device, request, base_seed, fp8, do_handle_copy):
    gen = generator(request, base_seed, world(pg)[0])
    inp = Inputs(pg, gen, device, num_tokens=MAX_TOKENS - 5, fp8=fp8)
    ck = Checker(pg)
    _, recv_idx, _, h, _ = buf.dispatch(inp.x_arg, inp.idx, inp.weights, num_experts=inp.experts,
                                        do_handle_copy=do_handle_copy, num_sms=NUM_SMS)
    ck.true((h.topk_idx is inp.idx) != do_handle_copy, "do_handle_copy not honoured")
    # Same routing, new payload and new weights.
    again = same_routing(pg, gen, device, inp, fp8=fp8)
    exp = again.expected
    recv_x, cached_idx, cached_w, cached_h, _ = buf.dispatch(again.x_arg, handle=h, topk_weights=again.weights)
    ck.true(cached_h is h, "a cached dispatch returns its handle")
    if fp8:
        recv_x, recv_sf = recv_x
        ck.bits(recv_sf, exp.recv_x_scales, "cached recv_sf")
    ck.bits(recv_x, exp.recv_x, "cached recv_x")
    ck.bits(cached_idx, recv_idx, "cached recv_topk_idx")
    ck.bits(cached_w, exp.recv_topk_weights, "cached recv_topk_weights")
    ck.true(buf.dispatch(again.x_arg, handle=h)[2] is None, "cached dispatch without topk_weights returned some")
    ck.done()


# ---- expanded layout ---------------------------------------------------------------------------
@pytest.fixture
def poisoned_empty():
    """torch.empty fills new tensors (NaN, or the largest integer): rows an op leaves unwritten show."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was, warn_only=was_warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("alignment", [1, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_expanded_dispatch_combine(buf, pg, device, request, base_seed, alignment, fp8, poisoned_empty):
    gen = generator(request, base_seed, world(pg)[0])
    inp = Inputs(pg, gen, device, num_tokens=MAX_TOKENS, fp8=fp8, alignment=alignment)
    ck, exp = Checker(pg), inp.expected
    recv_x, recv_idx, recv_w, h, _ = buf.dispatch(inp.x_arg, inp.idx, inp.weights, num_experts=inp.experts,
                                                  expert_alignment=alignment, do_expand=True, do_zero_padding=True,
                                                  num_sms=NUM_SMS)
    if fp8:
        recv_x, recv_sf = recv_x
    ck.true(recv_idx is None, "expanded dispatch returned recv_topk_idx")
    rows = sum(-(-c // alignment) * alignment for c in inp.counts)
    ck.true(recv_x.size(0) == rows == h.num_expanded_tokens, f"{recv_x.size(0)} expanded rows, want {rows}")
    check_handle(ck, inp, h, buf.num_scaleup_ranks, expanded=True)
    slots = torch.tensor(inp.expanded_slots(), dtype=torch.int64, device=device).view(-1, TOPK)
    chosen = slots >= 0
    plain_row = torch.arange(slots.size(0), device=device).unsqueeze(1).expand_as(slots)[chosen]
    target = slots[chosen]
    want_x = torch.zeros_like(recv_x.view(torch.uint8))
    want_x[target] = exp.recv_x.view(torch.uint8)[plain_row]
    ck.bits(recv_x, want_x.view(recv_x.dtype), "expanded recv_x (padding zeroed)")
    if fp8:
        want_sf = torch.zeros_like(recv_sf)
        want_sf[target] = exp.recv_x_scales[plain_row]
        ck.bits(recv_sf, want_sf, "expanded recv_sf")
    want_w = torch.zeros(rows, dtype=torch.float32, device=device)
    want_w[target] = exp.recv_topk_weights[chosen]
    ck.bits(recv_w, want_w, "expanded recv_topk_weights")

    y = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    combined, combined_w, _ = buf.combine(y, h, recv_w)
    acc = torch.zeros(slots.size(0), HIDDEN, dtype=torch.float32, device=device)
    for k in range(TOPK):   # each token's expert rows, top-k order, then one rounding: what goes back
        acc[chosen[:, k]] += y[slots[:, k][chosen[:, k]]].float()
    want_combined, _ = expected_combine(inp, pg, acc.to(torch.bfloat16), None, None)
    ck.bits(combined, want_combined, "expanded combined_x")
    ck.bits(combined_w, combine_weights_expected(inp), "expanded combined_topk_weights")
    ck.done()


# ---- num_max_tokens_per_rank: no CPU sync, worst-case shapes -----------------------------------------
@pytest.mark.parametrize("expand", [False, True])
def test_no_cpu_sync_worst_case_rows(buf, pg, device, request, base_seed, expand):
    gen = generator(request, base_seed, world(pg)[0])
    num_max = MAX_TOKENS - 8   # below the Buffer's bound: global indices use this one
    inp = Inputs(pg, gen, device, num_tokens=num_max - 3, num_max=num_max, alignment=4)
    ck, exp = Checker(pg), inp.expected
    stats = torch.zeros(inp.local, dtype=torch.int32, device=device)
    recv_x, recv_idx, recv_w, h, _ = buf.dispatch(inp.x, inp.idx, inp.weights, stats, num_experts=inp.experts,
                                                  num_max_tokens_per_rank=num_max, expert_alignment=4,
                                                  do_cpu_sync=False, do_expand=expand, num_sms=NUM_SMS)
    worst = inp.num_ranks * num_max
    if expand:
        worst = -(-(worst * min(TOPK, inp.local) + 3 * inp.local) // 4) * 4
    ck.true(recv_x.size(0) == worst, f"{recv_x.size(0)} rows without CPU sync, want the worst case {worst}")
    ck.true(h.num_recv_tokens_per_expert_list == [], "no CPU sync, yet a per-expert list")
    ck.true(int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) == inp.num_recv, "real rows != psum[-1]")
    ck.bits(stats, torch.tensor(inp.counts, dtype=torch.int32, device=device), "cumulative_local_expert_recv_stats")
    check_handle(ck, inp, h, buf.num_scaleup_ranks, expanded=expand)
    if not expand:
        real = inp.num_recv
        ck.bits(recv_x[:real], exp.recv_x, "recv_x (real rows)")
        ck.bits(recv_idx[:real], exp.recv_topk_idx, "recv_topk_idx (real rows)")
        y = torch.randn(recv_x.shape, generator=gen).to(torch.bfloat16).to(device)
        combined, _, _ = buf.combine(y, h)
        ck.bits(combined, expected_combine(inp, pg, y[:real], None, None)[0], "combined_x")
    too_many = torch.zeros(num_max + 1, HIDDEN, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        buf.dispatch(too_many, inp.idx.new_full((num_max + 1, TOPK), -1), num_experts=inp.experts,
                     num_max_tokens_per_rank=num_max)
    ck.done()


# ---- bad calls leave the buffer usable -----------------------------------------------------------
def test_buffer_usable_after_rejected_calls(buf, pg, device, request, base_seed):
    gen = generator(request, base_seed, world(pg)[0])
    inp = Inputs(pg, gen, device, num_tokens=MAX_TOKENS)
    with pytest.raises(TypeError, match="topk_idx"):
        buf.dispatch(inp.x, inp.idx.to(torch.int32), num_experts=inp.experts)
    with pytest.raises(ValueError, match="expert index"):
        buf.dispatch(inp.x, inp.idx.clamp(min=0) + inp.experts, num_experts=inp.experts)
    _, _, _, h, _ = buf.dispatch(inp.x, inp.idx, inp.weights, num_experts=inp.experts, num_sms=NUM_SMS)
    with pytest.raises(ValueError, match="^x "):
        buf.combine(torch.zeros(h.num_recv_tokens + 1, HIDDEN, dtype=torch.bfloat16, device=device), h)
    with pytest.raises(ValueError, match="expert_alignment"):
        buf.dispatch(inp.x, handle=h, expert_alignment=8)
    ck = Checker(pg)
    recv_x, recv_idx, recv_w, h, _ = buf.dispatch(inp.x, inp.idx, inp.weights, num_experts=inp.experts,
                                                  num_sms=NUM_SMS)
    ck.bits(recv_x, inp.expected.recv_x, "recv_x after rejected calls")
    combined, combined_w, _ = buf.combine(recv_x, h, recv_w)
    ck.bits(combined, expected_combine(inp, pg, recv_x, recv_w, None)[0], "combined_x after rejected calls")
    ck.done()


# ---- logical nodes (hierarchical route) -------------------------------------------------------------
@pytest.mark.parametrize("per_node", [2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_logical_nodes(pg, device, request, base_seed, fp8, per_node):
    """Nodes of `per_node` ranks (8 ranks: 4 x 2 and 2 x 4): the reference transport on the CPU; on a GPU the job's
    transport when it spans nodes (the internode kernels: NVLink inside a node, the backend's network path between
    nodes)."""
    from deepep_portable.transports import registry

    rank, num_ranks = world(pg)
    if num_ranks < 2 * per_node or num_ranks % per_node:
        pytest.skip(f"needs at least two nodes of {per_node} ranks")
    if not registry.row(TRANSPORT).spans_nodes:
        pytest.skip(f"{TRANSPORT} does not span nodes: run this job with a network transport")
    buffer = ElasticBuffer(pg, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK, transport=TRANSPORT,
                           ranks_per_node=per_node, explicitly_destroy=True)
    try:
        nodes = num_ranks // per_node
        assert buffer.get_logical_domain_size() == (nodes, per_node) == buffer.get_physical_domain_size()
        assert (buffer.scaleout_rank_idx, buffer.scaleup_rank_idx) == (rank // per_node, rank % per_node)
        gen = generator(request, base_seed, rank)
        inp = Inputs(pg, gen, device, num_tokens=MAX_TOKENS - 1, fp8=fp8)
        ck = Checker(pg)
        recv_x, _, recv_w, h, _ = buffer.dispatch(inp.x_arg, inp.idx, inp.weights, num_experts=inp.experts,
                                                  num_sms=NUM_SMS)
        if fp8:
            recv_x, recv_sf = recv_x
            ck.bits(recv_sf, inp.expected.recv_x_scales, "recv_sf over logical nodes")
        ck.bits(recv_x, inp.expected.recv_x, "recv_x over logical nodes")
        check_handle(ck, inp, h, per_node, expanded=False)
        y = torch.randn(recv_x.shape, generator=gen).to(torch.bfloat16).to(device)
        combined, combined_w, _ = buffer.combine(y, h, recv_w, num_sms=NUM_SMS)
        want, _ = expected_combine(inp, pg, y, recv_w, None, ranks_per_node=per_node)
        ck.bits(combined, want, "combined_x over logical nodes")
        ck.bits(combined_w, combine_weights_expected(inp), "combined_topk_weights over logical nodes")
        ck.done()
    finally:
        buffer.destroy()


# ---- GPU stream ordering ------------------------------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="stream ordering needs CUDA")
def test_async_events_order_the_callers_stream(buf, pg, device, request, base_seed):
    gen = generator(request, base_seed, world(pg)[0])
    inp = Inputs(pg, gen, device, num_tokens=MAX_TOKENS)
    ck = Checker(pg)
    x = torch.empty_like(inp.x)
    torch.cuda._sleep(50_000_000)      # the caller's stream is busy: a dispatch that does not wait reads poison
    x.copy_(inp.x)
    values = buf.dispatch(x, inp.idx, inp.weights, num_experts=inp.experts, num_sms=NUM_SMS,
                          previous_event=EventHandle(), async_with_compute_stream=True)
    ck.true(isinstance(values[-1].event, EventHandle) and values[-1].event.event is not None, "no event returned")
    with values[-1](release_handle=True):
        pass
    ck.true(values[-1].event is None, "release_handle kept the event")
    ck.bits(values[0], inp.expected.recv_x, "recv_x after the event")
    ck.done()


# ---- CUDA graphs: the decode pattern --------------------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("cached", [False, True])
def test_decode_cuda_graph(buf, pg, device, request, base_seed, cached):
    """Decode as serving engines run it: a fixed num_max_tokens_per_rank, no CPU sync, dispatch + expert (x2,
    exact in bf16) + combine captured once and replayed with new contents: new routing each step, or a cached
    handle's routing with new payload and weights. Every replay bit-exact against the oracle and against the
    same calls made eagerly on the same inputs."""
    from test_intranode_gpu_mpi import GpuChecker, capture_graph

    gen = generator(request, base_seed, world(pg)[0])
    ck = GpuChecker(pg)
    first = Inputs(pg, gen, device, num_tokens=MAX_TOKENS - 6)
    static = dict(x=first.x.clone(), idx=first.idx.clone(), w=first.weights.clone())
    fresh = dict(num_experts=first.experts, num_max_tokens_per_rank=MAX_TOKENS, do_cpu_sync=False, num_sms=NUM_SMS)
    _, _, _, handle, _ = buf.dispatch(static["x"], static["idx"], static["w"], **fresh)

    def body() -> dict:
        if cached:
            recv_x, _, recv_w, h, _ = buf.dispatch(static["x"], handle=handle, topk_weights=static["w"],
                                                   num_sms=NUM_SMS)
        else:
            recv_x, _, recv_w, h, _ = buf.dispatch(static["x"], static["idx"], static["w"], **fresh)
        combined, combined_w, _ = buf.combine(recv_x * 2, h, recv_w)
        return dict(recv_x=recv_x, recv_w=recv_w, combined=combined, combined_w=combined_w,
                    real=h.psum_num_recv_tokens_per_scaleup_rank[-1:])

    ck.run("[graph warm-up] eager", lambda: (body(), torch.cuda.synchronize()))
    graph, outs = capture_graph(ck, body, "[graph] capture")
    for step in range(3):
        inp = same_routing(pg, gen, device, first) if cached else Inputs(pg, gen, device, num_tokens=MAX_TOKENS - 6)
        if outs is None:
            break
        static["x"].copy_(inp.x)
        static["idx"].copy_(inp.idx)
        static["w"].copy_(inp.weights)
        ck.run(f"[graph replay {step}]", lambda: (graph.replay(), torch.cuda.synchronize()))
        real, tag = inp.num_recv, f"replay {step}"
        ck.true(int(outs["real"]) == real, f"{tag}: {int(outs['real'])} real rows, want {real}")
        ck.bits(outs["recv_x"][:real], inp.expected.recv_x, f"{tag}: recv_x")
        ck.bits(outs["recv_w"][:real], inp.expected.recv_topk_weights, f"{tag}: recv_topk_weights")
        want_x, _ = expected_combine(inp, pg, (outs["recv_x"][:real] * 2), outs["recv_w"][:real], None)
        ck.bits(outs["combined"], want_x, f"{tag}: combined_x")
        ck.bits(outs["combined_w"], combine_weights_expected(inp), f"{tag}: combined_topk_weights")
        eager = ck.run(f"[eager {step}]", body)
        if eager is not None:
            for name in ("recv_x", "combined", "combined_w"):
                rows = real if name == "recv_x" else None
                ck.bits(outs[name][:rows], eager[name][:rows], f"{tag}: {name} replayed vs eager")
    ck.done()
