"""The reference transport through `deep_ep.Buffer`, on every rank of the MPI job, against tests/oracle.py.

Run:  mpirun --allow-run-as-root --oversubscribe -n 4 .venv/bin/python -m pytest --with-mpi -q tests/mpi
(any -n from 1 up; tests that need a peer are marked min_size=2).

Every check is exact: payloads (BF16, FP8 data and scales, top-k, indices) bit for bit, and the
combines bit for bit too, because the oracle specifies the reduction order (see tests/oracle.py) and
the reference follows it. Inputs are fresh random each run (seeded per run, rank and test; the seed
is printed, replay with DEEPEP_TEST_SEED).
"""
from __future__ import annotations

import zlib
from typing import List, Optional

import pytest
import torch
import torch.distributed as dist

import deepep_portable as deep_ep
import oracle

pytestmark = pytest.mark.mpi

BIG = dict(hidden=7168, topk=8, experts=256)          # DeepSeek-V3 shape; token counts kept small for CI
SMALL = dict(hidden=256, topk=3, experts=12)
LL_MAX_TOKENS = 64


# ---- helpers -------------------------------------------------------------------------------------
def world(pg):
    return dist.get_rank(pg), dist.get_world_size(pg)


def num_experts_for(base: int, num_ranks: int) -> int:
    """The largest expert count <= base divisible by the rank count (e.g. 255 on 3 ranks)."""
    return base // num_ranks * num_ranks


def generator(request, base_seed: int, rank: int) -> torch.Generator:
    salt = zlib.crc32(request.node.nodeid.encode())
    return torch.Generator().manual_seed((base_seed + 1_000_003 * rank + salt) % (1 << 62))


def make_topk(n: int, k: int, e: int, gen: torch.Generator, p_none: float = 0.1,
              all_none_token: bool = True) -> torch.Tensor:
    """k distinct experts per token, some slots -1, and (if any token) one token with all -1."""
    idx = torch.rand(n, e, generator=gen).argsort(dim=1)[:, :k].to(torch.int64).contiguous()
    idx[torch.rand(n, k, generator=gen) < p_none] = -1
    if all_none_token and n > 0:
        idx[int(torch.randint(0, n, (1,), generator=gen))] = -1
    return idx


def allgather(t: Optional[torch.Tensor], pg) -> Optional[List[torch.Tensor]]:
    """All-gather tensors of any dtype and first dimension (returned on t's device)."""
    if t is None:
        return None
    _, num_ranks = world(pg)
    device, dtype = t.device, t.dtype
    host = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)   # dense strides, even on size-1 dims
    if dtype == torch.bool:
        host = host.to(torch.uint8)
    flat = host.view(torch.uint8).reshape(-1)
    shapes: list = [None] * num_ranks
    dist.all_gather_object(shapes, (tuple(host.shape), flat.numel()), group=pg)
    width = max(1, max(n for _, n in shapes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:flat.numel()] = flat
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(num_ranks)]
    dist.all_gather(outs, padded, group=pg)
    result = []
    for out, (shape, n) in zip(outs, shapes):
        part = out[:n].view(host.dtype).reshape(shape)
        result.append((part.to(torch.bool) if dtype == torch.bool else part).to(device))
    return result


