"""`EventOverlap`: DeepEP-compatible handle on a CUDA event for compute/communication overlap."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class EventOverlap:
    """Wraps the CUDA event recorded after an asynchronous op.

    `current_stream_wait()` makes the current stream wait for it; used as a context manager
    (`with event: ...`) the body runs overlapped and the current stream waits on exit.
    `extra_tensors` keeps tensors alive until the event has been waited on (mirrors DeepEP).
    On the CPU (reference transport without CUDA) every op is complete on return and the event is None.
    """

    def __init__(self, event: Optional[torch.cuda.Event] = None,
                 extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.event is not None:
            self.current_stream_wait()
