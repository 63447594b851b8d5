"""What every window gives the engines besides its memory: the grid cap for ranks sharing a GPU, the
error record its kernels write, and the kernels built for its transport (CUDA IPC in windows/ipc.py;
a backend's own window in transports/<name>/window.py)."""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from .. import jit
from ..device import sm_count

ERROR_WORDS = 8   # [code, op, rank, peer, channel, detail, -, -] (ErrorSink's host record)


class _DeviceRange:
    """A raw device range as something torch.as_tensor wraps without a copy (uint8 elements):
    __cuda_array_interface__ v2, data (ptr, read_only=False), C-contiguous (strides None), no stream
    (nothing to synchronize: the memory is not produced by a torch stream)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                         "version": 2, "strides": None}


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


@dataclass(frozen=True)
class KernelBuild:
    """How kernels over the transport contract are compiled for one backend
    (csrc/common/kernels/selected_transport.cuh): the backend's device header, pre-included with
    nvcc's -include, the name of its Transport struct, and the backend's own compile-time settings.
    This record is the only place a backend is chosen for a kernel: the kernel sources name none."""

    header: str                                  # e.g. "backends/nvlink/device.cuh" (in the kernel tree)
    struct: str                                  # e.g. "NvlinkTransport" (namespace deepep_portable::transport)
    defines: Tuple[Tuple[str, int], ...] = ()    # e.g. (("DEEPEP_WINDOW_VMM", 1),)

    def kernel_defines(self, defines: Mapping) -> dict:
        return {**defines, **dict(self.defines), "DEEPEP_TRANSPORT": self.struct}

    @property
    def flags(self) -> Tuple[str, ...]:
        return ("-include", self.header)


# The windows open on each device in this process: {device: {id(window): (weak reference, Buffer uid)}}, and the
# count of distinct Buffers among them, recounted when a window opens, closes or is collected (grid() reads it on
# every op). Weak: a Buffer dropped without destroy() stops counting.
_live_windows: Dict[int, Dict[int, tuple]] = {}
_live_counts: Dict[int, int] = {}


def rank_problem(rank: int, exc: BaseException) -> str:
    """A rank's failure while its window is made, as it travels in the window's exchange: every rank then raises
    with all of them, so no peer waits in a later collective for a rank that left."""
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def agreed_problems(comm, problem: Optional[str]) -> List[str]:
    """Collective over `comm`: every rank's problem (rank_problem), or None where all went well, the Nones left
    out; the same list on every rank."""
    return [p for p in comm.allgather_object(problem) if p]


def _recount(dev: int) -> None:
    windows = _live_windows.get(dev, {})
    _live_counts[dev] = max(1, len({uid for _, uid in windows.values()}))


def _forget(dev: int, key: int) -> None:
    if _live_windows.get(dev, {}).pop(key, None) is not None:
        _recount(dev)


def live_buffers(dev: int) -> int:
    """How many Buffers of this process have a window open on device `dev` (at least 1)."""
    return _live_counts.get(dev, 1)


class Window:
    """Base of every window. A subclass sets `dev`, `base`, `size` (bytes, at least those asked for),
    `bases` and `peer_bases` (every rank's base as a list and as a device tensor, 0 where a rank has no
    load/store address here), `errors` (MappedWords of ERROR_WORDS), and calls _cap_blocks once it knows
    which ranks share its GPU. A window that carries a
    transport (the low-latency engine's) also sets `build` and implements transport_params()."""

    dev: int
    size: int
    max_blocks: int
    errors: MappedWords
    build: Optional[KernelBuild] = None   # None: kernels that use no transport (CUDA IPC peers by address)
    cheap_fetch_add = False               # the build's Transport::kCheapFetchAdd (host mirror)
    remote_atomics = True                 # the build's capabilities().remote_atomics (host mirror)
    _kernels: Optional[jit.KernelCache] = None

    def kernel(self, source: str, name: str, defines: Mapping):
        """Kernel `name` of `source` (under csrc/) compiled for this window's transport and loaded on its
        device (memoized)."""
        if self._kernels is None:
            self._kernels = jit.KernelCache(self.dev)
        if self.build is None:
            return self._kernels.get(source, name, defines)
        return self._kernels.get(source, name, self.build.kernel_defines(defines), self.build.flags)

    def view(self, offset: int, nbytes: int, device):
        """A uint8 torch tensor over `nbytes` at `offset` of this window (no copy, no ownership: it must
        not be used after the window is closed); .view(dtype) it as needed."""
        import torch

        return torch.as_tensor(_DeviceRange(self.base + offset, nbytes), device=device)

    def transport_params(self) -> ctypes.Structure:
        """The host mirror of the build's Transport struct, filled for this window: what kernels over
        the contract receive in their params."""
        raise NotImplementedError(f"{type(self).__name__} carries no transport")

    def node_transport_params(self, node_ranks) -> ctypes.Structure:
        """transport_params() whose peer table keeps load/store addresses for `node_ranks` only (the
        internode kernels: every other rank through the transport's network path, also between logical
        nodes of one machine). A window that reaches peers by load/store alone cannot."""
        raise NotImplementedError(f"{type(self).__name__} reaches its peers by load/store only: it has no network "
                                  f"path for ranks of another node")

    def _cap_blocks(self, my_uuid: str, peer_uuids) -> None:
        # Spinning blocks of every rank must be resident at once: ranks that share a GPU split its SMs.
        sharing = sum(1 for u in peer_uuids if u == my_uuid)
        self.max_blocks = max(1, sm_count(self.dev) // sharing)
        dev, key = self.dev, id(self)
        ref = weakref.ref(self, lambda _ref: _forget(dev, key))
        ctx = getattr(self, "ctx", None)
        _live_windows.setdefault(dev, {})[key] = (ref, key if ctx is None else ctx.uid)
        _recount(dev)

    def node_base(self, rank: int) -> int:
        """Where this process's kernels reach `rank`'s window by load/store for the internode kernels' NVLink part
        (0: they cannot). Usually the peer table itself; a window whose transport goes through its NIC for every
        peer (ibgda with allow_nvlink_for_low_latency_mode=False) maps node peers for this purpose alone."""
        return self.bases[rank]

    def _close_after_peers(self, release) -> None:
        """Collective close: this rank's device work is done and every rank reached the barrier, so nobody
        touches the window any more; then `release()` frees it (also when the barrier fails) with the error
        record, and the window is closed."""
        if self.base is None:
            return
        if getattr(self, "dev", -1) >= 0:
            import torch

            torch.cuda.synchronize(self.dev)
        try:
            self.ctx.comm.barrier()
        finally:
            try:
                release()
            finally:
                if getattr(self, "errors", None) is not None:
                    self.errors.free()
                self.base = None
                self._stop_counting()

    def _stop_counting(self) -> None:
        """This window no longer counts among the process's open ones (grid), from now rather than when it is
        collected: a closed or failed window may stay referenced for a while (an exception's traceback holds it)."""
        _forget(getattr(self, "dev", -1), id(self))

    def grid(self, num_sms: int) -> int:
        """Blocks per kernel: the caller's SM budget, capped so that every rank sharing this GPU fits at once,
        and every Buffer of this process on this GPU too (a block that cannot become resident would leave its
        peers spinning). Buffers each have a stream of their own, so two Buffers' kernels may run at the same
        time: a Buffer gets its share of this rank's SMs while others are open (docs/RELIABILITY.md)."""
        return max(1, min(int(num_sms), self.max_blocks // live_buffers(self.dev)))

    def recorded_error(self) -> Optional[Tuple[int, int, int, int, int, int]]:
        """(code, op, rank, peer, channel, detail) of the first error a kernel recorded, or None."""
        w = self.errors.words
        if w[0] == 0:
            return None
        return w[0], w[1], w[2], w[3], w[4], w[5]
