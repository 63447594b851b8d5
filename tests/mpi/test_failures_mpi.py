"""One rank's failure reaches every rank, with a named error, within the Buffer's timeout (docs/RELIABILITY.md).

  mpirun -n 4 python -m pytest --with-mpi -q tests/mpi/test_failures_mpi.py
  (GPU: DEEPEP_TEST_TRANSPORT=nvlink | nvshmem, ranks sharing the GPU under MPS: scripts/gpu_tests.sh N failures)

One rank of a group of 2, 4 (and the whole job) makes a bad call (a wrong dtype, an expert index out of range,
more tokens than the Buffer holds, a wrong shape; in dispatch, combine and the low-latency dispatch) while the
others make a good one. The bad rank raises its own TypeError / ValueError; every other rank raises a CommError
that names the bad rank and its reason, within timeout_s and a few seconds. Then a correct round trip, checked
against the oracle, works: on the same Buffer where the error says it is usable (the reference transport: its
ops meet on the host before moving anything), else on a new Buffer after the old one refuses every op.
Also: a rank that never comes is named by the others, and a rank that comes after they gave up is told so;
ranks at different ops are stopped before they exchange anything.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import deepep_portable as deep_ep
from test_reference_mpi import SMALL, generator, num_experts_for, run_low_latency, run_normal, world
from test_two_buffers_mpi import dispatch_with_layout as _dispatch, make_inputs

pytestmark = pytest.mark.mpi
TOKENS = 24
LL_MAX = 32
TIMEOUT_S = float(os.environ.get("DEEPEP_TEST_FAILURE_TIMEOUT_S", "6"))
SLACK_S = 25.0   # the refusing rank of a kernel transport waits for its peers' kernels to give up (REFUSAL_GRACE_S)
CASES = ["dtype", "expert_index", "token_count", "shape", "combine_dtype", "low_latency_dtype"]


def _transport() -> str:
    return os.environ.get("DEEPEP_TEST_TRANSPORT", "nvlink" if torch.cuda.is_available() else "reference")


@pytest.fixture(scope="module")
def groups(pg):
    """{size: gloo group of ranks 0..size-1} for sizes 2, 4 and the job (made by every rank, in one order)."""
    _, n = world(pg)
    sizes = sorted({s for s in (2, 4, n) if 2 <= s <= n})
    return {s: (dist.new_group(list(range(s)), backend="gloo"), s) for s in sizes}


def _one_nvshmem_size(groups, size: int) -> None:
    """NVSHMEM is initialized once per process, over the ranks of its first Buffer, and every later Buffer of the
    process must span the same ranks: over nvshmem one job covers one group size (DEEPEP_TEST_FAILURE_SIZE, by
    default the job's); the others skip."""
    if _transport() == "nvshmem":
        wanted = int(os.environ.get("DEEPEP_TEST_FAILURE_SIZE", str(max(groups))))
        if size != wanted:
            pytest.skip(f"nvshmem: this job runs the {wanted}-rank groups (NVSHMEM spans one set of ranks per process)")


def _make_buffer(group, size):
    hidden = SMALL["hidden"]
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, size, TOKENS)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX, hidden, size, num_experts_for(SMALL["experts"], size))
    return deep_ep.Buffer(group, nvl, rdma, low_latency_mode=True, transport=_transport(), timeout_s=TIMEOUT_S)


def _inputs(gen, device, size, tokens=TOKENS):
    return make_inputs(gen, device, size, tokens, SMALL)


def _call(buf, case: str, bad: bool, gen, device, size):
    """The call of `case`: a bad one on the bad rank, the same call with good arguments elsewhere."""
    x, idx, w, experts = _inputs(gen, device, size)
    if case == "combine_dtype":
        recv_x, _, recv_w, _, handle, _ = _dispatch(buf, x, idx, w, experts)
        buf.synchronize()
        buf.combine(recv_x.float() if bad else recv_x, handle, topk_weights=recv_w)
    elif case == "low_latency_dtype":
        buf.low_latency_dispatch(x.float() if bad else x, idx, LL_MAX, experts, use_fp8=False)
    elif not bad:
        _dispatch(buf, x, idx, w, experts)
    elif case == "dtype":
        _dispatch(buf, x.float(), idx, w, experts)
    elif case == "expert_index":   # a valid layout, but an index past the last expert in topk_idx itself
        wrong = idx.clone()
        wrong[0, 0] = experts
        _dispatch(buf, x, wrong, w, experts, layout_idx=idx)
    elif case == "token_count":
        many = 64 * TOKENS * size
        x, idx, w, _ = _inputs(gen, device, size, tokens=many)
        _dispatch(buf, x, idx, w, experts)
    elif case == "shape":
        _dispatch(buf, x, idx, w[:, :-1], experts)
    buf.synchronize()