class Checker:
    """Collects mismatches instead of raising at once, so a rank that sees a wrong result still takes
    part in every later collective of the test (no rank is left waiting); `done` raises on every rank
    with every rank's findings."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.errors: List[str] = []

    def true(self, cond, what: str) -> None:
        if not cond:
            self.errors.append(what)

    def bits(self, got: Optional[torch.Tensor], expected: Optional[torch.Tensor], what: str) -> None:
        """Bit-for-bit equality (dtype, shape and bytes)."""
        if got is None or expected is None:
            return self.true(got is None and expected is None, f"{what}: {got is None=} but {expected is None=}")
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return self.errors.append(f"{what}: {got.dtype}{list(got.shape)} != expected "
                                      f"{expected.dtype}{list(expected.shape)}")
        if got.numel() == 0:
            return

        def raw(t: torch.Tensor) -> torch.Tensor:   # dense (contiguous() keeps odd strides on size-1 dims)
            return t.clone(memory_format=torch.contiguous_format).view(torch.uint8)

        g = raw(got).reshape(got.shape[0] if got.dim() else 1, -1)
        e = raw(expected).reshape(g.shape)
        if not torch.equal(g, e):
            rows = (g != e).any(dim=1).nonzero().flatten()
            r = int(rows[0])
            col = int((g[r] != e[r]).nonzero()[0]) // expected.element_size() * expected.element_size()
            size = expected.element_size()
            self.errors.append(f"{what}: {rows.numel()} of {g.shape[0]} rows differ from the oracle "
                               f"(first: {rows[:8].tolist()}; row {r} byte {col}: got "
                               f"{bytes(g[r, col:col + size].tolist()).hex()}, expected "
                               f"{bytes(e[r, col:col + size].tolist()).hex()})")

    def done(self) -> None:
        rank, num_ranks = world(self.pg)
        found: list = [None] * num_ranks
        dist.all_gather_object(found, self.errors, group=self.pg)
        report = [f"rank {r}: {e}" for r, errs in enumerate(found) for e in errs]
        assert not report, "\n".join(report[:40])


def nvl_bytes(num_ranks: int, hidden: int, tokens: int) -> int:
    return deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, tokens)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def buffer(pg):
    _, num_ranks = world(pg)
    return deep_ep.Buffer(pg, nvl_bytes(num_ranks, BIG["hidden"], 256), 0, transport="reference")


@pytest.fixture(scope="module")
def mpi_buffer(mpi_comm, pg):
    num_ranks = mpi_comm.Get_size()
    return deep_ep.Buffer(None, nvl_bytes(num_ranks, BIG["hidden"], 256), 0, comm=mpi_comm, transport="reference")


def _ll_buffer(group=None, comm=None):
    num_ranks = group.size() if group is not None else comm.Get_size()
    experts = num_experts_for(BIG["experts"], num_ranks)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX_TOKENS, BIG["hidden"], num_ranks, experts)
    return deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=experts // num_ranks,
                          comm=comm, transport="reference")


@pytest.fixture(scope="module")
def ll_buffer(pg):
    return _ll_buffer(group=pg)


@pytest.fixture(scope="module")
def ll_mpi_buffer(mpi_comm, pg):
    return _ll_buffer(comm=mpi_comm)


# ---- normal mode ---------------------------------------------------------------------------------
def _overlap(buf, overlap) -> dict:
    """DeepEP's overlap arguments for one op (a fresh previous_event each time), or none."""
    if overlap is None:
        return {}
    return dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=overlap == "comm")


def _finish(event, overlap) -> None:
    """An async op's results may be read once the caller's stream waited on its event."""
    if overlap is not None:
        assert isinstance(event, deep_ep.EventOverlap), f"async_finish=True returned {type(event)}, not an EventOverlap"
        event.current_stream_wait()


