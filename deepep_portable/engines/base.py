"""What every engine shares: the Buffer's context, its window, and the kernel error it turned into an
exception (after which the engine refuses every op: a kernel that timed out left peers in an unknown
state)."""
from __future__ import annotations

import time
from typing import Optional

from .. import errors
from ..contract import BufferContext
from ..errors import CommError, CommTimeoutError


class Engine:
    ctx: BufferContext
    broken: Optional[str] = None

    def check(self) -> None:
        """Raise what a kernel reported (errors.from_record), or what made this engine unusable before."""
        if self.broken is not None:
            raise CommError(self.broken)
        window = getattr(self, "window", None)
        if window is None or window.base is None:
            return
        record = window.recorded_error()
        if record is not None:
            err = errors.from_record(record, self.ctx.timeout_s, getattr(self.ctx, "describe_error", None))
            self.broken = str(err)
            raise err

    def destroy(self) -> None:
        """Collective: close the window (every rank), then free the mapped count words the host polls."""
        if self.base is None:
            return
        try:
            self.window.close()
        finally:
            self.notify.free()
            self.base = None

    def wait_for_count(self, op: str, notify) -> int:
        """Spin (GIL held, no sleep: this is the latency-critical path) until a kernel published the receive
        count in the mapped words `notify` ([0] = ready, [1] = count), a kernel reported an error (raised),
        or the timeout passed (CommTimeoutError; the engine is unusable after)."""
        deadline = time.monotonic() + self.ctx.timeout_s + 5.0
        w = notify.words
        while w[0] == 0:
            if self.window.errors.words[0] != 0:
                self.check()
            if time.monotonic() > deadline:
                self.broken = (f"{op} timed out on rank {self.ctx.rank}: the GPU did not report the receive count "
                               f"within {self.ctx.timeout_s:g} s (kernel never ran?)")
                raise CommTimeoutError(op, self.ctx.rank, -1, -1, self.ctx.timeout_s)
        self.check()
        return w[1]
