"""The main job: a dispatch -> combine round trip across local ranks, checked, timed, with its ceiling.

Every measured op is printed beside the ceiling from the same run: one plain copy of exactly the
same bytes on the same device (a device-to-device copy on the GPU, a memcpy on the CPU). Logical
bandwidth follows DeepEP: payload bytes a rank sends (dispatch) or receives (combine), its own copy
included, over the op's time; the time reported is the slowest rank's median.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

import deepep_portable as deep_ep

from .launch import run_local


@dataclass
class Row:
    op: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    precision: str
    time_us: float
    gbps: float
    ceiling_us: float
    ceiling_gbps: float
    transport: str
    sms: int

    def cells(self) -> List[str]:
        ratio = self.ceiling_us / self.time_us if self.time_us > 0 else 0.0
        return [self.op, str(self.tokens), str(self.hidden), str(self.topk), str(self.experts), self.precision,
                f"{self.time_us:.1f}", f"{self.gbps:.2f}", f"{self.ceiling_gbps:.2f}", f"{100 * ratio:.1f}%",
                str(self.sms), self.transport]


HEADER = ["op", "tokens", "hidden", "topk", "experts", "prec", "time_us", "GB/s", "ceil_GB/s", "of_ceil",
          "SMs", "transport"]


def _print_host_profile(what: str, fn: Callable[[], None], device: torch.device, show: bool,
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


def _print_profile(engine, rank: int, tokens: int) -> None:
    """Rank 0 prints the engine's phase profile (DEEPEP_PORTABLE_PROFILE=1), if it kept one."""
    profile = getattr(engine, "profile", None)
    if profile is not None and profile.enabled:
        report = profile.report()
        if rank == 0:
            print(f"[profile rank 0, {tokens} tokens] " + ", ".join(f"{k} {v:.0f} us" for k, v in report), flush=True)


def _add_rows(rows: List[Row], buf, cfg: argparse.Namespace, tokens: int, measured) -> None:
    """One Row per (op, seconds, ceiling seconds, payload bytes, precision)."""
    for op, t, c, nbytes, prec in measured:
        rows.append(Row(op, tokens, cfg.hidden, cfg.topk, cfg.experts, prec, t * 1e6, nbytes / t / 1e9, c * 1e6,
                        nbytes / c / 1e9, buf.transport, _blocks(buf)))


LL_LOOP = 10   # low-latency ops are timed as back-to-back calls (see _timer)
_START_LINE = None   # the GPU start line of the Buffer being benchmarked (see _start_line)


@contextlib.contextmanager
def _start_line(buf: "deep_ep.Buffer", cfg: argparse.Namespace):
    """While a Buffer is benchmarked, _timer starts every sample at a GPU start line over its group
    (--start-line gpu and ranks on one node; otherwise the host barrier alone)."""
    global _START_LINE
    line = None
    if torch.cuda.is_available() and getattr(cfg, "start_line", "gpu") == "gpu" and buf._ctx.device.type == "cuda":
        from ._kernels import StartLine

        try:
            line = StartLine(buf._ctx)
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


def _timer(device: torch.device, fn: Callable[[], None], warmup: int, iters: int, group=None,
           loop: int = 1) -> float:
    """Median seconds of fn (events on CUDA; perf_counter on the CPU).

    With `group`, every timed sample starts after a barrier, and on the GPU (with --start-line gpu, the
    default) after the start line (`_START_LINE`): a one-thread kernel that returns on every rank's
    stream once all ranks' streams reached it, so the start events of all ranks mark the same moment.
    A collective op's time then excludes the skew with which the ranks would otherwise start (a rank
    that starts early counts its wait for the others; the host barrier alone leaves the processes'
    exit skew, tens of microseconds with 8 ranks, in every sample). The ceiling is timed the same way.
    With `loop` > 1 a sample is `loop` back-to-back calls, divided by `loop` (low-latency ops: the
    steady-state time of a call, as consecutive layers issue them; the barrier's exit skew is then
    paid once per sample instead of once per call)."""
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
            for _ in range(loop):
                fn()
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