def run_normal(buf, pg, gen, device, *, hidden, topk, experts, num_tokens, fp8=None, use_topk=True,
               expert_alignment=1, num_worst_extra=None, num_bias=0, p_none=0.1, column_major_scales=False,
               ranks_per_node=0, skew=False, overlap=None, zero_copy=False, zero_copy_dispatch=False):
    """dispatch, cached dispatch and combine of random inputs; everything compared to the oracle.

    fp8: None (bf16), "float" or "int32" scales, or "float-column-major" (float scales with DeepGEMM's
    column-major strides, as column_major_scales=True). num_worst_extra: None, or pad num_worst_tokens to the
    largest receive count of any rank plus this many rows. overlap: None (plain calls), "caller" or "comm":
    every op gets a previous_event and async_finish=True (allocating on the caller's or the comm stream), and
    its results are read only after the caller's stream waits on the event it returns. zero_copy: the expert
    outputs are written into Buffer.get_next_combine_buffer's tensor, which goes to combine as x.
    zero_copy_dispatch: the tokens are written into Buffer.get_next_dispatch_buffer's tensor before the dispatch
    and again before the cached dispatch, which take it as x."""
    if fp8 not in (None, "float", "int32", "float-column-major"):   # never a silent BF16 case
        raise ValueError(f"run_normal: unknown fp8 {fp8!r}")
    if fp8 == "float-column-major":
        fp8, column_major_scales = "float", True
    rank, num_ranks = world(pg)
    experts = num_experts_for(experts, num_ranks)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    scales = None
    if fp8 == "float":
        x, scales = oracle.fp8_cast(x)
    elif fp8 == "int32":
        x = oracle.fp8_cast(x)[0]
        scales = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_tokens, hidden // 128), generator=gen, dtype=torch.int32)
    idx = make_topk(num_tokens, topk, experts, gen, p_none)
    if skew:   # every token's first choice is expert 0 (one expert gets everything; rows stay distinct)
        idx[idx == 0] = -1
        idx[:, 0] = 0
    weights = torch.rand(num_tokens, topk, generator=gen)
    x, idx, weights = x.to(device), idx.to(device), weights.to(device)
    scales = scales.to(device) if scales is not None else None
    if scales is not None and column_major_scales:   # DeepGEMM's layout: any strides are accepted
        scales = scales.T.contiguous().T

    ck = Checker(pg)
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, experts, **_overlap(buf, overlap))
    _finish(event, overlap)
    exp_rank, exp_expert, exp_in_rank = oracle.dispatch_layout(idx, experts, num_ranks)
    if not 0 < ranks_per_node < num_ranks:
        ranks_per_node = 0   # one node
    if ranks_per_node:   # several (logical) nodes: tokens per node, DeepEP's num_tokens_per_rdma_rank
        nodes = num_ranks // ranks_per_node
        exp_rdma = exp_in_rank.view(num_tokens, nodes, ranks_per_node).any(2).sum(0, dtype=torch.int32)
        ck.bits(per_rdma, exp_rdma, "num_tokens_per_rdma_rank")
    else:
        ck.true(per_rdma is None, "num_tokens_per_rdma_rank is not None")
    ck.bits(per_rank, exp_rank, "num_tokens_per_rank")
    ck.bits(per_expert, exp_expert, "num_tokens_per_expert")
    ck.bits(in_rank, exp_in_rank, "is_token_in_rank")

    x_all, scales_all, in_rank_all = allgather(x, pg), allgather(scales, pg), allgather(in_rank, pg)
    idx_all, weights_all, per_expert_all = allgather(idx, pg), allgather(weights, pg), allgather(per_expert, pg)
    num_worst = 0
    if num_worst_extra is not None:
        most = max(int(sum(m[:, j].sum() for m in in_rank_all)) for j in range(num_ranks))
        num_worst = most + num_worst_extra
    expected = oracle.dispatch(rank, experts, x_all, in_rank_all, scales_all,
                               idx_all if use_topk else None, weights_all if use_topk else None,
                               per_expert_all, expert_alignment, num_worst)

    def tokens():   # x, or the same tokens written into the Buffer (collective: every rank calls it)
        if not zero_copy_dispatch:
            return (x, scales) if scales is not None else x
        rows = buf.get_next_dispatch_buffer(num_tokens, hidden, x.dtype)
        ck.true(rows.shape == x.shape and rows.dtype == x.dtype and rows.is_contiguous(),
                f"get_next_dispatch_buffer gave {rows.dtype}{list(rows.shape)}, want {x.dtype}{list(x.shape)}")
        rows.copy_(x)
        return (rows, scales) if scales is not None else rows

    recv_x, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
        tokens(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx if use_topk else None,
        topk_weights=weights if use_topk else None, expert_alignment=expert_alignment,
        num_worst_tokens=num_worst, **_overlap(buf, overlap))
    _finish(event, overlap)
    recv_scales = None
    if scales is not None:
        ck.true(isinstance(recv_x, tuple), "FP8 dispatch must return (recv_x, recv_x_scales)")
        recv_x, recv_scales = recv_x
    ck.bits(recv_x, expected.recv_x, "recv_x")
    ck.bits(recv_scales, expected.recv_x_scales, "recv_x_scales")
    ck.bits(recv_idx, expected.recv_topk_idx, "recv_topk_idx")
    ck.bits(recv_w, expected.recv_topk_weights, "recv_topk_weights")
    ck.true(per_expert_list == expected.num_recv_tokens_per_expert_list,
            f"num_recv_tokens_per_expert_list {per_expert_list} != {expected.num_recv_tokens_per_expert_list}")
    n = expected.num_recv_tokens
    if ranks_per_node:   # DeepEP's internode handle: ten entries; [-4] the per-source prefix sum, [0] the routing
        ck.true(isinstance(handle, deep_ep.InternodeHandle) and len(handle) == 10, f"handle {type(handle)}")
        ck.bits(handle[-4], expected.rank_prefix_matrix[:, rank], "handle[-4] (recv_gbl_rank_prefix_sum)")
        ck.bits(handle[0], in_rank, "handle[0] (is_token_in_rank)")
        prefix = expected.rank_prefix_matrix[:, rank].cpu().to(torch.int32).contiguous()
        src = torch.searchsorted(prefix, torch.arange(n, dtype=torch.int32), right=True).to(torch.int32)
        ck.bits(handle[7][:n, 0].cpu(), src, "handle[7] source ranks")
        ck.bits(handle[7][:n, 1], expected.recv_src_idx[:n], "handle[7] source tokens")
        outer, handle = handle, handle.inner
    ck.true(handle.num_recv_tokens in ((n, -1) if num_worst else (n,)),   # -1: only the GPU knows (handles.py)
            f"handle.num_recv_tokens {handle.num_recv_tokens} != {n}")
    ck.true(handle.num_recv_rows == (num_worst or n) == recv_x.shape[0],
            f"handle.num_recv_rows {handle.num_recv_rows}, recv_x rows {recv_x.shape[0]}, expected {num_worst or n}")
    ck.bits(handle.rank_prefix_matrix, expected.rank_prefix_matrix, "rank_prefix_matrix")
    ck.bits(handle.recv_src_idx[:n], expected.recv_src_idx[:n], "recv_src_idx")
    ck.bits(handle.send_rows, expected.send_rows, "send_rows")
    ck.true(handle.num_tokens == num_tokens and handle.hidden == hidden, "handle.num_tokens / hidden")

    if ranks_per_node:
        handle = outer   # the caller's handle goes back in as it came out
    # cached dispatch: same movement, payload only
    again, *rest = buf.dispatch(tokens(), handle=handle, **_overlap(buf, overlap))
    _finish(rest[-1], overlap)
    ck.true(all(r is None for r in rest[:4]), "cached dispatch must return None for topk/weights/list/handle")
    again_scales = None
    if scales is not None:
        again, again_scales = again
    ck.bits(again, expected.recv_x, "cached recv_x")
    ck.bits(again_scales, expected.recv_x_scales, "cached recv_x_scales")

    # combine random expert outputs (padding rows hold garbage that must be ignored). Rows and biases
    # span a wide range of magnitudes, so float32 sums depend on their order: this checks the order.
    def wide(rows, cols):
        magnitude = torch.exp2(torch.randint(-24, 24, (rows, 1), generator=gen).float())
        return (torch.randn(rows, cols, generator=gen) * magnitude).to(torch.bfloat16).to(device)

    rows_here = recv_x.shape[0]
    y = wide(rows_here, hidden)
    y_w = wide(rows_here, topk).float() if use_topk else None
    biases = [wide(num_tokens, hidden) for _ in range(num_bias)]
    bias = None if num_bias == 0 else (biases[0] if num_bias == 1 else tuple(biases))
    if zero_copy:   # every rank (collective), after the last op before the combine
        y_in = buf.get_next_combine_buffer(handle)
        ck.true(y_in.shape == y.shape and y_in.dtype == torch.bfloat16 and y_in.is_contiguous(),
                f"get_next_combine_buffer gave {y_in.dtype}{list(y_in.shape)}, want {list(y.shape)}")
        y_in.copy_(y)
    else:
        y_in = y
    combined, combined_w, event = buf.combine(y_in, handle, topk_weights=y_w, bias=bias, **_overlap(buf, overlap))
    _finish(event, overlap)
    exp_x, exp_w = oracle.combine(rank, allgather(y, pg), in_rank_all, allgather(y_w, pg),
                                  biases[0] if num_bias else None, biases[1] if num_bias == 2 else None,
                                  ranks_per_node=ranks_per_node)
    ck.bits(combined, exp_x, "combined_x")
    ck.bits(combined_w, exp_w, "combined_topk_weights")
    ck.done()
    return handle


