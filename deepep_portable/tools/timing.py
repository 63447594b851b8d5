"""How the benchmark times an op: CUDA events around samples that all ranks start together (a host
barrier, then the GPU start line), the slowest rank's median, CUDA-graph replays, and the optional
phase profiles and traces of the engines (DEEPEP_PORTABLE_PROFILE=1)."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..device import device_uuid
from .kernels import StartLine


def print_host_profile(what: str, fn: Callable[[], None], device: torch.device, show: bool,
                       calls: int = 20) -> None:
    """cProfile of `calls` calls (every rank runs them: the op is collective; `show` prints): where the
    host time of an op goes, by function (DEEPEP_PORTABLE_PROFILE_HOST=1)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.disable()
    if not show:
        return
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"[host profile rank 0: {what}, {calls} calls]\n{out.getvalue()}", flush=True)


def print_profile(engine, rank: int, tokens: int) -> None:
    """Rank 0 prints the engine's phase profile (DEEPEP_PORTABLE_PROFILE=1), if it kept one; every rank does with
    DEEPEP_PORTABLE_PROFILE_RANKS=all (a collective op waits for its slowest rank: the skew shows there)."""
    profile = getattr(engine, "profile", None)
    if profile is not None and profile.enabled:
        report = profile.report()
        if rank == 0 or os.environ.get("DEEPEP_PORTABLE_PROFILE_RANKS") == "all":
            print(f"[profile rank {rank}, {tokens} tokens] " + ", ".join(f"{k} {v:.0f} us" for k, v in report),
                  flush=True)


LL_LOOP = 10   # low-latency ops are timed as back-to-back calls (see timer)

_START_LINE = None   # the GPU start line of the Buffer being benchmarked (see start_line)


@contextlib.contextmanager
def start_line(buf, cfg: argparse.Namespace):
    """While a Buffer is benchmarked, timer starts every sample at a GPU start line over its group
    (--start-line gpu and ranks on one node; otherwise the host barrier alone)."""
    global _START_LINE
    line = None
    if torch.cuda.is_available() and getattr(cfg, "start_line", "gpu") == "gpu" and buf.device.type == "cuda":
        try:
            line = StartLine(buf.backend.ctx)
        except RuntimeError:   # ranks on several nodes: no IPC mapping of rank 0's word
            line = None
    _START_LINE = line
    try:
        yield
    finally:
        _START_LINE = None
    # Normal exit only: close() is collective, and a rank that raised would otherwise wait in it for
    # peers that sit in another collective (the failing process is going away with its window anyway).
    if line is not None:
        line.close()


def timer(device: torch.device, fn: Callable[[], None], warmup: int, iters: int, group=None,
          loop: int = 1, host_times: Optional[list] = None) -> float:
    """Median seconds of fn (events on CUDA; perf_counter on the CPU).

    With `group`, every timed sample starts after a barrier, and on the GPU (with --start-line gpu, the
    default) after the start line (`_START_LINE`): a one-thread kernel that returns on every rank's
    stream once all ranks' streams reached it, so the start events of all ranks mark the same moment.
    A collective op's time then excludes the skew with which the ranks would otherwise start (a rank
    that starts early counts its wait for the others; the host barrier alone leaves the processes'
    exit skew, tens of microseconds with 8 ranks, in every sample). The ceiling is timed the same way.
    With `loop` > 1 a sample is `loop` back-to-back calls, divided by `loop` (low-latency ops: the
    steady-state time of a call, as consecutive layers issue them; the barrier's exit skew is then
    paid once per sample instead of once per call). `host_times` (a list) collects each sample's host
    seconds per call, from entering fn to its return (CUDA only)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier(group=group)
            if _START_LINE is not None:
                _START_LINE.cross(torch.cuda.current_stream())
            start.record()
            t0 = time.perf_counter()
            for _ in range(loop):
                fn()
            if host_times is not None:
                host_times.append((time.perf_counter() - t0) / loop)
            end.record()
            end.synchronize()
            if _START_LINE is not None:
                _START_LINE.check()
            samples.append(start.elapsed_time(end) / 1e3 / loop)
        else:
            if group is not None:
                dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(loop):
                fn()
            samples.append((time.perf_counter() - t0) / loop)
    return statistics.median(samples)


def slowest(seconds: float, group) -> float:
    on_gpu = "nccl" in str(dist.get_backend(group))   # an NCCL group reduces CUDA tensors only
    t = torch.tensor([seconds], dtype=torch.float64, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def host_seconds(fn: Callable[[], None], device: torch.device, group, calls: int = 50, samples: int = 5) -> float:
    """Host seconds per call of fn, alone: `calls` back-to-back calls timed with perf_counter (the GPU work
    they enqueue is not waited for), median of `samples`, slowest rank. An eager row minus this is the
    GPU's share of it."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize(device)
    return slowest(statistics.median(times), group)


