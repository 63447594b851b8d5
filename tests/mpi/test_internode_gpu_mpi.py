"""The internode normal mode's kernels (transport="nvshmem", engines/internode.py) over *logical nodes* on
one machine, vs tests/oracle.py (the reference transport's internode path is the same oracle).

Run on the GPU machine, all ranks sharing one GPU under CUDA MPS:
    mpirun -n 8 python -m pytest --with-mpi -q tests/mpi/test_internode_gpu_mpi.py     (2 x 4 and 4 x 2)
    mpirun -n 16 ...                                                                   (2 x 8, 4 x 4, 8 x 2)
DEEPEP_TEST_RANKS_PER_NODE=4 restricts the node shapes to one. Without CUDA, or without a usable nvshmem
transport (on any rank), the module is skipped with the reason.

Traffic between logical nodes takes the network path: the kernels get load/store addresses of their own
node only, and the transport's peer table has none for other nodes, so every byte between nodes is an
NVSHMEM put (NVSHMEM's P2P copy between PEs of one GPU). test_peer_tables_keep_nodes_apart checks the
tables; with DEEPEP_PORTABLE_NVCC_FLAGS=-DDEEPEP_CHECK_NODE_LOCAL the kernels trap on a load/store outside
the node.

Checked bit for bit (seeded; replay with DEEPEP_TEST_SEED): dispatch (BF16, FP8 with float / int32 /
column-major scales, top-k with -1 entries or none, expert_alignment, num_worst_tokens, a rank with no
tokens, skewed routing), DeepEP's internode handle, cached dispatch, combine with 0-2 biases (per-node
bf16 partials, node ascending: the oracle's order), CUDA-graph capture of dispatch + combine with
num_worst_tokens, and the timeout path (a rank that never arrives: CommTimeoutError naming it).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/mpi (shared helpers)

import deepep_portable as deep_ep  # noqa: E402
import oracle  # noqa: E402
from test_reference_mpi import (BIG, SMALL, Checker, allgather, generator, make_topk,  # noqa: E402
                                num_experts_for, run_normal, world)

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the internode kernels need a CUDA GPU"),
]

TRANSPORT = os.environ.get("DEEPEP_TEST_INTERNODE_TRANSPORT", "nvshmem")   # ibgda: with DEEPEP_TEST_IBGDA_MODEL=1
MAX_TOKENS = 256          # the Buffers are sized for this many tokens per rank at hidden 7168
_BUFFERS: dict = {}       # ranks_per_node -> Buffer (never freed while the job runs)


def _node_shapes(num_ranks: int):
    env = os.environ.get("DEEPEP_TEST_RANKS_PER_NODE")
    if env:
        return [int(env)]
    return [p for p in (8, 4, 2) if p < num_ranks and num_ranks % p == 0] or [1]


def experts_at_least(base: int, num_ranks: int) -> int:
    """About `base` experts, at least one per rank (16 ranks have no multiple of 16 at or below 12)."""
    return max(num_experts_for(base, num_ranks), num_ranks)


def _usable(pg) -> None:
    status = deep_ep.available_transports()[TRANSPORT]
    everyone = allgather(torch.tensor([int(status.usable)]), pg)
    if not all(int(t) for t in everyone):
        pytest.skip(f"transport {TRANSPORT!r} unusable on some rank: {status.reason}")


def _buffer(pg, per_node: int, timeout_s: float = 30.0):
    key = (per_node, timeout_s)
    if key not in _BUFFERS:
        _, num_ranks = world(pg)
        rdma = deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, num_ranks, MAX_TOKENS, ranks_per_node=per_node)
        _BUFFERS[key] = deep_ep.Buffer(pg, 1 << 20, rdma, transport=TRANSPORT, ranks_per_node=per_node,
                                       timeout_s=timeout_s)
    return _BUFFERS[key]


def pytest_generate_tests(metafunc):
    if "per_node" in metafunc.fixturenames:
        n = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "2"))
        metafunc.parametrize("per_node", _node_shapes(n))


@pytest.mark.mpi(min_size=2)
def test_peer_tables_keep_nodes_apart(pg, per_node):
    """The kernels' load/store tables: the node's ranks only; the transport's reach by load/store: the node's
    ranks only (a peer table with 0 for every rank of another node, or nccl_gin's LSA team bounds), so puts to
    another node take the network path."""
    _usable(pg)
    rank, num_ranks = world(pg)
    buf = _buffer(pg, per_node)
    engine = buf.backend.engine("normal")
    ck = Checker(pg)
    node = rank // per_node
    ck.true(engine.node_bases.numel() == per_node, f"node table has {engine.node_bases.numel()} entries")
    if hasattr(engine.transport, "lsa_first"):   # nccl_gin: its peer_ptr reaches the LSA team only
        team = (engine.transport.lsa_first, engine.transport.lsa_size)
        ck.true(team == (node * per_node, per_node), f"LSA team (first, size) {team} for node {node}")
        ck.done()
        return
    tables = {t.data_ptr(): t.cpu() for t in engine.window._node_tables}
    table = tables.get(engine.transport.peer_bases)
    ck.true(table is not None, "the transport struct does not hold the node-limited peer table")
    for r, b in enumerate([] if table is None else table.tolist()):
        ck.true((b != 0) == (r // per_node == node), f"transport peer table entry {r} = {b:#x}")
    ck.done()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fp8", [None, "float", "float-column-major", "int32"])
def test_dispatch_combine(pg, device, request, base_seed, per_node, fp8):
    _usable(pg)
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    buf = _buffer(pg, per_node)
    for round_ in range(2):   # stale data of the first round must not leak into the second
        tokens = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen))
        run_normal(buf, pg, gen, device, **BIG, num_tokens=tokens, fp8=fp8,   # run_normal maps "float-column-major"
                   expert_alignment=4 if round_ else 1, num_bias=round_ + 1, ranks_per_node=per_node)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["no-topk", "rank1-empty", "skew", "num-worst", "dense", "all-none"])
def test_odd_shapes(pg, device, request, base_seed, per_node, case):
    _usable(pg)
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    buf = _buffer(pg, per_node)
    kwargs = dict(SMALL, experts=experts_at_least(SMALL["experts"], num_ranks),
                  num_tokens=0 if (case == "rank1-empty" and rank == 1) else 3 + 5 * rank, ranks_per_node=per_node)
    if case == "no-topk":
        run_normal(buf, pg, gen, device, **kwargs, use_topk=False, expert_alignment=4)
    elif case == "skew":
        run_normal(buf, pg, gen, device, **kwargs, skew=True, num_bias=2)
    elif case == "num-worst":
        run_normal(buf, pg, gen, device, **kwargs, fp8="float" if SMALL["hidden"] % 128 == 0 else None,
                   num_worst_extra=5)
    elif case == "dense":
        run_normal(buf, pg, gen, device, **kwargs, p_none=0.0)
    elif case == "all-none":   # tokens that go nowhere: ranks receive nothing
        run_normal(buf, pg, gen, device, **kwargs, p_none=1.0)
    else:
        run_normal(buf, pg, gen, device, **kwargs, num_bias=1)


ROUNDS_WINDOW_TOKENS = 48   # the rounds test's window: the size hint's for this many tokens per rank at BIG


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fp8,overlap", [(None, None), (None, "caller"), ("float", None), ("float", "comm")])
def test_call_larger_than_the_window_runs_in_rounds(pg, device, request, base_seed, per_node, fp8, overlap):
    """A window for a few dozen tokens per rank and calls of about three rounds (rank 1 with three tokens, so it
    joins rounds it has nothing for): dispatch, cached dispatch and combine bit-exact against the oracle, the
    handle's rows in the call's order; the handle says the call ran in rounds."""
    from deepep_portable.handles import InternodeRounds

    _usable(pg)
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    key = ("rounds", per_node)
    if key not in _BUFFERS:
        rdma = deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, num_ranks, ROUNDS_WINDOW_TOKENS,
                                                          ranks_per_node=per_node)
        _BUFFERS[key] = deep_ep.Buffer(pg, 1 << 20, rdma, transport=TRANSPORT, ranks_per_node=per_node, timeout_s=30.0)
    buf = _BUFFERS[key]
    engine = buf.backend.engine("normal")
    row = torch.empty(1, BIG["hidden"], dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    n = engine.tokens_per_round(row, torch.empty(1, BIG["hidden"] // 128) if fp8 else None, BIG["topk"])
    def tokens_of(r):
        return 3 if r == 1 else 2 * n + 7 * r + 1
    tokens = tokens_of(rank)
    run_normal(buf, pg, gen, device, **BIG, num_tokens=tokens, fp8=fp8, num_bias=1, expert_alignment=4,
               ranks_per_node=per_node, overlap=overlap)
    idx = make_topk(tokens, BIG["topk"], num_experts_for(BIG["experts"], num_ranks), gen).to(device)
    x = torch.zeros(tokens, BIG["hidden"], dtype=torch.bfloat16, device=device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts_for(BIG["experts"], num_ranks))
    handle = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=idx, topk_weights=torch.ones(idx.shape, device=device))[4]
    ck = Checker(pg)
    ck.true(isinstance(handle.inner.transport_state, InternodeRounds)
            and len(handle.inner.transport_state.rounds) == -(-max(map(tokens_of, range(num_ranks))) // n),
            f"the call of {tokens} tokens here (round size {n}) ran as {type(handle.inner.transport_state).__name__}")
    ck.done()


@pytest.mark.mpi(min_size=2)
def test_cuda_graph(pg, device, request, base_seed, per_node):
    """dispatch (num_worst_tokens: no host sync) + combine captured once, replayed with new contents."""
    _usable(pg)
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    buf = _buffer(pg, per_node)
    hidden, topk, experts = 2048, 4, num_experts_for(32, num_ranks)
    counts = [20 + 3 * r for r in range(num_ranks)]
    num_tokens, num_worst = counts[rank], sum(counts)
    st = dict(x=torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device=device),
              idx=torch.zeros(num_tokens, topk, dtype=torch.int64, device=device),
              w=torch.zeros(num_tokens, topk, device=device),
              per_rank=torch.zeros(num_ranks, dtype=torch.int32, device=device),
              per_expert=torch.zeros(experts, dtype=torch.int32, device=device),
              in_rank=torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=device))

    def load():
        h = dict(x=torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16),
                 idx=make_topk(num_tokens, topk, experts, gen), w=torch.rand(num_tokens, topk, generator=gen))
        per_rank, per_expert, in_rank = oracle.dispatch_layout(h["idx"], experts, num_ranks)
        for k, v in (*h.items(), ("per_rank", per_rank), ("per_expert", per_expert), ("in_rank", in_rank)):
            st[k].copy_(v.to(device))
        torch.cuda.synchronize()
        return h, in_rank, per_expert

    def body():
        recv, _, r_w, _, handle, _ = buf.dispatch(
            st["x"], num_tokens_per_rank=st["per_rank"], is_token_in_rank=st["in_rank"],
            num_tokens_per_expert=st["per_expert"], topk_idx=st["idx"], topk_weights=st["w"],
            num_worst_tokens=num_worst)
        y = recv * 2.0
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=r_w)
        return recv, r_w, y, combined, combined_w

    def check(outs, h, in_rank, per_expert, tag):
        ck = Checker(pg)
        in_rank_all = allgather(in_rank, pg)
        exp = oracle.dispatch(rank, experts, allgather(h["x"], pg), in_rank_all, None, allgather(h["idx"], pg),
                              allgather(h["w"], pg), allgather(per_expert, pg), 1, num_worst)
        recv, r_w, y, combined, combined_w = (t.cpu() for t in outs)
        n = exp.num_recv_tokens
        ck.bits(recv[:n], exp.recv_x[:n], f"[{tag}] recv_x")
        ck.bits(r_w[:n], exp.recv_topk_weights[:n], f"[{tag}] recv_topk_weights")
        ex, ew = oracle.combine(rank, allgather(y, pg), in_rank_all, allgather(r_w, pg), None, None,
                                ranks_per_node=per_node)
        ck.bits(combined, ex, f"[{tag}] combined_x")
        ck.bits(combined_w, ew, f"[{tag}] combined_topk_weights")
        ck.done()

    h = load()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check(outs, *h, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    torch.cuda.synchronize()
    for i in range(3):
        h = load()
        graph.replay()
        torch.cuda.synchronize()
        check(outs, *h, f"replay {i}")


@pytest.mark.mpi(min_size=2)
def test_op_counter_past_2_32(pg, device, request, base_seed, per_node):
    """The op counter preset just below 2^32 on every rank of a fresh Buffer: dispatch, cached dispatch and
    combine keep matching the oracle across the wrap of a 32-bit field (chunk signals stamp 40 bits)."""
    _usable(pg)
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    rdma = deep_ep.Config().get_rdma_buffer_size_hint(2048 * 2, num_ranks, 64, ranks_per_node=per_node)
    buf = deep_ep.Buffer(pg, 1 << 20, rdma, transport=TRANSPORT, ranks_per_node=per_node)
    _BUFFERS[("wrap", per_node)] = buf
    engine = buf.backend.engine("normal")
    torch.cuda.synchronize()
    engine.window.view(0, 8, device).view(torch.int64)[0] = (1 << 32) - 2   # ROUND (internode_layout.CTRL_ROUND)
    torch.cuda.synchronize()
    pg_barrier = torch.zeros(1)
    torch.distributed.all_reduce(pg_barrier, group=pg)   # every rank preset before anyone signals
    for _ in range(3):   # three ops each: ops 2^32 - 1 .. 2^32 + 7
        run_normal(buf, pg, gen, device, hidden=2048, topk=4, experts=num_experts_for(32, num_ranks),
                   num_tokens=int(torch.randint(1, 65, (1,), generator=gen)), ranks_per_node=per_node, num_bias=1)
    round_now = int(engine.window.view(0, 8, device).view(torch.int64)[0])
    assert round_now == (1 << 32) - 2 + 9, round_now


@pytest.mark.mpi(min_size=2)
def test_dispatch_whose_outputs_cannot_be_allocated_fails_that_rank_alone(pg, device, request, base_seed, per_node):
    """The dispatch allocates its outputs after its first kernels ended the op (no peer waits for a rank's pull).
    When that allocation fails on one rank (out of memory, forced here), that rank raises it at once, its peers'
    dispatch gives the same rows as the next one, and the next dispatch works on every rank."""
    _usable(pg)
    rank, num_ranks = world(pg)
    buf = _buffer(pg, per_node)
    engine = buf.backend.engine("normal")
    gen = generator(request, base_seed, rank)
    tokens, hidden, topk = 24, 1024, 4
    experts = experts_at_least(16, num_ranks)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = make_topk(tokens, topk, experts, gen).to(device)
    w = torch.rand(tokens, topk, generator=gen).to(device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    failing = num_ranks - 1
    ck = Checker(pg)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)[:3]

    def no_memory(*_args):
        raise torch.cuda.OutOfMemoryError("forced by the test: no memory for the dispatch's outputs")

    first, raised = None, ""
    if rank == failing:
        engine._dispatch_outputs = no_memory   # this instance only; removed below
    try:
        first = dispatch()
    except torch.cuda.OutOfMemoryError as e:
        raised = str(e)
    finally:
        engine.__dict__.pop("_dispatch_outputs", None)
    again = dispatch()
    torch.cuda.synchronize()
    if rank == failing:
        ck.true(first is None and "forced by the test" in raised, f"the failing rank must raise ({raised!r})")
    else:
        ck.true(first is not None and not raised, f"a peer of the failing rank must dispatch ({raised!r})")
        if first is not None:
            for got, expected, what in zip(first, again, ("recv_x", "recv_topk_idx", "recv_topk_weights")):
                ck.bits(got, expected, f"{what} beside a failed rank vs the next dispatch")
    ck.done()


@pytest.mark.mpi(min_size=2)
def test_timeout_names_the_missing_rank(pg, device, request, base_seed, per_node):
    """Rank 0 never calls: every other rank raises CommTimeoutError naming a rank (0 first) within the timeout.
    Last test of the file: that Buffer is unusable afterwards, the shared ones are untouched."""
    _usable(pg)
    rank, num_ranks = world(pg)
    buf = _buffer(pg, per_node, timeout_s=2.0)
    gen = generator(request, base_seed, rank)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16).to(device)
    experts = experts_at_least(8, num_ranks)
    idx = make_topk(4, 2, experts, gen).to(device)
    ck = Checker(pg)
    if rank != 0:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=torch.ones(4, 2, device=device))
            torch.cuda.synchronize()
            ck.true(False, "dispatch without rank 0 did not raise")
        except deep_ep.CommTimeoutError as e:
            ck.true(e.peer == 0 and e.rank == rank, f"timeout names rank {e.rank} / peer {e.peer}: {e}")
    ck.done()