@pytest.mark.parametrize("fp8", [None, "float", "float-column-major"])
def test_dispatch_combine_big(buffer, pg, device, request, base_seed, fp8):
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    tokens = int(torch.randint(128, 257, (1,), generator=gen))
    run_normal(buffer, pg, gen, device, **BIG, num_tokens=tokens, fp8=fp8,   # run_normal maps "float-column-major"
               expert_alignment=1 if fp8 is None else 4, num_bias=1 if fp8 else 0)


@pytest.mark.parametrize("case", ["bf16-align4", "fp8-int32-scales", "no-topk", "dense", "zero-copy"])
def test_dispatch_combine_small(buffer, pg, device, request, base_seed, case):
    """Odd shapes: hidden 256, 3 tokens, top-3 of 12 experts; rank 1 holds no tokens at all."""
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    tokens = 0 if rank == 1 else 3
    kwargs = dict(SMALL, num_tokens=tokens)
    if case == "bf16-align4":
        run_normal(buffer, pg, gen, device, **kwargs, expert_alignment=4, num_bias=2)
    elif case == "fp8-int32-scales":
        run_normal(buffer, pg, gen, device, **kwargs, fp8="int32", num_bias=1)
    elif case == "no-topk":
        run_normal(buffer, pg, gen, device, **kwargs, use_topk=False, expert_alignment=4)
    elif case == "zero-copy":   # tokens and expert outputs written into get_next_{dispatch,combine}_buffer's tensors
        run_normal(buffer, pg, gen, device, **kwargs, zero_copy=True, zero_copy_dispatch=True, num_bias=1)
    else:   # no -1 slots: every token reaches several ranks
        run_normal(buffer, pg, gen, device, **kwargs, p_none=0.0)