def graph_of(fn: Callable[[], None], calls: int) -> Callable[[], None]:
    """A CUDA graph of `calls` back-to-back calls of fn (captured after one eager warm-up call);
    returns its replay. Timing the replay leaves the host out, as a captured decode step does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph.replay


def graph_seconds(fn: Callable[[], None], device: torch.device, cfg: argparse.Namespace, group) -> float:
    """Seconds per call of fn replayed from a CUDA graph of LL_LOOP calls (slowest rank's median)."""
    replay = graph_of(fn, LL_LOOP)
    dist.barrier(group=group)
    return slowest(timer(device, replay, cfg.warmup, cfg.iters, group), group) / LL_LOOP


def layout_parts(layout: Callable[[], None], device: torch.device, cfg: argparse.Namespace, group,
                 host_times: list, peer: Optional[str] = None) -> List[Tuple[str, float]]:
    """The layout's rows beside its eager one (CUDA), measured alike for us and a peer library: layout_graph (the
    op replayed from a CUDA graph: its kernels), layout_host (host time per call, calls back to back),
    layout_host1 (the host time of each timed eager call: `host_times`, filled by the eager row's timer) and
    layout_loop (LL_LOOP eager calls back to back per sample: bound by the longer of the host call and the GPU
    work, never by one exposed cold call as the eager row can be). A peer (`peer`: its name) whose layout cannot
    be captured gets no graph row; ours must capture."""
    rows = []
    try:
        rows.append(("layout_graph", graph_seconds(layout, device, cfg, group)))
    except Exception as e:   # noqa: BLE001 - every rank fails alike (same library, same call)
        if peer is None:
            raise
        torch.cuda.synchronize()
        if dist.get_rank(group) == 0:
            print(f"{peer}'s get_dispatch_layout could not be replayed from a CUDA graph: {e}")
    rows.append(("layout_host", host_seconds(layout, device, group)))
    rows.append(("layout_host1", slowest(statistics.median(host_times), group)))
    rows.append(("layout_loop", slowest(timer(device, layout, cfg.warmup, cfg.iters, group, loop=LL_LOOP), group)))
    return rows


def print_graph_trace(engine, fn: Callable[[], None], what: str, group, rank: int, tokens: int) -> None:
    """Rank 0 prints where one replay of a CUDA graph of LL_LOOP calls spends its time, from the
    kernels' own timestamps (events cannot be placed inside the replay)."""
    replay = graph_of(fn, LL_LOOP)
    replay()   # the first replay uploads the graph: the timed replays follow warm-up ones
    torch.cuda.synchronize()
    engine.trace_reset()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    if _START_LINE is not None:   # as timer() starts a timed sample
        _START_LINE.cross(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    torch.cuda.synchronize()
    if _START_LINE is not None:
        _START_LINE.check()
    timed_ns = int(start.elapsed_time(end) * 1e6)
    report = engine.trace_report()
    if rank == 0:
        print(f"[graph trace rank 0, {what}, {tokens} tokens, median of {LL_LOOP} calls] "
              + ", ".join(f"{k} {v:.1f} us" for k, v in report.items()), flush=True)
    # Every rank's replay on one clock (globaltimer is per GPU: only the ranks on rank 0's GPU are shown):
    # when its first kernel started and its last ended, against the moment the start line opened. The timed
    # replay runs from the start line to the slowest rank's end, so a late start shows what the call span misses.
    calls = engine.trace_call_spans()
    released = _START_LINE.released_ns() if _START_LINE is not None else 0
    gpu = device_uuid(torch.cuda.current_device())
    mine = (calls[0][0], calls[0][1], calls[-1][1], timed_ns, released, gpu) if calls else (0, 0, 0, timed_ns, 0, gpu)
    spans = [None] * dist.get_world_size(group)
    dist.all_gather_object(spans, mine, group=group)
    spans = [(r, *s[:5]) for r, s in enumerate(spans) if s[5] == gpu]   # one clock: the ranks on rank 0's GPU
    if rank == 0 and all(s[1] > 0 for s in spans):
        t0 = released or min(s[1] for s in spans)
        print(f"[graph replay per rank, {what}: first call start / its end / last end, us after "
              f"{'the start line opened' if released else 'the first start'}; event-timed replay; own release] "
              + ", ".join(f"{r}: {(b - t0) / 1e3:.1f} / {(f - t0) / 1e3:.1f} / {(e - t0) / 1e3:.1f}; {ev / 1e3:.1f}; "
                          f"{(rel - t0) / 1e3:.1f}" for r, b, f, e, ev, rel in spans), flush=True)


PICK_TOLERANCE = 0.10   # an SM budget within 10 % of the best time is as good as the best (bench --num-sms sweep)


def best_budget(times: Dict[int, float]) -> int:
    """The SM budget of the smallest time (times: budget -> seconds); a tie goes to the fewer SMs."""
    if not times:
        raise ValueError("no timings to choose from")
    return min(times, key=lambda sms: (times[sms], sms))


def pick_budget(times: Dict[int, float], tolerance: float = PICK_TOLERANCE) -> int:
    """The fewest SMs whose time is within `tolerance` of the best time (SMs left to compute cost more than
    the last few percent of a communication op)."""
    limit = times[best_budget(times)] * (1 + tolerance)
    return min(sms for sms, t in times.items() if t <= limit)


def measured_model_inputs(rows: list) -> Optional[Tuple[float, float, str]]:
    """This run's inputs to get_theoretical_num_sms from one op's sweep rows (bench.Row; sms: its blocks, None
    off SMs): (link GB/s, per-SM GB/s, how the per-SM rate was found); None without a row on SMs.

    The link rate is the sweep's fastest ceiling: the op's own bytes moved ideally (the same-run ceiling) with the
    most blocks, what the links (or, ranks sharing a GPU, its memory) give a rank while every rank moves its
    bytes. The per-SM rate is the op's bytes B over the time one more block saves, between the two fewest
    block counts a and b: t = fixed + B / (blocks x rate), so rate = B (1/a - 1/b) / (t_a - t_b), and the fixed
    part (host path, count exchange, launches) cancels out, as tools/model.py fits it. A time that does not fall
    from a to b blocks means the SMs are not the bound there: an unbounded rate. With one block count: the op's
    rate over its blocks, a lower bound (its time holds the fixed part)."""
    mine = sorted((r for r in rows if r.sms is not None), key=lambda r: (r.sms, r.time_us))
    if not mine:
        return None
    by_blocks: dict = {}
    for r in mine:
        by_blocks.setdefault(r.sms, r)   # budgets capped to the same blocks: the fastest stands for them
    link = max(r.ceiling_gbps for r in mine)
    counts = sorted(by_blocks)
    first = by_blocks[counts[0]]
    if len(counts) == 1:
        return link, first.gbps / first.sms, (f"{first.gbps:.1f} GB/s over {first.sms} blocks, a lower bound "
                                              f"(one block count swept)")
    second = by_blocks[counts[1]]
    saved = (first.time_us - second.time_us) * 1e-6
    if saved <= 0:
        return link, math.inf, f"unbounded: not faster with {second.sms} blocks than with {first.sms}"
    nbytes = first.gbps * first.time_us * 1e3
    rate = nbytes * (1 / first.sms - 1 / second.sms) / saved / 1e9
    return link, rate, f"fit between {first.sms} and {second.sms} blocks"
