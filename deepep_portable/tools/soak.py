"""`python -m deepep_portable soak`: many rounds of the same ops on one Buffer, watched for leaks and drift.

Each rank repeats a round (normal mode: dispatch, then combine of the received rows; low-latency mode:
low_latency_dispatch, then low_latency_combine of the received rows; on a GPU also the same round captured
once in a CUDA graph and replayed) on fixed inputs. Every `--check-every` rounds it compares the round's
outputs bit for bit with those of the first round (whose correctness the test suites check against the
oracle) and samples what must not grow: GPU memory (allocated by torch, and used on the device), host
memory (RSS) and open file descriptors, plus the time per round. Rank 0 prints a row per window and a
verdict; the exit code is non-zero when a result changed, a resource grew past its slack, or the last
window is more than --slowdown times slower than the median window.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..config import Config
from .bench import _random_topk
from .spawn import run_local

MB = 1 << 20


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return -1


def _gpu_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _sample(device: torch.device) -> Dict[str, int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dict(torch_mb=(torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) // MB,
                gpu_mb=_gpu_used(device) // MB, rss_mb=_rss() // MB, fds=_fds())


def _same(a, b) -> bool:
    """Bit-for-bit equality of (nested tuples of) tensors."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return a.numel() == 0 or torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return a == b


def _difference(a, b, where: str = "output") -> str:
    """Where `a` first differs from `b` (same nesting as _same): which output, how many elements, the first."""
    if isinstance(a, (tuple, list)):
        return next((_difference(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)),
                    f"{where}: lengths {len(a)} and {len(b)}")
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return f"{where}: {a!r:.60} became {b!r:.60}" if not isinstance(a, torch.Tensor) else \
            f"{where}: shape/dtype {tuple(a.shape)} {a.dtype} became {tuple(b.shape)} {b.dtype}"
    if a.dim() == 0:
        return f"{where}: {a.item()} became {b.item()}"
    rows_a = a.contiguous().reshape(a.shape[0], -1).view(torch.uint8)
    rows_b = b.contiguous().reshape(b.shape[0], -1).view(torch.uint8)
    bad = (rows_a != rows_b).any(dim=1).nonzero().flatten().tolist()
    same_rows = sorted(map(bytes, rows_a.numpy())) == sorted(map(bytes, rows_b.numpy()))
    zero = int((rows_b[bad] == 0).all(dim=1).sum()) if bad else 0
    return (f"{where}: {len(bad)} of {a.shape[0]} rows differ, first rows {bad[:6]}"
            f"{' (the same rows in another order)' if same_rows else ''}{f', {zero} of them all zero' if zero else ''}")


def _clone(out, device=None):
    """A copy of (nested tuples of) tensors, on `device` (None: where they are)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(x, device) for x in out)
    if not isinstance(out, torch.Tensor):
        return out
    return out.clone() if device is None else out.to(device, copy=True)


def _normal_round(buf: Buffer, cfg, device, gen) -> Callable[[], tuple]:
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = _random_topk(cfg.tokens, cfg.experts, cfg.topk, device, gen)
    weights = torch.rand(cfg.tokens, cfg.topk, generator=gen).to(device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, cfg.experts)
    worst = cfg.tokens * buf.group_size if cfg.graph else 0   # a graph needs sizes known up front

    def round_() -> tuple:
        recv, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=idx,
                                                     topk_weights=weights, num_worst_tokens=worst)
        combined, combined_w, _ = buf.combine(recv, handle, topk_weights=recv_w)
        return recv, combined, combined_w
    round_.inputs = (x, idx, weights, per_rank, per_expert, in_rank)
    return round_


def _low_latency_round(buf: Buffer, cfg, device, gen) -> Callable[[], tuple]:
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = _random_topk(cfg.tokens, cfg.experts, cfg.topk, device, gen)
    weights = torch.rand(cfg.tokens, cfg.topk, generator=gen).to(device)

    def round_() -> tuple:
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, cfg.tokens, cfg.experts, use_fp8=False)
        combined, _, _ = buf.low_latency_combine(recv, idx, weights, handle)
        return count, combined
    round_.inputs = (x, idx, weights)
    return round_


def _graphed(round_: Callable[[], tuple]) -> Callable[[], tuple]:
    """The round captured once (after an eager warm-up on a side stream), then replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = round_()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = _clone(warm, "cpu")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = round_()

    def replay() -> tuple:
        graph.replay()
        return outs
    replay.graph = graph   # keep it alive with the closure
    # The graph reads the round's inputs by address: they must outlive it (freed, their memory would be
    # handed to later allocations and the replays would read those).
    replay.inputs = round_.inputs
    replay.eager = eager   # the eager warm-up's outputs (host): what every replay must reproduce
    return replay


