"""Zero-copy inputs of the intranode engine (engines/intranode.py): an op's rows written in place by the caller.

`Buffer.get_next_dispatch_buffer` / `get_next_combine_buffer` (deepep_portable/buffer.py) open the
next round ahead of its op with the round's prologue alone (open_round.cu) and hand out a view of this rank's
send area; the op then finds x there (`_reads_in_place`) and stages only what is not in place. A mixin of
IntranodeEngine, which owns the state these read: the window, the plans, the profile, the comm stream.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from .. import errors, jit
from .. import layout as L
from ..handles import DispatchHandle
from .launch import current_stream_handle, launch, params_struct, stream_handle, stream_idle, stream_wait_stream

THREADS = 512   # __launch_bounds__ of the intranode kernels (the opener's one block, the ops' blocks)
MAX_AREA_VIEWS = 4   # (op, shape)s whose view of the rows is kept between calls
# Words of the control area every intranode kernel takes, in ControlLayout's order (protocol.cuh).
CONTROL = ["round", "current", "ready", "error", "num_tokens", "done", "count_to", "expert_count", "counted",
           "token_ticket", "pull_arrive"]
OPEN_ROUND_SOURCE = "common/kernels/intranode/open_round.cu"
# The next round's prologue alone, launched ahead of an op whose input the caller writes in place (one block).
OPEN_ROUND_KERNEL = jit.kernel_symbol("deepep_portable::intranode::open_round", "OpenRoundParams")
OpenRoundParams = params_struct("OpenRoundParams", [
    "peer_bases", "rank", "num_ranks", *[f"ctrl_{f}" for f in CONTROL], "op", "error_claim", "error_host",
    "timeout_ns"])


class ZeroCopyRounds:
    def _init_zero_copy(self) -> None:
        # (op, address, rows, hidden, dtype) of the rows get_next_dispatch_buffer / get_next_combine_buffer opened
        # for the next op; any op closes them (an op reads x in place only from rows opened for it, after the
        # round's prologue).
        self._opened: Optional[tuple] = None
        self.in_place_dispatches = 0   # dispatches / combines that read x in place (tests and tools look)
        self.in_place_combines = 0
        self._window_bytes: Optional[torch.Tensor] = None   # uint8 view of the whole window (the rows' views)
        self._area_views: dict = {}   # (offset, rows, hidden, dtype) -> the view _open_rows returned for it
        self._rows_room: dict = {}   # (op, hidden, dtype or top-k) -> rows a zero-copy op's area holds (_room)
        # My send area, from the rows on: a dispatch's x overlapping it is read in place or refused (_dispatch).
        self._send_area = (self.base + L.ROWS_OFFSET, self.base + self.window.size)
        self._open_marks: Optional[list] = None   # profiling: the event before the last opener (see _phases)

    def next_dispatch_buffer(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_tokens, hidden] view of my send area's dispatch rows for a zero-copy dispatch
        (Buffer.get_next_dispatch_buffer). The rows must fit beside the meta slots of a top-k up to the size
        hints' (HINT_TOPK) and, for FP8, one scale per 128 channels; a dispatch whose shape leaves no room is
        refused before its launch (its capacity check), as any refused dispatch: the rows are closed."""
        self.check()
        most = self._dispatch_rows_room(hidden, dtype)
        if num_tokens > most:
            raise ValueError(f"get_next_dispatch_buffer: {num_tokens} tokens x hidden {hidden} ({dtype}) need more "
                             f"than this Buffer's num_nvl_bytes={self.ctx.num_nvl_bytes} holds at top-k up to "
                             f"{L.HINT_TOPK} ({most} tokens)")
        return self._open_rows("dispatch", L.NormalLayout.dispatch_rows_offset(), num_tokens, hidden, dtype)

    def next_combine_buffer(self, handle: DispatchHandle, hidden: int) -> torch.Tensor:
        """[num_recv_rows, hidden] bf16 view of my send area for a zero-copy combine (Buffer.get_next_combine_buffer).
        The rows must fit beside the weights of a top-k up to the size hints' (HINT_TOPK): a Buffer sized by a
        hint for the dispatch takes its zero-copy combine too. A combine whose wider top-k leaves no room is refused
        before its launch (combine), as any refused combine: the area is closed, open it again to retry."""
        self.check()
        rows = handle.num_recv_rows
        most = self._combine_rows_room(hidden, L.HINT_TOPK)
        if rows > most:
            raise ValueError(f"get_next_combine_buffer: {rows} rows x hidden {hidden} need more than this Buffer's "
                             f"num_nvl_bytes={self.ctx.num_nvl_bytes} holds at top-k up to {L.HINT_TOPK} ({most} rows)")
        return self._open_rows("combine", L.NormalLayout.combine_rows_offset(), rows, hidden, torch.bfloat16)

    def _open_rows(self, op: str, offset: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Opens the next round for `op` and returns the [rows, hidden] view of my window at `offset` that the op
        will read in place. The round's prologue (open_round) goes on the caller's stream: the caller's later
        work (its writes into the rows) follows it with no event, and once it has run no peer reads my send area.
        It must also follow my last op on the comm stream (it reads the round that op completed): the caller's
        stream waits for the comm stream only while that still has work (a query is one driver call, an event
        record and a wait are two, ~10 us each under MPS). While capturing a CUDA graph it goes on the comm
        stream between two waits instead. It waits until every peer has
        finished reading my last op (peers tell so at the end of their pull), not for the peers' next op."""
        t_host = time.perf_counter()
        # The template is launched as it is (only the op's id differs between calls): every step here is on the
        # op's critical path when the GPU waits for the host (parsing errors.cuh for the id took tens of us).
        opener, p = self._plan(("open_round", op), lambda: self._open_round_plan(op))
        comm, current = stream_handle(self.ctx.comm_stream), current_stream_handle(self.dev)
        if self.profile.enabled:
            self._open_marks = self.profile.start(torch.cuda.current_stream(self.dev))
        if torch.cuda.is_current_stream_capturing():
            # No query in a capture, and a capturing stream may not wait on an event recorded outside it: the comm
            # stream joins the capture first (it waits on the caller's), runs the opener, and the caller waits on it.
            stream_wait_stream(self.dev, comm, current)
            launch(opener, 1, THREADS, p, comm)
            stream_wait_stream(self.dev, current, comm)
        else:
            if not stream_idle(self.dev, comm):
                stream_wait_stream(self.dev, current, comm)
            launch(opener, 1, THREADS, p, current)
        self._opened = (op, self.base + offset, rows, hidden, dtype)
        area = self._area_views.pop((offset, rows, hidden, dtype), None)
        if area is None:   # three torch view ops, ~15 us under MPS: kept per shape
            if self._window_bytes is None:   # made once: wrapping device memory in a tensor costs tens of us
                self._window_bytes = self.window.view(0, self.window.size, self.ctx.device)
            nbytes = rows * hidden * dtype.itemsize
            area = self._window_bytes[offset:offset + nbytes].view(dtype).view(rows, hidden)
        self._area_views[(offset, rows, hidden, dtype)] = area
        while len(self._area_views) > MAX_AREA_VIEWS:   # shapes that vary call to call: keep the newest
            del self._area_views[next(iter(self._area_views))]
        self.profile.host_time(f"open_rows:{op}", t_host)
        return area

    def _phases(self, in_place: bool, comm) -> Tuple[Optional[list], tuple]:
        """The profile's first marks of an op (DEEPEP_PORTABLE_PROFILE=1) and its phase names: a zero-copy op
        starts at its opener's launch, so its first phase ("open") spans the opener's barrier and the host's
        way to the stage launch."""
        marks = self.profile.start(comm)
        opened, self._open_marks = self._open_marks, None
        if marks is None or not in_place or opened is None:
            return marks, ("stage", "pull")
        return opened + marks, ("open", "stage", "pull")

    @staticmethod
    def _reads_in_place(op: str, x: torch.Tensor, opened: Optional[tuple], area: Tuple[int, int]) -> bool:
        """Whether `op` reads x where it is: x is the rows last opened for this op (and no op ran since). Any other
        x overlapping my send area `area` [lo, hi) (rows not opened since the last op: peers may still read them)
        would be copied onto itself mid-read or race with them: refused."""
        lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
        if x.numel() > 0 and opened == (op, lo, x.size(0), x.size(1), x.dtype):
            return True
        if x.numel() > 0 and lo < area[1] and area[0] < hi:
            raise ValueError(f"x overlaps this Buffer's {op} area: pass the tensor get_next_{op}_buffer() returned "
                             f"for this {op} (call it again before each {op} that reads it), or a tensor outside "
                             "the Buffer")
        return False

    def _room(self, key: tuple, compute) -> int:
        """compute() (rows an area holds for one shape) once per key: layout arithmetic on the op's host path,
        which is the op's critical path when the GPU waits for the host."""
        room = self._rows_room.get(key)
        if room is None:
            room = self._rows_room[key] = compute()
        return room

    def _dispatch_rows_room(self, hidden: int, dtype: torch.dtype) -> int:
        """Tokens a zero-copy dispatch's rows hold beside the meta slots of a top-k up to the hints' (HINT_TOPK)."""
        def compute() -> int:
            elem = dtype.itemsize
            return self._capacity(L.NormalLayout(self.num_ranks, hidden, elem, hidden // 128 if elem == 1 else 0,
                                                 L.HINT_TOPK))
        return self._room(("dispatch", hidden, dtype), compute)

    def _combine_rows_room(self, hidden: int, topk: int) -> int:
        """Rows the combine area holds before the weights of a top-k `topk` start."""
        def compute() -> int:
            lay = L.NormalLayout(self.num_ranks, hidden, 2, 0, topk)
            return lay.combine_rows(self._capacity(lay))
        return self._room(("combine", hidden, topk), compute)

    def _open_round_plan(self, op: str):
        p = OpenRoundParams()
        self._common(p)
        p.num_ranks = self.num_ranks
        p.op = next(i for i, name in errors.table()[1].items() if name == op)   # kOpDispatch... (errors.cuh)
        return self._kernel(OPEN_ROUND_SOURCE, OPEN_ROUND_KERNEL, {}), p


jit.register_family("intranode_open_round", OPEN_ROUND_SOURCE, [OPEN_ROUND_KERNEL], variants=[{}])