def _outcome(fn, buf=None):
    """(kind, text, whether the Buffer is usable after, seconds) of calling fn."""
    start = time.monotonic()
    try:
        fn()
        kind, text, usable = "ok", "", True
    except (TypeError, ValueError) as e:
        kind, text, usable = "refused", f"{type(e).__name__}: {e}", buf is None or buf.usable
    except deep_ep.CommError as e:
        kind, text, usable = "comm", f"{type(e).__name__}: {e}", e.usable
    except Exception as e:   # noqa: BLE001 - reported on every rank below
        kind, text, usable = "other", f"{type(e).__name__}: {e}", False
    return kind, text, usable, time.monotonic() - start


def _gather(obj, pg):
    out = [None] * world(pg)[1]
    dist.all_gather_object(out, obj, group=pg)
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size", [2, 4, 0], ids=["2ranks", "4ranks", "all"])
def test_one_rank_bad_input_fails_every_rank_then_a_correct_op_works(groups, pg, device, request, base_seed, case,
                                                                   size):
    rank, num_ranks = world(pg)
    if size == 0 and num_ranks in (2, 4):
        pytest.skip(f"the whole job is {num_ranks} ranks: the {num_ranks}ranks case covers it")
    size = size or num_ranks
    if size not in groups:
        pytest.skip(f"{size} ranks: more than this job's {num_ranks}")
    _one_nvshmem_size(groups, size)
    group, size = groups[size]
    member = rank < size
    gen = generator(request, base_seed, rank)
    buf = _make_buffer(group, size) if member else None
    bad = size - 1
    result = _outcome(lambda: _call(buf, case, rank == bad, gen, device, size), buf) if member else None
    results = _gather(result, pg)
    problems = []
    for r, res in enumerate(results[:size]):
        kind, text, usable, elapsed = res
        if r == bad and kind != "refused":
            problems.append(f"rank {r} (bad input) ended {kind}: {text[:300]}")
        if r != bad and (kind != "comm" or f"rank {bad}" not in text or results[bad][1].split(":")[0] not in text):
            problems.append(f"rank {r} must raise a CommError naming rank {bad} and its "
                            f"{results[bad][1].split(':')[0]}; got {kind}: {text[:400]}")
        if elapsed > TIMEOUT_S + SLACK_S:
            problems.append(f"rank {r} took {elapsed:.1f} s (timeout_s {TIMEOUT_S:g})")
    assert not problems, problems
    # Every rank agrees whether the Buffer goes on; where it does not, it refuses every op, and a new one works.
    usable = {res[2] for res in results[:size]}
    assert len(usable) == 1, f"ranks disagree on whether the Buffer is usable: {results[:size]}"
    if member and not usable.pop():
        again = _outcome(lambda: _call(buf, "dtype", False, gen, device, size), buf)
        assert again[0] == "comm" and "unusable" in again[1], again
        buf = _make_buffer(group, size)
    if member:
        run_normal(buf, group, gen, device, **SMALL, num_tokens=int(torch.randint(1, TOKENS + 1, (1,), generator=gen)))
        run_low_latency(buf, group, gen, device, **SMALL, max_tokens=LL_MAX, num_tokens=TOKENS, mode="bf16")


