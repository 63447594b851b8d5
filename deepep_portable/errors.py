"""What a kernel can report, and the exceptions the host raises for it.

Kernels report a failed wait (or another fault they detect) through an ErrorSink
(csrc/common/kernels/signal.cuh): the first report claims a word in device memory and writes a
record [code, op, rank, peer, channel, detail] into mapped host memory, which the engines poll. The
codes and op ids are one table, csrc/common/kernels/errors.cuh; `table()` reads it from there (the
kernel tree ships with the package), and `from_record` is the one decoder.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Callable, Dict, Optional, Tuple


class CommError(RuntimeError):
    """An op that did not complete on every rank: a peer failed, never came, or a wait ran out of time.
    `usable` says whether the Buffer works for the next op (every rank agrees on it)."""

    usable = False


class PeerFailedError(CommError):
    """Other ranks raised before launching the same call (a bad argument or a failed allocation there), so
    this rank's call did not run either. `failures` maps each such rank to its error message. Nothing was
    launched on any rank: the Buffer works for the next op."""

    usable = True

    def __init__(self, op: str, rank: int, failures: dict) -> None:
        who = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"{op} on rank {rank} did not run: other ranks rejected the same call before launching "
                         f"it ({who}); nothing was launched on any rank and the Buffer can be used again")
        self.op, self.rank, self.failures = op, rank, dict(failures)


class PeersAbsentError(CommError):
    """Some ranks did not reach the same call within the Buffer's timeout (dead, stuck, or in another call).
    The Buffer is unusable afterwards (messages to those ranks may still be in flight)."""

    def __init__(self, op: str, rank: int, absent, timeout_s: float, detail: str = "") -> None:
        ranks = ", ".join(str(r) for r in sorted(absent))
        super().__init__(f"{op} on rank {rank}: rank{'s' if len(absent) > 1 else ''} {ranks} did not reach the same "
                         f"call within {timeout_s:g} s{detail}; this Buffer cannot be used again, create a new one "
                         f"on every rank")
        self.op, self.rank, self.absent = op, rank, sorted(absent)
        self.statuses: dict = {}   # what the ranks that did take part said (agreement.agree)


class CommTimeoutError(CommError):
    """A wait for a peer ran past the Buffer's timeout. The Buffer is unusable afterwards."""

    def __init__(self, op: str, rank: int, peer: int, channel: int, timeout_s: float) -> None:
        if peer == rank:   # a wait on the rank's own grid (the LL dispatch's stage flags, a grid barrier)
            why = (f"waiting for its own blocks (block {channel}) after {timeout_s:g} s: not all blocks of the "
                   f"kernel could run at once (other kernels holding the SMs?)")
        else:
            why = (f"waiting for peer {peer} (channel {channel}) after {timeout_s:g} s: the peer did not reach "
                   f"the same call (or is stuck)")
        super().__init__(f"{op} timed out on rank {rank} {why}; this Buffer cannot be used again, create a new one")
        self.op, self.rank, self.peer, self.channel = op, rank, peer, channel


ERRORS_HEADER = "common/kernels/errors.cuh"


def _enum(text: str, name: str) -> Dict[str, int]:
    body = re.search(rf"enum {name} : int \{{(.*?)\}};", text, re.S)
    if body is None:
        raise RuntimeError(f"{ERRORS_HEADER}: enum {name} not found")
    return {k: int(v) for k, v in re.findall(r"^\s*(k\w+)\s*=\s*(\d+)\s*,", body.group(1), re.M)}


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


@functools.lru_cache(maxsize=None)
def table() -> Tuple[Dict[str, int], Dict[int, str]]:
    """(codes: {"timeout": 1, ...}, ops: {1: "dispatch", 3: "low_latency_dispatch", ...}) from errors.cuh."""
    from .jit import kernel_root

    with open(os.path.join(kernel_root(), ERRORS_HEADER)) as f:
        text = f.read()
    codes = {_snake(k[len("kError"):]): v for k, v in _enum(text, "ErrorCode").items()}
    ops = {v: _snake(k[len("kOp"):]) for k, v in _enum(text, "OpId").items()}
    return codes, ops


def from_record(record: Tuple[int, int, int, int, int, int], timeout_s: float,
                describe: Optional[Callable[..., Optional[str]]] = None) -> CommError:
    """The exception for a kernel's error record (code, op, rank, peer, channel, detail): a CommError, since
    the kernel stopped waiting for peers and the op did not complete on every rank. `describe` is the backend's
    decoder of the codes only it reports (the registry row's error_text: `describe(name, op, rank, peer,
    channel, detail)` -> the message without its ending, or None)."""
    code, op_id, rank, peer, channel, detail = record
    codes, ops = table()
    op = ops.get(op_id, f"op {op_id}")
    name = {v: k for k, v in codes.items()}.get(code)
    gone = "this Buffer cannot be used again"
    text = describe(name, op, rank, peer, channel, detail) if describe is not None and name is not None else None
    if text is not None:
        return CommError(f"{text}; {gone}")
    if name == "timeout":
        return CommTimeoutError(op, rank, peer, channel, timeout_s)
    if name == "capacity":
        if peer >= 0 and peer != rank:   # seen in the count matrix every rank holds (internode)
            return CommError(f"{op} on rank {rank}: rank {peer} would receive {detail} rows but its output "
                                f"holds fewer (num_worst_tokens too small, or a handle from other routing); {gone}")
        return CommError(f"{op} on rank {rank}: {detail} rows arrived but the output holds fewer "
                            f"(num_worst_tokens too small); {gone}")
    if name == "overrun" and peer < 0:
        what = "recv_x it returned" if op == "low_latency_dispatch" else "zero-copy combine buffer"
        return CommError(f"{op} on rank {rank}: the {what} belongs to the other buffer half than the one "
                            f"the device used (half {detail}): a CUDA graph with an odd number of "
                            f"low-latency calls? {gone}")
    if name == "overwrite":
        return CommError(f"{op} on rank {rank}: call {detail} found peer {peer} still receiving the previous "
                            f"call of the same kind in that buffer half (its data was being overwritten): a "
                            f"receive hook was called after the next-but-one low-latency op of the same kind; "
                            f"{gone}")
    if name == "overrun":
        return CommError(f"{op} on rank {rank}: peer {peer} is already at call {detail}, two calls ahead: "
                            f"a receive hook was called after the next-but-one low-latency op; {gone}")
    return CommError(f"{op} on rank {rank}: kernel error code {code} (peer {peer}, detail {detail})")
