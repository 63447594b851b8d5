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
