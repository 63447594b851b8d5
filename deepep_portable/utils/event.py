"""DeepEP V2's event types: `EventHandle` and V2's `EventOverlap`.

`EventHandle()` records an event on the current stream when it is created (V2's `buffer.capture()`
returns one). V2's `EventOverlap` is our V1 `EventOverlap` (deepep_portable/event.py) plus what V2 added:
a hook run once after the wait (`register_hook_after_wait`) and `release_handle`, which drops the event
after the wait (`event.current_stream_wait(release_handle=True)`, or `with event(release_handle=True):`).
Both work without CUDA: there every op is complete when it returns, the handle holds no event and
waiting is a no-op.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from ..event import EventOverlap as _V1EventOverlap


class EventHandle:
    """A CUDA event recorded on the current stream at creation (None without CUDA)."""

    def __init__(self) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    @classmethod
    def wrapping(cls, event: Optional[torch.cuda.Event]) -> "EventHandle":
        """A handle on an event recorded elsewhere (None: an op that is already complete)."""
        handle = cls.__new__(cls)
        handle.event = event
        return handle

    def current_stream_wait(self) -> None:
        """The current stream waits for the event (later work only; the CPU does not block)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """`stream` waits for the event: what `torch.cuda.Stream.wait_event(handle)` calls, so a handle can
        stand where a `torch.cuda.Event` is expected (V1's Buffer does so with `previous_event`)."""
        if self.event is not None:
            self.event.wait(stream)

    def query(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap(_V1EventOverlap):
    """V1's EventOverlap (a subclass: V1 code that checks the type accepts it) with V2's additions.

    `event` may be an EventHandle (what ElasticBuffer returns) or a `torch.cuda.Event` (V1's)."""

    def __init__(self, event: Any = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        super().__init__(event, extra_tensors)
        self.hook_after_wait: Optional[Callable[[], Any]] = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if isinstance(self.event, EventHandle):
            self.event.current_stream_wait()
        else:
            super().current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:   # the event (and what it keeps alive) can go once the stream waited on it
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run `hook_after_wait` once, on the next `current_stream_wait` (e.g. work on the results that must
        run on the caller's stream after the op)."""
        if self.hook_after_wait is not None:
            raise RuntimeError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """`with event(release_handle=True): ...`: the same object, releasing the event on exit."""
        self._release_on_exit = release_handle
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        self.current_stream_wait(release_handle=release)