@pytest.mark.parametrize("num_bias", [0, 1, 2])
def test_combine_bias(buffer, pg, device, request, base_seed, num_bias):
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    run_normal(buffer, pg, gen, device, hidden=512, topk=4, experts=16, num_tokens=17 + rank, num_bias=num_bias)


@pytest.mark.parametrize("fp8", [None, "float"])
def test_num_worst_tokens(buffer, pg, device, request, base_seed, fp8):
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    handle = run_normal(buffer, pg, gen, device, hidden=512, topk=4, experts=16, num_tokens=9 + 2 * rank,
                        fp8=fp8, num_worst_extra=5)
    assert handle.num_recv_rows >= handle.num_recv_tokens + 5


def test_num_worst_tokens_too_small_raises_everywhere(buffer, pg, device, request, base_seed):
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    experts = num_experts_for(16, num_ranks)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16).to(device)
    idx = make_topk(8, 2, experts, gen, p_none=0.0, all_none_token=False).to(device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    # every rank sends all 8 tokens to rank 0, which then receives one more than num_worst_tokens
    in_rank = torch.zeros_like(in_rank)
    in_rank[:, 0] = True
    with pytest.raises(RuntimeError, match="num_worst_tokens"):
        buffer.dispatch(x, num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, num_worst_tokens=8 * num_ranks - 1)
    # nothing is left half-done: the next call works
    run_normal(buffer, pg, gen, device, **SMALL, num_tokens=3)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fp8", [None, "float"])
def test_internode_logical_nodes(pg, device, request, base_seed, fp8):
    """Normal mode over logical nodes (ranks_per_node=1 and, with 4 ranks, 2): DeepEP's internode API on the
    reference transport, the oracle of the internode kernels: per-node counts, rows ordered by global source
    rank, DeepEP's handle positions, cached dispatch, and the combine summed node by node."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    for per_node in sorted({1, 2 if num_ranks % 2 == 0 and num_ranks > 2 else 1}):
        nvl = deep_ep.Config().get_nvl_buffer_size_hint(7168 * 2, num_ranks, 256)
        buf = deep_ep.Buffer(pg, nvl, 0, transport="reference", ranks_per_node=per_node)
        ck = Checker(pg)
        ck.true(buf.nodes.num_nodes == num_ranks // per_node, f"nodes {buf.nodes}")
        try:   # a kernel transport refuses normal mode over several nodes, before any set-up (every rank alike)
            deep_ep.Buffer(pg, nvl, 0, transport="nvlink", ranks_per_node=per_node)
            ck.true(False, "Buffer(transport='nvlink') over several nodes did not raise")
        except ValueError as e:
            ck.true("reference" in str(e), f"unexpected refusal: {e}")
        ck.done()
        run_normal(buf, pg, gen, device, **BIG, num_tokens=int(torch.randint(32, 97, (1,), generator=gen)), fp8=fp8,
                   num_bias=2, ranks_per_node=per_node, num_worst_extra=3 if fp8 else None)
        run_normal(buf, pg, gen, device, **SMALL, num_tokens=0 if rank == 1 else 5, ranks_per_node=per_node,
                   use_topk=fp8 is None)


@pytest.mark.mpi(min_size=2)
def test_mpi_comm_buffer_normal(mpi_buffer, pg, device, request, base_seed):
    """Buffer(None, comm=MPI.COMM_WORLD): the same ops over mpi4py instead of the torch group."""
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    run_normal(mpi_buffer, pg, gen, device, **BIG, num_tokens=32 + rank, fp8="float", num_bias=2)
    run_normal(mpi_buffer, pg, gen, device, **SMALL, num_tokens=0 if rank == 1 else 3, num_worst_extra=2)


# ---- low-latency mode ----------------------------------------------------------------------------
def run_low_latency(buf, pg, gen, device, *, hidden, topk, experts, max_tokens, num_tokens, mode,
                    hook=False, zero_copy=False, use_out=False, p_none=0.1, overlap=False):
    """low_latency_dispatch and low_latency_combine of random inputs, compared to the oracle. overlap (with
    hook=False): async_finish=True, results read after the caller's stream waited on the returned event."""
    rank, num_ranks = world(pg)
    experts = num_experts_for(experts, num_ranks)
    local = experts // num_ranks
    fp8, round_scale, ue8m0 = mode != "bf16", mode in ("fp8-round", "fp8-ue8m0"), mode == "fp8-ue8m0"
    x = torch.randn(num_tokens, hidden, generator=gen)
    if num_tokens >= 2:   # exercise the FP8 amax clamp: an all-zero token and a block of tiny values
        x[0] = 0
        x[1, :128] *= 1e-7
    x = x.to(torch.bfloat16).to(device)
    idx = make_topk(num_tokens, topk, experts, gen, p_none).to(device)
    weights = torch.rand(num_tokens, topk, generator=gen).to(device)
    recv_stats = torch.zeros(local, dtype=torch.int32, device=device)
    wait_stats = torch.zeros(num_ranks, dtype=torch.int64, device=device)

    ck = Checker(pg)
    overlap = overlap and not hook
    recv_x, recv_count, handle, event, recv_hook = buf.low_latency_dispatch(
        x, idx, max_tokens, experts, cumulative_local_expert_recv_stats=recv_stats,
        dispatch_wait_recv_cost_stats=wait_stats, use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0,
        return_recv_hook=hook, async_finish=overlap)
    _finish(event, "caller" if overlap else None)
    ck.true((recv_hook is not None) == hook, f"hook {recv_hook} with return_recv_hook={hook}")
    if hook:
        recv_hook()
    x_all, idx_all = allgather(x, pg), allgather(idx, pg)
    expected = oracle.low_latency_dispatch(rank, experts, max_tokens, x_all, idx_all, fp8, round_scale, ue8m0)
    slots = num_ranks * max_tokens
    recv_scales = None
    if fp8:
        recv_x, recv_scales = recv_x
        scale_cols = hidden // 512 if ue8m0 else hidden // 128
        ck.true(recv_x.dtype == torch.float8_e4m3fn, f"recv_x dtype {recv_x.dtype}")
        ck.true(recv_scales.dtype == (torch.int32 if ue8m0 else torch.float32), f"scales dtype {recv_scales.dtype}")
        ck.true(recv_scales.shape == (local, slots, scale_cols) and recv_scales.stride(1) == 1,
                f"scales shape {list(recv_scales.shape)} strides {recv_scales.stride()} (want column-major)")
    ck.true(recv_x.shape == (local, slots, hidden), f"recv_x shape {list(recv_x.shape)}")
    ck.bits(recv_count, expected.recv_count, "recv_count")
    # The kernels place each (expert, source) block where its reservation landed: rows are compared through
    # the row map (the identity for the reference transport, whose layout is the oracle's).
    try:
        rows = [r.to(device) for r in oracle.low_latency_row_map(handle.layout_range, expected.layout_range)]
    except AssertionError as e:
        ck.true(False, f"layout_range: {e}")
        rows = [torch.arange(int(n), device=device) for n in expected.recv_count.tolist()]
    for e in range(local):
        n = int(expected.recv_count[e])
        ck.bits(recv_x[e, :n], expected.recv_x[e][rows[e]], f"recv_x[expert {e}]")
        ck.bits(handle.src_info[e, :n], expected.src_info[e][rows[e]], f"src_info[expert {e}]")
        if fp8:
            ck.bits(recv_scales[e, :n], expected.recv_x_scales[e][rows[e]], f"recv_x_scales[expert {e}]")
    ck.bits(recv_stats, expected.recv_count, "cumulative_local_expert_recv_stats")
    ck.true(bool((wait_stats > 0).all()), f"dispatch_wait_recv_cost_stats {wait_stats.tolist()}")
    ck.true(tuple(handle)[2:] == (max_tokens, hidden, experts), f"handle tail {tuple(handle)[2:]}")

    # combine: random expert outputs in the valid slots only (the rest stays uninitialized)
    if zero_copy:
        y = buf.get_next_low_latency_combine_buffer(handle)
        ck.true(y.shape == (local, slots, hidden) and y.dtype == torch.bfloat16 and y.device == x.device,
                f"zero-copy buffer {y.dtype}{list(y.shape)} on {y.device}")
    else:
        y = torch.empty(local, slots, hidden, dtype=torch.bfloat16, device=device)
    counts = expected.recv_count.tolist()
    valid = torch.randn(sum(counts), hidden, generator=gen).to(torch.bfloat16).to(device)
    offset = 0
    for e, n in enumerate(counts):
        y[e, :n] = valid[offset:offset + n]
        valid[offset:offset + n][rows[e]] = y[e, :n].clone()   # valid in the oracle's row order
        offset += n
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device) if use_out else None
    combine_stats = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    combined, event, combine_hook = buf.low_latency_combine(y, idx, weights, handle, zero_copy=zero_copy,
                                                            return_recv_hook=hook, out=out, async_finish=overlap,
                                                            combine_wait_recv_cost_stats=combine_stats)
    _finish(event, "caller" if overlap else None)
    ck.true((combine_hook is not None) == hook, f"combine hook {combine_hook} with return_recv_hook={hook}")
    if hook:
        combine_hook()
    ck.true(not use_out or combined is out, "low_latency_combine(out=...) must return out")
    # rebuild every rank's y (valid slots only) for the oracle
    valid_all, counts_all = allgather(valid, pg), allgather(expected.recv_count, pg)
    y_all = []
    for v, c in zip(valid_all, counts_all):
        full = torch.empty(local, slots, hidden, dtype=torch.bfloat16, device=device)
        offset = 0
        for e, n in enumerate(c.tolist()):
            full[e, :n] = v[offset:offset + n]
            offset += n
        y_all.append(full)
    expected_out = oracle.low_latency_combine(rank, experts, max_tokens, y_all, idx_all, weights)
    ck.bits(combined, expected_out, "low_latency_combine")
    ck.true(bool((combine_stats > 0).all()), f"combine_wait_recv_cost_stats {combine_stats.tolist()}")
    ck.done()


