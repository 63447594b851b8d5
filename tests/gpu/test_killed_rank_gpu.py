"""A rank killed (SIGKILL) in the middle of low-latency work, on one GPU: 4 worker
processes (DEEPEP_TEST_KILLED_RANKS) spawned from this test (not MPI: mpirun would take the whole job down
with the killed rank), each with its own context on the GPU, a gloo group over a file store.

- Without shrink: the last rank dies before a dispatch; every survivor raises CommTimeoutError naming it
  within the Buffer's timeout (plus slack), its CUDA context still works, and a fresh group and Buffer of
  the survivors then runs a dispatch + combine checked against plain torch.
- With shrink (enable_shrink=True): the survivors' dispatch and combine complete without the dead rank's rows
  and its mask bit is set.
"""
from __future__ import annotations

import os
import queue
import signal
import time
import traceback

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Workers (DEEPEP_TEST_KILLED_RANKS, default 4); the last one dies. Four experts per rank.
RANKS = int(os.environ.get("DEEPEP_TEST_KILLED_RANKS", "4"))
DEAD, TIMEOUT_S = RANKS - 1, 4.0
T, HIDDEN, EXPERTS, TOPK = 16, 512, 4 * RANKS, 2


def _group(store_dir: str, tag: str, rank: int, world: int):
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(store_dir, tag), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return dist.group.WORLD


def _round(buf, rank: int, world: int, gen: torch.Generator, experts: int = EXPERTS):
    """One LL dispatch + combine; returns (combined, x, topk_weights, topk_idx) for a check."""
    x = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(experts, generator=gen)[:TOPK] for _ in range(T)]).cuda()
    w = torch.rand(T, TOPK, generator=gen).cuda()
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv_x.clone(), idx, w, handle)   # identity experts
    torch.cuda.synchronize()
    return combined, x, w, idx


def _worker(rank: int, store_dir: str, shrink: bool, out) -> None:
    try:
        import deepep_portable as deep_ep

        torch.cuda.set_device(0)
        group = _group(store_dir, "all", rank, RANKS)
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, RANKS, EXPERTS)
        buf = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True, enable_shrink=shrink,
                             transport="nvlink", timeout_s=TIMEOUT_S)
        gen = torch.Generator().manual_seed(rank)
        _round(buf, rank, RANKS, gen)                 # everyone alive
        import torch.distributed as dist

        dist.barrier(group=group)
        if rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        if shrink:
            combined, x, w, idx = _round(buf, rank, RANKS, gen)
            status = torch.zeros(RANKS, dtype=torch.int32, device="cuda")
            buf.low_latency_query_mask_buffer(status)
            live = (idx // (EXPERTS // RANKS)) != DEAD
            expected = (x.float() * (w * live).sum(1, keepdim=True)).to(torch.bfloat16)
            out.put((rank, "shrink", status.tolist(),
                     bool(torch.allclose(combined.float(), expected.float(), rtol=1e-2, atol=1e-2)),
                     time.monotonic() - t0))
            return
        caught = None
        try:
            _round(buf, rank, RANKS, gen)
            _round(buf, rank, RANKS, gen)             # the timeout is reported by the next op at the latest
        except Exception as e:   # noqa: BLE001 - reported below
            caught = e
        elapsed = time.monotonic() - t0
        torch.ones(4, device="cuda").sum().item()    # the context survived
        out.put((rank, "timeout", type(caught).__name__, getattr(caught, "peer", None), elapsed))
        # A fresh group and Buffer of the survivors (the old Buffer is abandoned: its close is collective).
        dist.destroy_process_group()
        survivors = [r for r in range(RANKS) if r != DEAD]
        group = _group(store_dir, "survivors", survivors.index(rank), len(survivors))
        experts = EXPERTS // RANKS * len(survivors)   # the survivors keep their experts
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, len(survivors), experts)
        fresh = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, transport="nvlink", timeout_s=TIMEOUT_S)
        combined, x, w, idx = _round(fresh, survivors.index(rank), len(survivors), gen, experts)
        expected = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)
        out.put((rank, "fresh", bool(torch.allclose(combined.float(), expected.float(), rtol=1e-2, atol=1e-2))))
    except Exception:   # noqa: BLE001 - the parent asserts on it
        out.put((rank, "error", traceback.format_exc()))


def _run(tmp_path, shrink: bool):
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path), shrink, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 180
    expected = (RANKS - 1) * (1 if shrink else 2)
    while len(results) < expected and time.monotonic() < deadline:
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [r for r in results if r[1] == "error"]
    assert not errors, "\n".join(r[2] for r in errors)
    assert procs[DEAD].exitcode == -signal.SIGKILL
    return results


def test_killed_rank_raises_on_survivors_then_fresh_buffer_works(tmp_path):
    results = _run(tmp_path, shrink=False)
    timeouts = [r for r in results if r[1] == "timeout"]
    assert len(timeouts) == RANKS - 1, results
    for rank, _, kind, peer, elapsed in timeouts:
        assert kind == "CommTimeoutError" and peer == DEAD, (rank, kind, peer)
        assert elapsed < TIMEOUT_S + 60, (rank, elapsed)
    fresh = [r for r in results if r[1] == "fresh"]
    assert len(fresh) == RANKS - 1 and all(ok for _, _, ok in fresh), results


def test_killed_rank_is_masked_in_shrink_mode(tmp_path):
    results = _run(tmp_path, shrink=True)
    assert len(results) == RANKS - 1, results
    for rank, _, status, ok, elapsed in results:
        assert status == [1 if r == DEAD else 0 for r in range(RANKS)], (rank, status)
        assert ok and elapsed < TIMEOUT_S + 60, (rank, ok, elapsed)
