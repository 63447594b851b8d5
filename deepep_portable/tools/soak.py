"""`python -m deepep_portable soak`: many rounds of the same ops on one Buffer, watched for leaks and drift
(issue 20, item 3).

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


def _clone(out):
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(x) for x in out)
    return out.clone() if isinstance(out, torch.Tensor) else out


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
    return round_


def _low_latency_round(buf: Buffer, cfg, device, gen) -> Callable[[], tuple]:
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = _random_topk(cfg.tokens, cfg.experts, cfg.topk, device, gen)
    weights = torch.rand(cfg.tokens, cfg.topk, generator=gen).to(device)

    def round_() -> tuple:
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, cfg.tokens, cfg.experts, use_fp8=False)
        combined, _, _ = buf.low_latency_combine(recv, idx, weights, handle)
        return count, combined
    return round_


def _graphed(round_: Callable[[], tuple]) -> Callable[[], tuple]:
    """The round captured once (after an eager warm-up on a side stream), then replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        round_()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = round_()

    def replay() -> tuple:
        graph.replay()
        return outs
    replay.graph = graph   # keep it alive with the closure
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
            first = _clone(round_())
            label = f"{mode}{' graph' if graph else ''}"
            t0, done = time.perf_counter(), 0
            while done < cfg.rounds:
                n = min(cfg.check_every, cfg.rounds - done)
                for _ in range(n - 1):
                    round_()
                out = round_()
                same = _same(out, first)
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
                if not same:
                    failures.append(f"rank {rank}: {label} round {done}: the result differs from round 1")
            dist.barrier(group)
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
