"""Optional phase profiling of the engines (DEEPEP_PORTABLE_PROFILE=1; off by default: events cost time).

An op records CUDA timing events between its phases on the stream it runs on, and the host times
the stretches it chooses; `report()` gives the median of each over the profiled ops (what
`bench` prints). Nothing is recorded while a CUDA graph is being captured (such events could not be
read back later).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch


class PhaseProfile:
    def __init__(self, device: int) -> None:
        self.enabled = os.environ.get("DEEPEP_PORTABLE_PROFILE", "0") == "1"
        self.device = device
        self._ops: List[Tuple[str, Sequence[str], list]] = []
        self._host_us: Dict[str, List[float]] = {}

    def start(self, stream) -> Optional[list]:
        """The marks of a new op, its first event recorded on `stream`; None when not profiling."""
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            return None
        marks: list = []
        self.mark(marks, stream)
        return marks

    @staticmethod
    def mark(marks: Optional[list], stream) -> None:
        if marks is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            marks.append(e)

    def finish(self, op: str, phases: Sequence[str], marks: Optional[list]) -> None:
        """Keep an op's marks: phase i lies between marks i and i+1."""
        if marks is not None:
            self._ops.append((op, tuple(phases), marks))

    def host_time(self, key: str, t0: float) -> None:
        """Host microseconds since t0 (time.perf_counter) under `key`."""
        if self.enabled:
            self._host_us.setdefault(key, []).append((time.perf_counter() - t0) * 1e6)

    def report(self) -> List[Tuple[str, float]]:
        """Median microseconds per phase and per host stretch: [(op:phase, us), ..., (key (host), us)]."""
        torch.cuda.synchronize(self.device)
        phases: Dict[str, List[float]] = {}
        for op, names, marks in self._ops:
            for name, a, b in zip(names, marks, marks[1:]):
                phases.setdefault(f"{op}:{name}", []).append(a.elapsed_time(b) * 1e3)
        out = [(k, statistics.median(v)) for k, v in phases.items()]
        out += [(f"{k} (host)", statistics.median(v)) for k, v in self._host_us.items()]
        return out


def _phases_done(call: List[List[int]], kernels: Sequence[str]) -> List[Tuple[str, int, int]]:
    """(name, first block start, last block end) of every kernel entry a traced call slot holds."""
    return [(name, s, e) for name, (s, e) in zip(kernels, call) if s != -1 and e != 0]


def kernel_call_spans(calls: List[List[List[int]]], kernels: Sequence[str], phases: int) -> List[Tuple[int, int]]:
    """(first start, last end), ns, of each traced call over its first `phases` entries, in start order."""
    spans = []
    for call in calls:
        done = [d for d in _phases_done(call, kernels) if kernels.index(d[0]) < phases]
        if done:
            spans.append((done[0][1], done[-1][2]))
    return sorted(spans)


def kernel_trace_report(calls: List[List[List[int]]], kernels: Sequence[str], phases: int) -> dict:
    """Median microseconds over the traced calls of a kernel trace (the LL kernels' globaltimer stamps:
    calls[i][k] = [first block start, last block end] of phase k of call slot i, ns; -1 / 0 when unused):
    each phase's span, the gaps between consecutive phases of a call ('a>b': from a's end to b's start;
    negative: b started before a ended, e.g. a receive waiting), 'call' (first start to last end) and
    'period' (from one call's first start to the next call's: the steady-state time per call on this rank,
    which excludes the start skew between ranks that a timed replay pays). Entries past the first `phases`
    are spreads over blocks (their span only); for the dispatch also offsets from its first block start:
    '+last block start', '+first staged', '+last staged' (the blocks' arrivals at the stage barrier)."""
    spans: Dict[str, List[float]] = {}
    for call in calls:
        done = _phases_done(call, kernels)
        for name, s, e in done:
            spans.setdefault(name, []).append((e - s) / 1e3)
        named = {name: (s, e) for name, s, e in done}
        if "dispatch_stage" in named and "dispatch_staged" in named and "dispatch_blocks" in named:
            s0 = named["dispatch_stage"][0]
            for key, t in (("last block start", named["dispatch_blocks"][1]),
                           ("first staged", named["dispatch_staged"][0]), ("last staged", named["dispatch_staged"][1])):
                spans.setdefault(f"+{key}", []).append((t - s0) / 1e3)
        done = [d for d in done if kernels.index(d[0]) < phases]
        for (a, _, ea), (b, sb, _) in zip(done, done[1:]):
            spans.setdefault(f"{a}>{b}", []).append((sb - ea) / 1e3)
    whole = kernel_call_spans(calls, kernels, phases)
    if whole:
        spans["call"] = [(e - s) / 1e3 for s, e in whole]
    if len(whole) > 1:
        spans["period"] = [(b[0] - a[0]) / 1e3 for a, b in zip(whole, whole[1:])]
    return {k: statistics.median(v) for k, v in spans.items()}