@pytest.mark.mpi(min_size=2)
def test_every_rank_refusing_the_same_call_keeps_the_buffer(groups, pg, device, request, base_seed):
    """A bad call made on every rank (a program bug, not a data one): each rank raises its own error, nothing ran
    anywhere, and the Buffer goes on, on every transport."""
    rank, num_ranks = world(pg)
    group, size = groups[num_ranks]
    _one_nvshmem_size(groups, size)
    gen = generator(request, base_seed, rank)
    buf = _make_buffer(group, size)
    kind, text, usable, _ = _outcome(lambda: _call(buf, "dtype", True, gen, device, size), buf)
    assert kind == "refused" and ("dtype" in text.lower() or "bfloat16" in text) and usable, (text, usable)
    run_normal(buf, group, gen, device, **SMALL, num_tokens=TOKENS)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_never_comes_is_named(pg, device, request, base_seed):
    """The last rank skips a dispatch: the others raise PeersAbsentError naming it within timeout_s, and their
    Buffer refuses every later op. When it comes later, it is told that the others gave up on it (the reference
    transport: its ops meet on the host; a kernel transport's kernels name the peer they waited for)."""
    rank, num_ranks = world(pg)
    group = dist.new_group(list(range(num_ranks)), backend="gloo")   # its own group: messages stay unread there
    gen = generator(request, base_seed, rank)
    hidden = SMALL["hidden"]
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, TOKENS)
    buf = deep_ep.Buffer(group, nvl, 0, transport="reference", timeout_s=3.0)
    x, idx, w, experts = _inputs(gen, device, num_ranks)
    late = num_ranks - 1
    first = _outcome(lambda: _dispatch(buf, x, idx, w, experts)) if rank != late else None
    dist.barrier(group=pg)   # the late rank comes once the others gave up
    if rank == late:
        first = _outcome(lambda: _dispatch(buf, x, idx, w, experts))
    after = _outcome(lambda: _dispatch(buf, x, idx, w, experts))
    kind, text, usable, elapsed = first
    assert kind == "comm" and "PeersAbsentError" in text and not usable, first
    if rank != late:
        assert f"rank {late} did not reach" in text and elapsed < 3.0 + 5.0, first
    else:
        assert "gave up waiting for rank" in text, first
    assert after[0] == "comm" and "unusable" in after[1], after


@pytest.mark.mpi(min_size=2)
def test_ranks_at_different_ops_are_stopped(pg, device, request, base_seed):
    """Rank 0 calls low_latency_dispatch while the others call dispatch (a program bug): on the reference
    transport every rank raises before any data moves, instead of exchanging each other's bytes."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    hidden = SMALL["hidden"]
    experts = num_experts_for(SMALL["experts"], num_ranks)
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, TOKENS)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX, hidden, num_ranks, experts)
    buf = deep_ep.Buffer(pg, nvl, rdma, low_latency_mode=True, transport="reference", timeout_s=10.0)
    x, idx, w, experts = _inputs(gen, device, num_ranks)
    if rank == 0:
        res = _outcome(lambda: buf.low_latency_dispatch(x, idx, LL_MAX, experts, use_fp8=False))
    else:
        res = _outcome(lambda: _dispatch(buf, x, idx, w, experts))
    assert res[0] == "comm" and "out of step" in res[1], res


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_bad_elastic_call_on_one_rank_reaches_the_others(groups, pg, device, request, base_seed, op):
    """DeepEP V2's ElasticBuffer checks its own arguments before it calls the Buffer's ops: a rank that fails them
    still refuses the call its peers make (its first collective op), so they raise a CommError naming it, and a
    correct round trip works after (on the same ElasticBuffer where the error says it is usable, else a new one)."""
    rank, num_ranks = world(pg)
    group, size = groups[num_ranks]
    _one_nvshmem_size(groups, size)
    gen = generator(request, base_seed, rank)
    hidden, topk = SMALL["hidden"], SMALL["topk"]

    def make():
        return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TOKENS, hidden=hidden, num_topk=topk,
                                     num_gpu_timeout_secs=max(1, int(TIMEOUT_S)), transport=_transport())

    elastic = make()
    x, idx, w, experts = _inputs(gen, device, size)
    bad = size - 1

    def call():
        if op == "dispatch":
            elastic.dispatch(x, topk_idx=idx.to(torch.int32) if rank == bad else idx, topk_weights=w,
                             num_experts=experts)
        else:
            recv_x, _, _, handle, _ = elastic.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts)
            elastic.runtime.synchronize()
            elastic.combine(recv_x.float() if rank == bad else recv_x, handle)
        elastic.runtime.synchronize()

    results = _gather(_outcome(call, elastic.runtime), pg)
    kind, text, usable, _ = results[rank]
    if rank == bad:
        assert kind == "refused", results[rank]
    else:
        assert kind == "comm" and f"rank {bad}" in text and "TypeError" in text, results[rank]
    assert len({r[2] for r in results}) == 1, f"ranks disagree on whether the Buffer is usable: {results}"
    if not usable:
        elastic = make()
    recv_x, _, _, handle, _ = elastic.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts)
    combined, _, _ = elastic.combine(recv_x, handle)
    in_rank = torch.zeros(x.size(0), size, dtype=torch.bool, device=device)
    valid = idx >= 0
    in_rank[torch.arange(x.size(0), device=device).unsqueeze(1).expand_as(idx)[valid],
            (idx // (experts // size))[valid]] = True
    expected = (x.float() * in_rank.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(combined, expected), f"rank {rank}: the round trip after the failure differs"
