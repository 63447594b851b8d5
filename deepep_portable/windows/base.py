"""What every window gives the engines besides its memory: the grid cap for ranks sharing a GPU and
the error record its kernels write (CUDA IPC in windows/ipc.py, NVSHMEM in transports/nvshmem)."""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

from ..device import sm_count

ERROR_WORDS = 8   # [code, op, rank, peer, channel, detail, -, -] (ErrorSink's host record)


class MappedWords:
    """Pinned host int32 words the GPU writes and the host polls."""

    def __init__(self, device: int, words: int) -> None:
        from .. import _C

        self._device = device
        self.host, self.dev = _C.host_alloc_mapped(device, words * 4)
        self.words = (ctypes.c_int * words).from_address(self.host)
        for i in range(words):
            self.words[i] = 0

    def free(self) -> None:
        from .. import _C

        if self.host:
            _C.host_free(self._device, self.host)
            self.host = 0


class Window:
    """Base of every window. A subclass sets `dev`, `base`, `peer_bases`, `errors` (MappedWords of
    ERROR_WORDS) and calls _cap_blocks once it knows which ranks share its GPU."""

    dev: int
    max_blocks: int
    errors: MappedWords

    def _cap_blocks(self, my_uuid: str, peer_uuids) -> None:
        # Spinning blocks of every rank must be resident at once: ranks that share a GPU split its SMs.
        sharing = sum(1 for u in peer_uuids if u == my_uuid)
        self.max_blocks = max(1, sm_count(self.dev) // sharing)

    def grid(self, num_sms: int) -> int:
        """Blocks per kernel: the caller's SM budget, capped so that every rank sharing this GPU fits
        at once (a block that cannot become resident would leave its peers spinning)."""
        return max(1, min(int(num_sms), self.max_blocks))

    def recorded_error(self) -> Optional[Tuple[int, int, int, int, int, int]]:
        """(code, op, rank, peer, channel, detail) of the first error a kernel recorded, or None."""
        w = self.errors.words
        if w[0] == 0:
            return None
        return w[0], w[1], w[2], w[3], w[4], w[5]