def _soak(rank: int, world: int, group, cfg: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(7 + rank)
    rows: List[dict] = []
    failures: List[str] = []
    for mode in cfg.modes:
        for graph in ([False, True] if device.type == "cuda" and cfg.graphs else [False]):
            cfg.graph = graph
            if mode == "normal":
                nvl = Config().get_nvl_buffer_size_hint(cfg.hidden * 2, world, cfg.tokens)
                buf = Buffer(group, nvl, 0, transport=cfg.transport, explicitly_destroy=True)
                round_ = _normal_round(buf, cfg, device, gen)
            else:
                rdma = Buffer.get_low_latency_rdma_size_hint(cfg.tokens, cfg.hidden, world, cfg.experts)
                buf = Buffer(group, 0, rdma, low_latency_mode=True, transport=cfg.transport, explicitly_destroy=True,
                             num_qps_per_rank=max(1, cfg.experts // world))
                round_ = _low_latency_round(buf, cfg, device, gen)
            if graph:
                round_ = _graphed(round_)
            # Round 1's outputs are kept twice: on the host (what later rounds are compared with: no GPU
            # write can touch it) and on the GPU (compared with the host copy at the end: a write into
            # memory the library does not own would show there).
            label = f"{mode}{' graph' if graph else ''}"
            inputs_host = _clone(round_.inputs, "cpu")   # the ops must never write their inputs
            first = _clone(round_())
            first_host = _clone(first, "cpu")
            eager = getattr(round_, "eager", None)
            if eager is not None and not _same(first_host, eager):
                failures.append(f"rank {rank}: {label}: the first replay differs from the eager round: "
                                f"{_difference(eager, first_host)}")
            t0, done = time.perf_counter(), 0
            while done < cfg.rounds:
                n = min(cfg.check_every, cfg.rounds - done)
                for _ in range(n - 1):
                    round_()
                out = round_()
                out = _clone(out, "cpu")
                same = _same(out, first_host)
                s = _sample(device)
                done += n
                now = time.perf_counter()
                ms = (now - t0) * 1e3 / n
                t0 = now
                everyone: List[object] = [None] * world
                dist.all_gather_object(everyone, (same, s, ms), group=group)
                if rank == 0:
                    rows.append(dict(case=label, rounds=done, ms=max(e[2] for e in everyone),
                                     changed=sum(not e[0] for e in everyone), **s))
                inputs_now = _clone(round_.inputs, "cpu")
                if not _same(inputs_now, inputs_host):
                    failures.append(f"rank {rank}: {label} round {done}: an input of the ops changed: "
                                    f"{_difference(inputs_host, inputs_now, 'input')}")
                if not same:
                    vs = "" if eager is None else f" ({'equal to' if _same(out, eager) else 'unlike'} the eager round)"
                    failures.append(f"rank {rank}: {label} round {done}: the result differs from round 1{vs}: "
                                    f"{_difference(first_host, out)}")
            dist.barrier(group)
            if not _same(_clone(first, "cpu"), first_host):
                failures.append(f"rank {rank}: {label}: round 1's outputs, cloned on the GPU, changed while the "
                                f"rounds ran (a write into memory the library does not own): "
                                f"{_difference(first_host, _clone(first, 'cpu'))}")
            buf.destroy()
    verdict = _verdict(rows, cfg) if rank == 0 else []
    everyone = [None] * world
    dist.all_gather_object(everyone, failures + verdict, group=group)
    if rank == 0:
        print(f"{'case':14s} {'rounds':>8s} {'ms/round':>9s} {'changed':>8s} {'torch_MB':>9s} {'gpu_MB':>7s} "
              f"{'rss_MB':>7s} {'fds':>5s}")
        for r in rows:
            print(f"{r['case']:14s} {r['rounds']:8d} {r['ms']:9.3f} {r['changed']:8d} {r['torch_mb']:9d} "
                  f"{r['gpu_mb']:7d} {r['rss_mb']:7d} {r['fds']:5d}")
        problems = [p for ps in everyone for p in ps]
        print("soak: " + ("PASS" if not problems else "FAIL\n  " + "\n  ".join(problems)), flush=True)
    if any(everyone):
        raise SystemExit(1)


def _verdict(rows: List[dict], cfg) -> List[str]:
    """Problems in the rank-0 table: growth after the first window (the first includes warm-up allocations),
    and slowdown of the last window."""
    problems = []
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        if len(mine) < 2:
            continue
        base, last = mine[1] if len(mine) > 2 else mine[0], mine[-1]
        for key, slack in (("torch_mb", 1), ("gpu_mb", 64), ("rss_mb", 64), ("fds", 0)):
            if last[key] - base[key] > slack:
                problems.append(f"{case}: {key} grew from {base[key]} to {last[key]} (slack {slack})")
        median = statistics.median(r["ms"] for r in mine)
        if last["ms"] > cfg.slowdown * median:
            problems.append(f"{case}: the last window took {last['ms']:.3f} ms per round, median {median:.3f}")
    return problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--modes", nargs="+", choices=["normal", "low_latency"], default=["normal", "low_latency"])
    p.add_argument("--rounds", type=int, default=100_000 if gpu else 200)
    p.add_argument("--check-every", type=int, default=1000 if gpu else 50)
    p.add_argument("--tokens", type=int, default=128 if gpu else 16)
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--topk", type=int, default=8 if gpu else 2)
    p.add_argument("--experts", type=int, default=256 if gpu else 8)
    p.add_argument("--transport", default="auto")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="eager rounds only (GPU)")
    p.add_argument("--slowdown", type=float, default=1.5, help="last window / median window time that fails")


def main(cfg: argparse.Namespace) -> int:
    cfg.graph = False
    run_local(_soak, cfg.ranks, cfg)
    return 0