def _slowest(seconds: float, group) -> float:
    on_gpu = "nccl" in str(dist.get_backend(group))   # an NCCL group reduces CUDA tensors only
    t = torch.tensor([seconds], dtype=torch.float64, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _blocks(buf: "deep_ep.Buffer") -> int:
    """Blocks the communication kernels really use (the engine caps them when ranks share a GPU)."""
    engine = getattr(buf._backend, "engine", None)
    return engine._grid(deep_ep.Buffer.num_sms) if engine is not None else deep_ep.Buffer.num_sms


def _graph_of(fn: Callable[[], None], calls: int) -> Callable[[], None]:
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


def _graph_seconds(fn: Callable[[], None], device: torch.device, cfg: argparse.Namespace, group) -> float:
    """Seconds per call of fn replayed from a CUDA graph of LL_LOOP calls (slowest rank's median)."""
    replay = _graph_of(fn, LL_LOOP)
    dist.barrier(group=group)
    return _slowest(_timer(device, replay, cfg.warmup, cfg.iters, group), group) / LL_LOOP


def _print_graph_trace(engine, fn: Callable[[], None], what: str, group, rank: int, tokens: int) -> None:
    """Rank 0 prints where one replay of a CUDA graph of LL_LOOP calls spends its time, from the
    kernels' own timestamps (events cannot be placed inside the replay)."""
    replay = _graph_of(fn, LL_LOOP)
    torch.cuda.synchronize()
    engine.trace_reset()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    replay()
    torch.cuda.synchronize()
    report = engine.trace_report()
    if rank == 0:
        print(f"[graph trace rank 0, {what}, {tokens} tokens, median of {LL_LOOP} calls] "
              + ", ".join(f"{k} {v:.1f} us" for k, v in report.items()), flush=True)


def _ceiling_seconds(copy: Callable[[], None], device: torch.device, cfg: argparse.Namespace, group,
                     loop: int, graph: bool) -> float:
    """Seconds per call of a ceiling copy, timed as the op beside it is (graph-replayed or eager)."""
    if graph and device.type == "cuda":
        return _graph_seconds(copy, device, cfg, group)
    dist.barrier(group=group)
    return _slowest(_timer(device, copy, cfg.warmup, cfg.iters, group, loop), group)


def _copy_ceiling(num_bytes: int, device: torch.device, cfg: argparse.Namespace, group, blocks: int,
                  loop: int = 1, graph: bool = False) -> float:
    """Seconds for one plain copy of num_bytes on this device, every rank copying at once; on the
    GPU with the same block budget as the communication kernels (`graph`: replayed from a CUDA
    graph of LL_LOOP copies, like the graph-timed ops)."""
    num_bytes = max(16, (num_bytes + 15) // 16 * 16)
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from ._kernels import copy_with_blocks

        def copy():
            copy_with_blocks(dst, src, blocks, torch.cuda.current_stream())
    else:
        def copy():
            dst.copy_(src)
    return _ceiling_seconds(copy, device, cfg, group, loop, graph)


def _nccl_all_to_all(rank: int, world: int, group, per_rank_rows: List[int], recv_rows: List[int],
                     row_bytes: int, device: torch.device, cfg: argparse.Namespace, loop: int = 1) -> Optional[float]:
    """Seconds for torch.distributed.all_to_all_single of the same rows over NCCL (what a user
    would pick without this library), or None when NCCL cannot serve this group (ranks sharing a GPU,
    or a non-NCCL group)."""
    if device.type != "cuda" or "nccl" not in str(dist.get_backend(group)):
        return None
    send_counts = [r * row_bytes for r in per_rank_rows]
    recv_counts = [r * row_bytes for r in recv_rows]
    send = torch.randint(0, 255, (max(1, sum(send_counts)),), dtype=torch.uint8, device=device)[:sum(send_counts)]
    recv = torch.empty(sum(recv_counts), dtype=torch.uint8, device=device)

    def a2a():
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)

    dist.barrier(group=group)
    return _slowest(_timer(device, a2a, cfg.warmup, cfg.iters, group, loop), group)


def pattern_segments(matrix: List[List[int]], rank: int, forward: bool, row_bytes: int):
    """The pattern ceiling's copy plan for `rank`: (window bytes every rank allocates, offset of my
    segment in each destination's window, bytes of each segment). matrix[s][d] = rows rank s sends
    rank d in the dispatch direction; combine (forward=False) sends them back. Rows are rounded up to
    16 bytes (the copy moves int4s); sources land in rank order in each window, as an op's receive
    layout would, so the segments of all ranks tile each window without overlap."""
    world = len(matrix)
    row = (row_bytes + 15) // 16 * 16

    def sent(a: int, b: int) -> int:   # bytes rank a writes to rank b
        return (matrix[a][b] if forward else matrix[b][a]) * row

    window_bytes = max(16, max(sum(sent(a, r) for a in range(world)) for r in range(world)))
    offsets = [sum(sent(a, d) for a in range(rank)) for d in range(world)]
    return window_bytes, offsets, [sent(rank, d) for d in range(world)]


def _pattern_ceiling(buf: "deep_ep.Buffer", matrix: List[List[int]], forward: bool, row_bytes: int,
                     device: torch.device, cfg: argparse.Namespace, group, blocks: int, loop: int = 1,
                     graph: bool = False) -> float:
    """Seconds for the ideal copy of an op's traffic between ranks on different GPUs: in one launch
    with the op's block budget, every rank writes exactly the bytes the op sends each rank straight
    into that rank's memory (mapped over CUDA IPC, so over NVLink between GPUs); see pattern_segments."""
    from ._kernels import SegmentCopy
    from .ipc import IpcWindow

    rank, world = buf._ctx.rank, len(matrix)
    window_bytes, offsets, nbytes = pattern_segments(matrix, rank, forward, row_bytes)
    window = IpcWindow(buf._ctx, window_bytes, 0, "ceiling window")
    try:
        # Rank r writes to r+1, r+2, ... first (its own segment last): in step with the other ranks'
        # orders, every destination takes one writer at a time instead of all ranks writing into rank
        # 0 together, then into rank 1, and so on.
        order = [(rank + 1 + i) % world for i in range(world)]
        dst = [window.bases[d] + offsets[d] for d in order]
        nbytes = [nbytes[d] for d in order]
        src = torch.randint(0, 255, (max(16, sum(nbytes)),), dtype=torch.uint8, device=device)
        copy = SegmentCopy(src, dst, nbytes)

        return _ceiling_seconds(lambda: copy(blocks, torch.cuda.current_stream()), device, cfg, group, loop, graph)
    finally:
        torch.cuda.synchronize()
        window.close()   # collective: no peer writes into it any more


def _ceiling(buf: "deep_ep.Buffer", matrix: List[List[int]], forward: bool, row_bytes: int, num_bytes: int,
             device: torch.device, cfg: argparse.Namespace, group, loop: int = 1, graph: bool = False) -> float:
    """The op's ceiling: its traffic pattern copied over the links when the ranks span GPUs, else one
    plain copy of the same bytes on the device (ranks sharing one GPU: every byte lands in its HBM
    either way)."""
    if getattr(cfg, "peer_ceiling", False):
        return _pattern_ceiling(buf, matrix, forward, row_bytes, device, cfg, group, _blocks(buf), loop, graph)
    return _copy_ceiling(num_bytes, device, cfg, group, _blocks(buf), loop, graph)


def _add_baseline_rows(rows: List[Row], cfg: argparse.Namespace, tokens: int, matrix: List[List[int]], rank: int,
                       group, device: torch.device, ops, loop: int = 1) -> None:
    """The same rows moved by all_to_all_single over NCCL, beside the op's ceilings. ops: (name,
    dispatch direction?, row bytes, payload bytes, ceiling seconds, precision)."""
    world = len(matrix)
    send_rows = list(matrix[rank])
    recv_rows = [matrix[s][rank] for s in range(world)]
    for name, forward, row_bytes, nbytes, ceiling, prec in ops:
        t = _nccl_all_to_all(rank, world, group, send_rows if forward else recv_rows,
                             recv_rows if forward else send_rows, row_bytes, device, cfg, loop)
        if t is None:
            if rank == 0:
                print("baseline skipped: all_to_all_single over NCCL needs one GPU per rank and an NCCL group",
                      flush=True)
            return
        rows.append(Row(name, tokens, cfg.hidden, cfg.topk, cfg.experts, prec, t * 1e6, nbytes / t / 1e9,
                        ceiling * 1e6, nbytes / ceiling / 1e9, "nccl a2a", 0))


def _random_topk(num_tokens: int, num_experts: int, topk: int, device: torch.device, gen: torch.Generator):
    scores = torch.rand(num_tokens, num_experts, generator=gen).to(device)
    idx = torch.topk(scores, topk, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)
    # Some tokens drop an expert (-1), as real routers with capacity limits do.
    drop = torch.rand(num_tokens, topk, generator=gen).to(device) < 0.05
    return idx.masked_fill(drop, -1).contiguous()


def _dispatch_row_bytes(hidden: int, fp8: bool) -> int:
    """Payload bytes of one dispatched row: FP8 data and its float32 scale per 128 channels, or BF16."""
    return hidden + hidden // 128 * 4 if fp8 else hidden * 2


def _fp8_cast(x: torch.Tensor):
    h = x.size(1)
    xv = x.float().view(x.size(0), h // 128, 128)
    scales = (xv.abs().amax(-1).clamp(min=1e-4) / 448.0)
    data = (xv / scales.unsqueeze(-1)).view(x.size(0), h).to(torch.float8_e4m3fn)
    return data, scales.contiguous()


def bench_normal(rank: int, world: int, group, cfg: argparse.Namespace, tokens: int, rows: List[Row]) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(1000 * rank + tokens)
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.experts
    nvl_bytes = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, world, tokens)
    buf = deep_ep.Buffer(group, nvl_bytes, 0, transport=cfg.transport)
    with _start_line(buf, cfg):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
        topk_idx = _random_topk(tokens, experts, topk, device, gen)
        topk_weights = torch.rand(tokens, topk, generator=gen).to(device)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
        x_in = _fp8_cast(x) if cfg.fp8 else x

        def dispatch():
            return buf.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

        recv_x, recv_idx, recv_w, counts, handle, _ = dispatch()
        # Check: the rows received are what every source sent here; the round trip sums each token
        # once per destination rank (identity experts), exactly.
        all_per_rank = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(all_per_rank, per_rank, group=group)
        expected_rows = int(sum(int(t[rank]) for t in all_per_rank))
        got_rows = (recv_x[0] if cfg.fp8 else recv_x).size(0)
        if got_rows != expected_rows:
            raise AssertionError(f"rank {rank}: received {got_rows} rows, expected {expected_rows}")
        combine_in = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) \
            if cfg.fp8 else recv_x
        combined, _, _ = buf.combine(combine_in, handle)
        ref_src = (x_in[0].float() * x_in[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) if cfg.fp8 else x
        expected = (ref_src.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
        if not torch.equal(combined, expected):
            bad = (combined != expected).any(1).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"rank {rank}: combine differs from the oracle at tokens {bad}")

        sent_rows = int(in_rank.sum())
        row_bytes = _dispatch_row_bytes(hidden, cfg.fp8)
        dispatch_bytes = sent_rows * row_bytes
        combine_bytes = sent_rows * hidden * 2
        t_dispatch = _slowest(_timer(device, dispatch, cfg.warmup, cfg.iters, group), group)
        if os.environ.get("DEEPEP_PORTABLE_PROFILE_HOST") == "1":   # every rank calls (a collective op)
            _print_host_profile(f"dispatch, {tokens} tokens", dispatch, device, rank == 0)
        t_combine = _slowest(_timer(device, lambda: buf.combine(combine_in, handle), cfg.warmup, cfg.iters, group),
                             group)
        matrix = [[int(v) for v in t.tolist()] for t in all_per_rank]
        c_dispatch = _ceiling(buf, matrix, True, row_bytes, dispatch_bytes, device, cfg, group)
        c_combine = _ceiling(buf, matrix, False, hidden * 2, combine_bytes, device, cfg, group)
        _print_profile(getattr(buf._backend, "engine", None), rank, tokens)
        prec = "fp8" if cfg.fp8 else "bf16"
        _add_rows(rows, buf, cfg, tokens, (("dispatch", t_dispatch, c_dispatch, dispatch_bytes, prec),
                                           ("combine", t_combine, c_combine, combine_bytes, "bf16")))
        if cfg.baseline:
            _add_baseline_rows(rows, cfg, tokens, matrix, rank, group, device,
                               (("a2a_dispatch", True, row_bytes, dispatch_bytes, c_dispatch, prec),
                                ("a2a_combine", False, hidden * 2, combine_bytes, c_combine, "bf16")))


def bench_low_latency(rank: int, world: int, group, cfg: argparse.Namespace, tokens: int, rows: List[Row]) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(2000 * rank + tokens)
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.experts
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, experts)
    buf = deep_ep.Buffer(group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=max(1, experts // world),
                         transport=cfg.transport)
    with _start_line(buf, cfg):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
        topk_idx = _random_topk(tokens, experts, topk, device, gen)
        topk_weights = torch.rand(tokens, topk, generator=gen).to(device)

        def dispatch():
            return buf.low_latency_dispatch(x, topk_idx, tokens, experts, use_fp8=cfg.fp8)

        recv_x, recv_count, handle, _, _ = dispatch()
        # Identity experts in BF16: combine returns sum_k w_k * x exactly as the oracle computes it.
        recv_bf16 = recv_x.clone() if not cfg.fp8 else None   # recv_x is a view the next dispatches rewrite
        if recv_bf16 is None:
            data, scales = recv_x
            recv_bf16 = (data.float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)
            # The reference cast runs on the CPU: on CUDA, torch divides by the Python scalar 448 as a
            # multiplication by its reciprocal, which is off by one ulp of the scale now and then (seen
            # on the H200: one FP8 step of difference, x4 through the top-k weights).
            src = _fp8_cast(x.cpu())
            ref_x = (src[0].float() * src[1].repeat_interleave(128, dim=1)).to(torch.bfloat16).to(device)
        else:
            ref_x = x
        def combine():
            return buf.low_latency_combine(recv_bf16, topk_idx, topk_weights, handle)

        combined, _, _ = combine()
        w = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
        expected = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        for k in range(topk):
            expected += w[:, k:k + 1] * ref_x.float()
        err = (combined.float() - expected).abs().max().item() if tokens else 0.0
        scale = expected.abs().max().item() if tokens else 1.0
        if err > 1e-2 * max(scale, 1e-6):
            raise AssertionError(f"rank {rank}: low-latency combine differs from the oracle (max abs err {err})")

        pairs = int((topk_idx >= 0).sum())
        d_row = _dispatch_row_bytes(hidden, cfg.fp8)
        dispatch_bytes = pairs * d_row
        combine_bytes = pairs * hidden * 2
        loop = LL_LOOP if device.type == "cuda" else 1
        t_dispatch = _slowest(_timer(device, dispatch, cfg.warmup, cfg.iters, group, loop), group)
        t_combine = _slowest(_timer(device, combine, cfg.warmup, cfg.iters, group, loop), group)
        # matrix[s][d]: (token, expert) pairs rank s sends rank d (LL sends a token once per expert).
        experts_per_rank = experts // world
        per_rank = torch.bincount((topk_idx[topk_idx >= 0] // experts_per_rank).flatten(), minlength=world)
        per_rank = per_rank.to(torch.int64)
        gathered = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(gathered, per_rank, group=group)
        matrix = [[int(v) for v in t.tolist()] for t in gathered]
        c_dispatch = _ceiling(buf, matrix, True, d_row, dispatch_bytes, device, cfg, group, loop)
        c_combine = _ceiling(buf, matrix, False, hidden * 2, combine_bytes, device, cfg, group, loop)
        if os.environ.get("DEEPEP_PORTABLE_PROFILE_HOST") == "1":   # every rank calls (collective ops)
            _print_host_profile(f"low_latency_dispatch, {tokens} tokens", dispatch, device, rank == 0)
            _print_host_profile(f"low_latency_combine, {tokens} tokens", combine, device, rank == 0)
        _print_profile(getattr(buf._backend, "ll_engine", None), rank, tokens)
        prec = "fp8" if cfg.fp8 else "bf16"
        _add_rows(rows, buf, cfg, tokens, (("ll_dispatch", t_dispatch, c_dispatch, dispatch_bytes, prec),
                                           ("ll_combine", t_combine, c_combine, combine_bytes, "bf16")))
        if device.type == "cuda":
            # The same calls replayed from CUDA graphs (how decode steps run them): GPU time without the
            # Python host path, which the eager rows above include whenever the GPU waits for the host.
            g_dispatch = _graph_seconds(dispatch, device, cfg, group)
            g_combine = _graph_seconds(combine, device, cfg, group)
            gc_dispatch = _ceiling(buf, matrix, True, d_row, dispatch_bytes, device, cfg, group, graph=True)
            gc_combine = _ceiling(buf, matrix, False, hidden * 2, combine_bytes, device, cfg, group, graph=True)
            _add_rows(rows, buf, cfg, tokens, (("ll_dispatch_graph", g_dispatch, gc_dispatch, dispatch_bytes, prec),
                                               ("ll_combine_graph", g_combine, gc_combine, combine_bytes, "bf16")))
            engine = getattr(buf._backend, "ll_engine", None)
            if getattr(engine, "trace", None) is not None:   # DEEPEP_PORTABLE_PROFILE=1
                for what, fn in (("low_latency_dispatch", dispatch), ("low_latency_combine", combine)):
                    _print_graph_trace(engine, fn, what, group, rank, tokens)
        if cfg.baseline:
            _add_baseline_rows(rows, cfg, tokens, matrix, rank, group, device,
                               (("a2a_dispatch", True, d_row, dispatch_bytes, c_dispatch, prec),
                                ("a2a_combine", False, hidden * 2, combine_bytes, c_combine, "bf16")), loop)


def _worker(rank: int, world: int, group, cfg: argparse.Namespace) -> None:
    if not torch.cuda.is_available():   # ranks share the cores: no oversubscribed thread pools
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.num_sms is not None:   # spawned ranks import the module afresh: set it here, not in the parent
        deep_ep.Buffer.set_num_sms(cfg.num_sms)
    cfg.peer_ceiling = torch.cuda.is_available() and (
        cfg.ceiling == "pattern" or (cfg.ceiling == "auto" and _ranks_span_gpus(group)))
    rows: List[Row] = []
    sweep = cfg.tokens
    progress = sweep
    if rank == 0 and not cfg.no_progress:
        try:
            from tqdm import tqdm

            progress = tqdm(sweep, desc=f"bench {cfg.mode} x{world}", file=sys.stderr)
        except ImportError:
            pass
    for tokens in progress:
        (bench_normal if cfg.mode == "normal" else bench_low_latency)(rank, world, group, cfg, tokens, rows)
    if rank == 0:
        print_table(rows, world, cfg.peer_ceiling)
        if cfg.plot:
            plot(rows, cfg.plot, world)


def _ranks_span_gpus(group) -> bool:
    """True when the ranks are on more than one GPU of one node (then the ceiling copies over the
    links; across nodes the pattern copy cannot map the peers' memory, so the plain copy stays)."""
    if not torch.cuda.is_available():
        return False
    from .comm import node_identity
    from .ipc import device_uuid

    where = [None] * dist.get_world_size(group)
    dist.all_gather_object(where, (node_identity(), device_uuid(torch.cuda.current_device())), group=group)
    return len({host for host, _ in where}) == 1 and len({uuid for _, uuid in where}) > 1


def print_table(rows: List[Row], world: int, peer_ceiling: bool = False) -> None:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    what = ("the op's traffic pattern copied straight into the peers' memory (over the GPU links), "
            if peer_ceiling else "one plain copy of the same bytes on the same device, ")
    print(f"\n{world} ranks on {dev}; ceiling = {what}same run"
          + (", with the same number of blocks (SMs column)" if torch.cuda.is_available() else ""))
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    sys.stdout.flush()


def plot(rows: List[Row], path: str, world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for op in sorted({r.op for r in rows}):
        pts = [r for r in rows if r.op == op]
        ax.plot([r.tokens for r in pts], [r.gbps for r in pts], marker="o", label=f"{op} ({pts[0].transport})")
        ax.plot([r.tokens for r in pts], [r.ceiling_gbps for r in pts], linestyle="--", label=f"{op} ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("logical GB/s per rank")
    ax.set_title(f"deepep_portable bench, {world} ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--mode", choices=["normal", "low_latency"], default="normal")
    p.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank, several values make a sweep (default: GPU 512 4096, CPU 64 256)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 dispatch (default: on for normal mode and low-latency)")
    p.add_argument("--transport", default="auto")
    p.add_argument("--num-sms", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--baseline", action="store_true",
                   help="also time torch.distributed.all_to_all_single over NCCL for the same rows (one GPU per rank)")
    p.add_argument("--ceiling", choices=["auto", "copy", "pattern"], default="auto",
                   help="copy: one plain copy of the op's bytes on the device; pattern (GPU): the op's "
                        "rank-to-rank traffic copied into the peers' memory; auto: pattern when the ranks "
                        "span GPUs, else copy")
    p.add_argument("--start-line", choices=["gpu", "host"], default="gpu",
                   help="where a timed sample starts on every rank: gpu (default): after a barrier, at a "
                        "one-thread kernel that all ranks' streams leave together; host: after the barrier "
                        "only (the processes' exit skew then counts in the op's time)")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--no-progress", action="store_true")


def main(cfg: argparse.Namespace) -> int:
    if cfg.tokens is None:
        cfg.tokens = ([128] if cfg.mode == "low_latency" else [512, 4096]) if torch.cuda.is_available() \
            else ([32, 128] if cfg.mode == "low_latency" else [64, 256])
    if cfg.fp8 is None:
        cfg.fp8 = True
    run_local(_worker, cfg.ranks, cfg)
    return 0
