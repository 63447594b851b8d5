"""The text of this backend's own kernel error code (errors.cuh kErrorNic), for errors.from_record: the
registry row's error_text."""
from __future__ import annotations

from typing import Optional


def describe(name: str, op: str, rank: int, peer: int, channel: int, detail: int) -> Optional[str]:
    """A failed queue pair (detail: the error completion's syndrome, -1 = no completion in time), else None."""
    if name != "nic":
        return None
    why = "no completion within the timeout (queue full or stuck)" if detail < 0 else \
        f"an error completion, syndrome {detail:#x}"
    return f"{op} on rank {rank}: the RDMA queue pair to peer {peer} (channel {channel}) failed: {why}"
