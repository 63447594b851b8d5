"""`deep_ep.utils` of DeepEP V2 as callers import it: `from deep_ep.utils import EventHandle, EventOverlap`."""
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
