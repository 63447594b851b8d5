"""What one rank's failed op does to the others (the guarantees are listed in docs/RELIABILITY.md).

An op involves every rank, so a rank that cannot take part must not leave its peers waiting forever, nor let
them pair their call with its next one (ranks out of step would exchange each other's data). Every collective
op of Buffer runs under `collective_op`, which applies one rule on every transport:

- a Buffer that an earlier failure left unusable refuses at once, naming that failure;
- `ctx.calls` counts the op on every rank (the same number on every rank for the same call);
- an exception raised before this rank launched any of the op is a refusal: `backend.refuse` tells the peers
  (an exception raised after the rank's part ran, so that no peer waits for it, carries `after_launch`);
- a CommError (a kernel stopped waiting for a peer, a peer never came): `backend.failed` gives the error to
  raise, naming the peer's own failure when there was one; unless it is `usable`, the Buffer refuses every
  later op.

How a backend tells its peers depends on how its ops meet: the reference transport's ops begin with an
exchange on the host anyway (transports/reference.py: a refusing rank takes part in it and says why, so every
rank ends the same call together and the Buffer stays usable). Kernel transports exchange nothing on the host
on the way to a launch (CUDA graphs, latency): `KernelFailures` below settles a failure afterwards.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict

from .agreement import agree, short
from .contract import BufferContext
from .errors import CommError, CommTimeoutError, PeersAbsentError

# How much longer than its timeout a refusing rank of a kernel transport waits for its peers to report: their
# kernels give up after timeout_s, and their host learns it at its next call into the Buffer (or synchronize()).
REFUSAL_GRACE_S = 15.0
# How long a rank whose kernel gave up waiting for a peer waits to hear the others (at most timeout_s).
AGREEMENT_WAIT_S = 10.0


def after_launch(exc: BaseException) -> BaseException:
    """Mark `exc` as raised after this rank's part of the op was launched in full (no peer waits for this rank:
    e.g. the combine's output allocation failed and an empty pull still served the peers)."""
    exc.after_launch = True
    return exc


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def collective_op(op: str) -> Callable:
    """Decorator of Buffer's collective ops (see the module docstring). Reads the Buffer's `_ctx`, `_backend`
    and `_failed` (the reason it is unusable, or None)."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if self._failed is not None:
                raise CommError(f"{op} on rank {self._ctx.rank} refused: {self._failed}")
            self._ctx.calls += 1
            call = self._ctx.calls
            try:
                return method(self, *args, **kwargs)
            except CommError as e:
                backend = self._backend
                err = backend.failed(op, call, e) if backend is not None else e
                if not getattr(err, "usable", False):
                    self._failed = f"an earlier op failed and left this Buffer unusable ({err})"
                if err is e:
                    raise
                raise err from e
            except Exception as e:
                if not getattr(e, "after_launch", False):
                    _refuse(self, op, call, e)
                raise
        return run
    return wrap


def _refuse(buffer, op: str, call: int, error: Exception) -> None:
    """Tell `buffer`'s peers that this rank refused call `call` of `op` (backend.refuse); when that leaves the Buffer
    unusable, remember why and say so on `error`."""
    backend = buffer._backend
    if backend is None:
        return
    try:
        backend.refuse(op, call, f"{type(error).__name__}: {error}")
    except CommError as c:
        buffer._failed = f"an earlier op failed and left this Buffer unusable ({c})"
        add_note(error, f"deepep_portable: {c}")


def refused_before(op: str, runtime_of: Callable) -> Callable:
    """Decorator of a method built on a Buffer's collective ops (ElasticBuffer's dispatch and combine): an exception
    it raises before the first of them (its own checks) is refused as that op (`op`: the name of its first collective
    op), as if the Buffer itself had refused it, so the peers hear of it. `runtime_of(self)` is the Buffer."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            buffer = runtime_of(self)
            before = None if buffer is None else buffer._ctx.calls
            try:
                return method(self, *args, **kwargs)
            except CommError:
                raise
            except Exception as e:
                if before is not None and buffer._ctx.calls == before and buffer._failed is None \
                        and not getattr(e, "after_launch", False):
                    buffer._ctx.calls += 1
                    _refuse(buffer, op, buffer._ctx.calls, e)
                raise
        return run
    return wrap


class KernelFailures:
    """`refuse` and `failed` for backends whose ops run kernels.

    Nothing is exchanged on the host before a launch. A refusing rank's peers launch the call and their kernels
    stop waiting for it after timeout_s, recording a timeout that names it. Each rank involved then meets the
    others once in `agree` (their Buffer's group, a tag of its own), where the refusal's reason travels:
    - every rank refused the same call: nobody launched it, the Buffer works on (each raises its own error);
    - some rank ran it: the refusing rank raises its own error, the others a CommError naming the refusal;
      the Buffer is unusable on every rank (their kernels gave up in the middle of a round);
    - a kernel timed out with no refusal behind it (a dead or stuck rank): the error names the peer, and the
      others' errors where they reported in time."""

    def __init__(self, ctx: BufferContext) -> None:
        self.ctx = ctx

    def _agree(self, op: str, call: int, refused, error, timeout_s: float) -> Dict[int, dict]:
        status = dict(op=op, call=call, refused=refused, error=error)
        return agree(self.ctx.comm, self.ctx.tag + 1, status, timeout_s, op, self.ctx.rank)

    def refuse(self, op: str, call: int, reason: str) -> None:
        if self.ctx.num_ranks == 1:
            return
        statuses = self._agree(op, call, short(reason), None, self.ctx.timeout_s + REFUSAL_GRACE_S)
        ran = sorted(r for r, s in statuses.items() if s["refused"] is None or (s["op"], s["call"]) != (op, call))
        if ran:
            raise CommError(f"{op} on rank {self.ctx.rank}: rank{'s' if len(ran) > 1 else ''} "
                            f"{', '.join(map(str, ran))} launched the call this rank refused, and stopped waiting "
                            f"for it; this Buffer cannot be used again, create a new one on every rank")

    def failed(self, op: str, call: int, error: Exception) -> Exception:
        # Only a wait for a peer involves the others; a rank's own record (capacity, a stuck NIC queue) is its own.
        if not isinstance(error, CommTimeoutError) or error.peer < 0 or error.peer == error.rank \
                or self.ctx.num_ranks == 1:
            return error
        # A peer that refused the call is waiting in the agreement already, and the others' kernels gave up at
        # about the same time as this rank's: a short wait hears them; a dead rank is named by the error anyway.
        try:
            statuses = self._agree(op, call, None, short(str(error)), min(self.ctx.timeout_s, AGREEMENT_WAIT_S))
            absent = ""
        except PeersAbsentError as e:
            statuses, absent = e.statuses, f" ({e})"
        causes = {r: s for r, s in statuses.items() if s.get("refused")}
        if causes:
            why = "; ".join(f"rank {r} refused {s['op']} (its call {s['call']}) before launching it: {s['refused']}"
                            for r, s in sorted(causes.items()))
            return _with_message(error, f"{error} Cause: {why}.{absent}")
        return _with_message(error, f"{error}{absent}") if absent else error


def _with_message(error: Exception, message: str) -> Exception:
    """`error` (its type and attributes kept: callers catch CommTimeoutError and read .peer) with `message`."""
    out = type(error).__new__(type(error))   # no __init__: exceptions with their own constructor arguments too
    out.__dict__.update(error.__dict__)
    out.args = (message,)
    return out
