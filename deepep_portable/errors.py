"""What a kernel can report, and the exceptions the host raises for it.

Kernels report a failed wait (or another fault they detect) through an ErrorSink
(csrc/common/kernels/signal.cuh): the first report claims a word in device memory and writes a
record [code, op, rank, peer, channel, detail] into mapped host memory, which the engines poll.
"""
from __future__ import annotations


class CommTimeoutError(RuntimeError):
    """A wait for a peer ran past the Buffer's timeout. The Buffer is unusable afterwards."""

    def __init__(self, op: str, rank: int, peer: int, channel: int, timeout_s: float) -> None:
        if peer == rank:   # a barrier over the rank's own grid (the LL dispatch's stage barrier)
            why = (f"waiting for its own blocks (block {channel}) after {timeout_s:g} s: not all blocks of the "
                   f"kernel could run at once (other kernels holding the SMs?)")
        else:
            why = (f"waiting for peer {peer} (channel {channel}) after {timeout_s:g} s: the peer did not reach "
                   f"the same call (or is stuck)")
        super().__init__(f"{op} timed out on rank {rank} {why}; this Buffer cannot be used again, create a new one")
        self.op, self.rank, self.peer, self.channel = op, rank, peer, channel