LL_CASES = [  # mode, combine flavor
    ("bf16", dict()),
    ("fp8", dict(zero_copy=True)),
    ("fp8-round", dict(use_out=True)),
    ("fp8-ue8m0", dict(zero_copy=True, use_out=True)),
]


@pytest.mark.parametrize("hook", [False, True], ids=["direct", "hook"])
@pytest.mark.parametrize("mode,flavor", LL_CASES, ids=[c[0] for c in LL_CASES])
def test_low_latency_big(ll_buffer, pg, device, request, base_seed, mode, flavor, hook):
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    # one rank sends nothing in bf16 mode (when there are peers)
    tokens = 0 if (mode == "bf16" and num_ranks > 1 and rank == num_ranks - 1) else \
        int(torch.randint(LL_MAX_TOKENS // 2, LL_MAX_TOKENS + 1, (1,), generator=gen))
    run_low_latency(ll_buffer, pg, gen, device, **BIG, max_tokens=LL_MAX_TOKENS, num_tokens=tokens,
                    mode=mode, hook=hook, **flavor)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-round"])
def test_low_latency_small(ll_buffer, pg, device, request, base_seed, mode):
    """hidden 256, 3 tokens (rank 1: none), top-3 of 12 experts, max 4 tokens per rank."""
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    run_low_latency(ll_buffer, pg, gen, device, **SMALL, max_tokens=4, num_tokens=0 if rank == 1 else 3,
                    mode=mode, hook=mode == "fp8", zero_copy=mode == "bf16")


def test_low_latency_all_experts_missing(ll_buffer, pg, device, request, base_seed):
    """Every top-k slot is -1: nothing moves, combine gives zeros."""
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    run_low_latency(ll_buffer, pg, gen, device, **SMALL, max_tokens=4, num_tokens=4, mode="fp8", p_none=1.0)


@pytest.mark.mpi(min_size=2)
def test_mpi_comm_buffer_low_latency(ll_mpi_buffer, pg, device, request, base_seed):
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    run_low_latency(ll_mpi_buffer, pg, gen, device, **BIG, max_tokens=LL_MAX_TOKENS, num_tokens=20 + rank,
                    mode="fp8-ue8m0", hook=True, zero_copy=True)


def test_low_latency_double_buffer_and_clean(ll_buffer, pg, device, request, base_seed):
    """get_next_low_latency_combine_buffer alternates between two halves, one per LL call."""
    rank, num_ranks = world(pg)
    experts = num_experts_for(SMALL["experts"], num_ranks)
    ll_buffer.clean_low_latency_buffer(4, SMALL["hidden"], experts)
    x = torch.zeros(2, SMALL["hidden"], dtype=torch.bfloat16, device=device)
    idx = torch.zeros(2, 1, dtype=torch.int64, device=device)
    ptrs = []
    for _ in range(3):
        _, _, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)
        ptrs.append(ll_buffer.get_next_low_latency_combine_buffer(handle).data_ptr())
    assert ptrs[0] != ptrs[1] and ptrs[0] == ptrs[2]
    ll_buffer.clean_low_latency_buffer(4, SMALL["hidden"], experts)
