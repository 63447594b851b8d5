"""The text of this backend's own kernel error code (errors.cuh kErrorUnsupported, reported by
csrc/backends/nccl_gin/device.cuh fail()), for errors.from_record: the registry row's error_text."""
from __future__ import annotations

from typing import Optional

# detail -> why (device.cuh's fail() reasons)
UNSUPPORTED = {1: "the SET-signal shadow table is full (more distinct signal words per peer than it holds)",
               2: "GIN needs NCCL >= 2.29.7 (VA signals); this build's headers are older",
               3: "get_value over GIN needs NCCL >= 2.30.3",
               4: "fetch_add over GIN (GIN has no fetching atomic)"}


def describe(name: str, op: str, rank: int, peer: int, channel: int, detail: int) -> Optional[str]:
    """A call this NCCL cannot make for a GIN peer, else None."""
    if name != "unsupported":
        return None
    why = UNSUPPORTED.get(detail, f"reason {detail}")
    return f"{op} on rank {rank}: the nccl_gin transport cannot reach peer {peer} for it: {why}"
