"""One CUDA-IPC-shared window per rank, mapped by every peer: what the intranode and the
low-latency engines of the `nvlink` transport both stand on.

`IpcWindow` allocates the window, zeroes its control part, exchanges IPC handles over the
Buffer's group, checks that the group can share memory (one node, the same size everywhere),
maps every peer, and owns the mapped host words through which kernels report errors
(see csrc/common/kernels/signal.cuh: ErrorSink).
"""
from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Tuple

import torch

from ._kernels import sm_count
from .comm import node_identity
from .transports.base import BufferContext

ERROR_WORDS = 8   # [code, op, rank, peer, channel, detail, -, -] (ErrorSink's host record)


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


class MappedWords:
    """Pinned host int32 words the GPU writes and the host polls."""

    def __init__(self, device: int, words: int) -> None:
        from . import _C

        self._device = device
        self.host, self.dev = _C.host_alloc_mapped(device, words * 4)
        self.words = (ctypes.c_int * words).from_address(self.host)
        for i in range(words):
            self.words[i] = 0

    def free(self) -> None:
        from . import _C

        if self.host:
            _C.host_free(self._device, self.host)
            self.host = 0


def device_uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _synchronize(device: int) -> None:
    torch.cuda.synchronize(device)


class Window:
    """What every window (CUDA IPC here, NVSHMEM in nvshmem_window.py) gives the engines besides its
    memory: the grid cap for ranks sharing a GPU and the error record its kernels write."""

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


class IpcWindow(Window):
    def __init__(self, ctx: BufferContext, nbytes: int, zero_bytes: int, size_name: str) -> None:
        """Collective over ctx.comm. `size_name` names the Buffer argument in errors."""
        from . import _C

        self.ctx = ctx
        self.dev = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
        self.base = _C.mem_alloc(self.dev, nbytes)
        _C.memset_d8_async(self.dev, self.base, 0, zero_bytes, 0)
        _C.stream_synchronize(self.dev, 0)
        me = dict(host=node_identity(), pid=os.getpid(), nbytes=nbytes, uuid=device_uuid(self.dev),
                  handle=_C.ipc_get_mem_handle(self.dev, self.base))
        peers = ctx.comm.allgather_object(me)
        hosts = {p["host"] for p in peers}
        if len(hosts) != 1:
            self._free_own()
            raise RuntimeError(f"kernels over CUDA IPC (every normal-mode op, and low-latency ops of the nvlink "
                               f"transport) need every rank on one node; ranks are on {sorted(hosts)} "
                               f"(normal mode across nodes is not implemented yet)")
        sizes = {p["nbytes"] for p in peers}
        if len(sizes) != 1:
            self._free_own()
            raise ValueError(f"every rank must create its Buffer with the same {size_name}; got {sorted(sizes)}")
        self._cap_blocks(me["uuid"], [p["uuid"] for p in peers])
        self._opened: List[int] = []
        bases = []
        for r, p in enumerate(peers):
            if r == ctx.rank:
                bases.append(self.base)
            else:
                b = _C.ipc_open_mem_handle(self.dev, p["handle"])
                self._opened.append(b)
                bases.append(b)
        self.bases = bases
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=ctx.device)
        self.errors = MappedWords(self.dev, ERROR_WORDS)
        _synchronize(self.dev)
        ctx.comm.barrier()   # every peer mapped everyone's zeroed window before any kernel runs

    def _free_own(self) -> None:
        from . import _C

        _C.mem_free(self.dev, self.base)
        self.base = None

    def close(self) -> None:
        """Collective: wait until no peer can still touch this window, then unmap and free."""
        from . import _C

        if self.base is None:
            return
        _synchronize(self.dev)
        try:
            self.ctx.comm.barrier()
        finally:
            for b in self._opened:
                _C.ipc_close_mem_handle(self.dev, b)
            _C.mem_free(self.dev, self.base)
            self.errors.free()
            self.base = None
