"""What every engine shares: the Buffer's context, its window, and the kernel error it turned into an
exception (after which the engine refuses every op: a kernel that timed out left peers in an unknown
state)."""
from __future__ import annotations

from typing import Optional

from .. import errors
from ..contract import BufferContext


class Engine:
    ctx: BufferContext
    broken: Optional[str] = None

    def check(self) -> None:
        """Raise what a kernel reported (errors.from_record), or what made this engine unusable before."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        window = getattr(self, "window", None)
        if window is None or window.base is None:
            return
        record = window.recorded_error()
        if record is not None:
            err = errors.from_record(record, self.ctx.timeout_s)
            self.broken = str(err)
            raise err
