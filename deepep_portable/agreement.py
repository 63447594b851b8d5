"""How the ranks of a Buffer agree on the fate of one call, within a deadline.

An op involves every rank: when one rank cannot take part (a bad argument, a failed allocation), the
others must not wait for it forever, nor pair their call with its next one. `agree` is the exchange
that settles it: every rank sends every peer one status message and reads one from each, so each rank
learns what every other rank did with the call (ran it, or refused it and why). It never blocks past
its deadline; a rank whose peers did not all answer names them (PeersAbsentError).

Two rounds of point-to-point messages, the same on every rank:
  1. status: "call s of op: ok | refused: <reason>" to every peer, then wait for every peer's.
  2. verdict: "complete" once round 1 completed, or "gave up" when round 1 passed its deadline (then
     this rank raises at once and does not wait for round 2).
Round 2 is what a late rank needs: it finds its round 1 complete (the others' messages were waiting)
and would go on alone; their "gave up" tells it that nobody waits for it any more. A rank's messages
to a rank that gave up may stay unread: that Buffer is unusable afterwards on every rank, and says so.
Messages go through the Buffer's group (Comm.post_send / post_recv, polled: a timed wait would close
gloo's connection and the group with it), on tags of their own.
"""
from __future__ import annotations

import json
import time
from typing import Dict, List, Optional

from .comm import Comm, Posted
from .errors import CommError, PeersAbsentError

MESSAGE_BYTES = 4096
_REASON_CHARS = 600
_unfinished: List[Posted] = []   # messages to or from ranks that never answered: their buffers must outlive them


def _encode(fields: dict) -> bytes:
    raw = json.dumps(fields, ensure_ascii=False).encode()
    if len(raw) > MESSAGE_BYTES:
        raise ValueError("agreement message too long")
    return raw + b"\0" * (MESSAGE_BYTES - len(raw))


def _decode(raw: bytes) -> dict:
    return json.loads(raw.rstrip(b"\0").decode())


def _round(comm: Comm, fields: dict, tag: int, deadline: float) -> Dict[int, Optional[dict]]:
    """Send `fields` to every peer and read one message from each: {peer: its message, or None if none came by
    the deadline}. Receives are posted before the sends, so a peer's message means it has posted its receive of
    ours (our send to it then completes). What stays unfinished (a peer that never answered) is kept alive. A
    peer whose connection failed (a dead process) counts as one that never answered."""
    peers = [p for p in range(comm.size) if p != comm.rank]
    dead = set()
    recvs, sends = {}, {}
    for p in peers:
        try:
            recvs[p] = comm.post_recv(p, MESSAGE_BYTES, tag)
        except Exception:   # noqa: BLE001 - the connection to it is gone
            dead.add(p)
    data = _encode(fields)
    for p in peers:
        if p not in dead:
            try:
                sends[p] = comm.post_send(p, data, tag)
            except Exception:   # noqa: BLE001
                dead.add(p)

    def arrived(p: int) -> bool:
        if p in dead:
            return False
        try:
            return recvs[p].done()
        except Exception:   # noqa: BLE001
            dead.add(p)
            return False

    while True:
        waiting = [p for p in peers if not arrived(p)]
        if not waiting or all(p in dead for p in waiting) or time.monotonic() > deadline:
            break
        time.sleep(0.0002)
    for p in peers:
        if p in waiting:
            _unfinished.extend(x for x in (recvs.get(p), sends.get(p)) if x is not None)
        else:
            try:
                sends[p].finish()
            except Exception:   # noqa: BLE001 - it answered, then its connection went: its message stands
                pass
    return {p: (None if p in waiting else _decode(recvs[p].data())) for p in peers}


def agree(comm: Comm, tag: int, status: dict, timeout_s: float, op: str, rank: int) -> Dict[int, dict]:
    """Collective over `comm`: every rank's `status` (a small JSON-able dict), as {rank: status}. Raises
    PeersAbsentError (naming them) when some rank did not take part within `timeout_s`, or gave up waiting
    for this one; `op` and `rank` are for the errors."""
    statuses: Dict[int, dict] = {comm.rank: dict(status)}
    if comm.size == 1:
        return statuses
    received = _round(comm, dict(kind="status", **status), tag, time.monotonic() + timeout_s)
    for peer, m in received.items():
        if m is not None:
            m.pop("kind", None)
            statuses[peer] = m
    absent = [peer for peer, m in received.items() if m is None]
    if absent:
        # Tell everyone (a late rank reads it as its verdict) and take their verdicts unread (so that their
        # sends to this rank complete); wait for nobody.
        data = _encode(dict(kind="verdict", gave_up=True))
        for p in range(comm.size):
            if p != comm.rank:
                try:
                    _unfinished.extend((comm.post_recv(p, MESSAGE_BYTES, tag), comm.post_send(p, data, tag)))
                except Exception:   # noqa: BLE001 - a dead peer: nothing to tell it
                    pass
        raise _absent(PeersAbsentError(op, rank, absent, timeout_s), statuses)
    verdicts = _round(comm, dict(kind="verdict", gave_up=False), tag, time.monotonic() + timeout_s)
    gave_up = [peer for peer, m in verdicts.items() if m is not None and m.get("gave_up")]
    late = [peer for peer, m in verdicts.items() if m is None]
    if gave_up:
        raise _absent(PeersAbsentError(op, rank, gave_up, timeout_s,
                                       f" (they gave up waiting for rank {rank}, which came later)"), statuses)
    if late:
        raise _absent(PeersAbsentError(op, rank, late, timeout_s, " (they sent their status but no verdict)"),
                      statuses)
    return statuses


def _absent(error: PeersAbsentError, statuses: Dict[int, dict]) -> PeersAbsentError:
    error.statuses = statuses
    return error


def short(reason: str) -> str:
    """A refusal's reason as it travels (messages have a fixed size)."""
    return reason if len(reason) <= _REASON_CHARS else reason[:_REASON_CHARS] + "..."


def arrive(comm: Comm, tag: int, op: str, call: int, refused: Optional[str], timeout_s: float) -> Dict[int, str]:
    """Collective at the start of call `call` of `op`: {rank: reason} of every rank that refused the call
    (this one included when `refused`); empty when every rank runs it. Raises PeersAbsentError as `agree`,
    and CommError when ranks are at different calls (out of step: they would exchange each other's data)."""
    status = dict(op=op, call=call, refused=None if refused is None else short(refused))
    statuses = agree(comm, tag, status, timeout_s, op, comm.rank)
    elsewhere = {peer: (m["op"], m["call"]) for peer, m in statuses.items() if (m["op"], m["call"]) != (op, call)}
    if elsewhere:
        detail = ", ".join(f"rank {p} at call {c} ({o})" for p, (o, c) in sorted(elsewhere.items()))
        raise CommError(f"{op} on rank {comm.rank}: ranks are out of step (this rank is at call {call}; {detail}): "
                        f"their calls would exchange each other's data; this Buffer cannot be used again, create a "
                        f"new one on every rank")
    return {peer: m["refused"] for peer, m in statuses.items() if m["refused"] is not None}
