"""The intranode combine's eager path: the common call with the fewest host steps before its first kernel.

Why: ranks reach a layer's combine together (after their experts), and every rank's pull waits for the stage of the
rank whose host launched it last, so the host steps before the stage launch are part of the op's time. On the H200
(8 ranks under MPS, 16 SMs, host marks in each timed call of `bench`) the full path took 88-116 us from entering
Buffer.combine to the stage launch's return: the launch itself 11-19 us, the rest Python (the Buffer's checks 26-35,
the stream ordering 12-20, the engine's set-up about 40; docs/PERFORMANCE.md). The same steps
cost about a tenth of that in a tight loop: the first call after a barrier pays for every object and bytecode it
touches, so the way to a shorter path is fewer of them, not faster ones. This path: 47-54 us (predicate 12-14,
stream ordering about 10, the launch 11-15). On that emulation the op gained less (1808-1817 -> 1799-1800 us): the
stages of the other seven ranks keep HBM busy while a late one starts. Where each rank has its own GPU, the late
stage delays every pull directly.

Taken when Buffer.combine's cheap predicate (_validate.combine_eager) holds: nothing to overlap (no previous event,
no async finish), no bias, x a contiguous BF16 tensor outside this Buffer's send area. Whatever this path does not
handle (a zero-copy round opened, a kernel error to report, a shape whose capacity is exceeded, the profiler on)
returns None, and the caller takes the full path (IntranodeEngine.combine), which checks, raises and profiles. Both
launch the same kernels with the same parameters on the same stream, ordered the same way as Buffer._op orders the
full path.
"""
from __future__ import annotations

import sys

import struct
from typing import NamedTuple, Optional, Tuple

import torch

from ..failures import after_launch
from .. import _validate as check
from ..jit import forced_arch
from .launch import current_stream_handle, stream_wait_stream

# CombineParams' per-call words, contiguous in the struct from `x` to `num_tokens`:
# x, topk_weights, x_rows, rank_prefix_matrix, send_rows, bias_0, bias_1, out, out_topk_weights, num_tokens.
_CALL_WORDS = struct.Struct("<10q")
_CALL_FIELDS = ("x", "topk_weights", "x_rows", "rank_prefix_matrix", "send_rows", "bias_0", "bias_1", "out",
                "out_topk_weights", "num_tokens")


class EagerCombinePlan(NamedTuple):
    stage: object            # _C.Function
    pull: object
    head: bytes              # the params template before `x`
    tail: bytes              # ... and after `num_tokens`
    grid: int
    room: int                # tokens per rank this Buffer holds for this shape (the full path raises above it)


def call_words_span(params_cls) -> Tuple[int, int]:
    """[begin, end) byte offsets of the per-call words in the params struct; they must be contiguous, in order."""
    offsets = [getattr(params_cls, f).offset for f in _CALL_FIELDS]
    if offsets != list(range(offsets[0], offsets[0] + 8 * len(offsets), 8)):
        raise AssertionError(f"{params_cls.__name__}: fields {_CALL_FIELDS} are not contiguous 64-bit words")
    return offsets[0], offsets[-1] + 8


class EagerCombine:
    """Mixin of IntranodeEngine (which provides _plan, _combine_plan, _combine_outputs, grid, profile, and the
    zero-copy rounds' _opened and _send_area)."""

    def _init_eager(self, params_cls, threads: int) -> None:
        self._eager_plans: dict = {}
        self.eager_combines = 0   # combines that took this path (tests look)
        self._eager_span = call_words_span(params_cls)
        self._eager_threads = threads
        self._comm = int(self.ctx.comm_stream.cuda_stream)

    def _eager_plan(self, key: tuple) -> EagerCombinePlan:
        hidden, topk, num_sms, _ = key
        (stage, pull), template = self._plan(("combine", hidden, topk), lambda: self._combine_plan(hidden, topk))
        raw, (begin, end) = bytes(template), self._eager_span
        layout = check.combine_layout(self.num_ranks, hidden, topk)
        plan = EagerCombinePlan(stage, pull, raw[:begin], raw[end:], self.grid(num_sms),
                                check.room(layout, self.ctx.num_nvl_bytes))
        self._eager_plans[key] = plan
        return plan

    def combine_eager(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor],
                      num_sms: int) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(out, out_topk_weights) of a combine whose arguments passed _validate.combine_eager, or None: take the
        full path. Same kernels, parameters and stream ordering as the full path (Buffer._op + combine)."""
        if self._opened is not None or self.broken is not None or self.errors.words[0] != 0 or self.profile.enabled:
            return None
        rows, hidden = x.shape
        topk = 0 if topk_weights is None else topk_weights.size(1)
        key = (hidden, topk, self.grid(num_sms), forced_arch())   # the grid: it shrinks while other Buffers are open
        plan = self._eager_plans.get(key) or self._eager_plan(key)
        lo = x.data_ptr()
        lo_area, hi_area = self._send_area   # the zero-copy rounds' (it covers the combine's rows and weights)
        if handle.num_tokens > plan.room or (lo < hi_area and lo + 2 * rows * hidden > lo_area):
            return None   # the full path raises (capacity), or reads x in place or refuses it (in the send area)
        dev, comm, threads = self.dev, self._comm, self._eager_threads
        current = current_stream_handle(dev)
        stream_wait_stream(dev, comm, current)
        weights = 0 if topk_weights is None else topk_weights.data_ptr()
        prefix, send_rows = handle.rank_prefix_matrix.data_ptr(), handle.send_rows.data_ptr()
        # The stage reads none of the outputs: they are allocated while it runs (out, out_topk_weights, num_tokens 0).
        stage_params = plan.head + _CALL_WORDS.pack(lo, weights, rows, prefix, send_rows, 0, 0, 0, 0, 0) + plan.tail
        plan.stage.launch(plan.grid, threads, 0, comm, stage_params)
        try:
            out, out_w = self._combine_outputs(handle.num_tokens, hidden, topk, self.ctx.device)
        except BaseException:
            # As the full path: a pull of no tokens still announces READY and gives the peers DONE.
            plan.pull.launch(plan.grid, threads, 0, comm, stage_params)
            raise after_launch(sys.exc_info()[1])
        plan.pull.launch(plan.grid, threads, 0, comm,
                         plan.head + _CALL_WORDS.pack(lo, weights, rows, prefix, send_rows, 0, 0, out.data_ptr(),
                                                      0 if out_w is None else out_w.data_ptr(), handle.num_tokens)
                         + plan.tail)
        stream_wait_stream(dev, current, comm)
        self.eager_combines += 1
        return out, out_w
