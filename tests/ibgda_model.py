"""The NIC model as an ibgda provider (deepep_portable/transports/ibgda/provider.py), for tests only.

Every rank's window is a file in /dev/shm that every rank of the job maps, so the model (one host thread
per process, tests/native/nic_model_service.cu over mlx5_nic_model.hpp) can land a WRITE, READ or
FETCH_ADD of mine in a peer's window the way the peer's NIC would: WQEs name the peer's own address of its
window and its key, and the model translates them into its mapping. Queues live in this process's memory
(pinned, so a GPU can post, when there is one). Keys: rank r's window is key r + 1 (the same lkey and rkey).

On a GPU machine the windows are also registered with CUDA (cudaHostRegister, mapped; with unified
addressing the kernels use the host address), so the kernels' loads and stores of their own window and
the model's writes meet in host memory: slow, but the device code is the code that would drive a NIC.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import subprocess
import tempfile
from typing import Callable, Dict, List, Optional

import torch

from deepep_portable import jit
from deepep_portable.transports.ibgda.abi import SendQueueParams
from deepep_portable.transports.ibgda.provider import NicProvider, PeerInfo, QueueHandle, WindowMemory

NATIVE = os.path.join(os.path.dirname(__file__), "native")
SOURCE = os.path.join(NATIVE, "nic_model_service.cu")


def library_path() -> str:
    """Where the service library for this source lives (built by build_library)."""
    h = hashlib.sha1()
    for name in ("nic_model_service.cu", "mlx5_nic_model.hpp"):
        h.update(open(os.path.join(NATIVE, name), "rb").read())
    for name in ("sq.cuh", "ops.cuh", "mlx5.cuh"):
        h.update(open(os.path.join(jit.kernel_root(), "backends", "ibgda", name), "rb").read())
    return os.path.join(tempfile.gettempdir(), f"deepep_nms_{h.hexdigest()[:16]}.so")


def build_library() -> str:
    """Compile the service (host code) once per source version; returns its path. Raises with nvcc's output."""
    path = library_path()
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        cmd = [jit.find_nvcc(), "-std=c++17", "-O2", "--expt-relaxed-constexpr", f"-I{jit.kernel_root()}", "-shared",
               "-Xcompiler", "-fPIC", "-Xcompiler", "-pthread", SOURCE, "-o", tmp]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError("building the NIC model service failed:\n" + out.stdout + out.stderr)
        os.replace(tmp, path)
    return path


def _load(path: str):
    lib = ctypes.CDLL(path)
    u64, u32, vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
    lib.nms_queue_bytes.argtypes, lib.nms_queue_bytes.restype = [u32], u64
    lib.nms_queue_layout.argtypes = [u64, u64, u32, u32, ctypes.POINTER(SendQueueParams)]
    lib.nms_create.argtypes, lib.nms_create.restype = [u32], vp
    lib.nms_set_key.argtypes, lib.nms_set_key.restype = [vp, u32, u64, u64, u64], ctypes.c_int
    lib.nms_add_queue.argtypes = [vp, u64, u32, u32, ctypes.c_int, ctypes.c_int]
    lib.nms_add_queue.restype = ctypes.c_int
    lib.nms_start.argtypes = [vp]
    lib.nms_destroy.argtypes, lib.nms_destroy.restype = [vp], ctypes.c_int
    lib.nms_post_write_signal.argtypes = [u64, u64, u64, u32, u64, u64, ctypes.c_double]
    lib.nms_post_write_signal.restype = ctypes.c_int
    return lib


@contextlib.contextmanager
def installed(factory: Optional[Callable] = None):
    """While inside: the NIC model (or `factory`, a provider factory) is the ibgda backend's provider in this
    process. The provider found on entry is put back on exit, so a test's own model inside the session's (the
    MPI suites' conftest installs one for a whole pytest run) leaves the session's in place for the next file."""
    from deepep_portable.transports.ibgda import provider

    before = provider.installed()
    provider.install(factory if factory is not None else (lambda ctx: ModelProvider(ctx)))
    try:
        yield
    finally:
        provider.install(before)


class _Mapping:
    """A /dev/shm file mapped here (and registered with CUDA when `cuda`)."""

    def __init__(self, path: str, nbytes: int, create: bool, cuda: bool) -> None:
        self.path, self.nbytes, self.cuda = path, nbytes, cuda
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        if cuda:   # cudaHostRegisterPortable | cudaHostRegisterMapped
            err = torch.cuda.cudart().cudaHostRegister(self.address, nbytes, 3)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {path} failed: {err}")

    def close(self) -> None:
        if self.map is None:
            return
        if self.cuda:
            torch.cuda.cudart().cudaHostUnregister(self.address)
        self.address = 0
        try:
            self.map.close()
        except BufferError:   # a ctypes view still alive: the mapping goes with the process
            pass
        self.map = None


class ModelProvider(NicProvider):
    name = "nic-model"

    def __init__(self, ctx, chaos: bool = False, atomic_be: bool = True, load_store: Optional[bool] = None) -> None:
        """load_store: also let this process's kernels load/store peers' windows (the internode kernels' node
        part: registers every peer's window with CUDA); default: when the Buffer spans (logical) nodes."""
        self.ctx, self.chaos, self.atomic_be = ctx, chaos, atomic_be
        self.atomic_result_be = atomic_be
        self.load_store = ctx.num_nodes > 1 if load_store is None else load_store
        self.cuda = ctx.device.type == "cuda"
        self.lib = _load(build_library())
        self.svc = self.lib.nms_create(ctx.num_ranks + 1)
        self.own: Optional[_Mapping] = None
        self.maps: Dict[int, _Mapping] = {}
        self.queue_memory: List[torch.Tensor] = []
        self.problems = 0

    def alloc_window(self, nbytes: int) -> WindowMemory:
        nbytes = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        path = f"/dev/shm/deepep_nms_{os.getpid()}_{self.ctx.uid}_{self.ctx.rank}"
        self.own = _Mapping(path, nbytes, True, self.cuda)
        key = self.ctx.rank + 1
        return WindowMemory(base=self.own.address, nbytes=nbytes, lkey=key, rkey=key, public=(path, nbytes))

    def create_queue(self, peer: int, channel: int, depth: int) -> QueueHandle:
        nbytes = int(self.lib.nms_queue_bytes(depth))
        mem = torch.zeros(nbytes + 64, dtype=torch.uint8, pin_memory=self.cuda)   # what the NIC reads / writes
        words = torch.zeros(3, dtype=torch.int64, device=self.ctx.device)         # the posters' own (sq.cuh)
        self.queue_memory += [mem, words]
        block = (mem.data_ptr() + 63) // 64 * 64
        qpn = 0x100 + len(self.queue_memory) // 2
        sq = SendQueueParams()
        self.lib.nms_queue_layout(block, words.data_ptr(), depth, qpn, ctypes.byref(sq))
        if self.lib.nms_add_queue(self.svc, block, depth, qpn, int(self.chaos), int(self.atomic_be)) < 0:
            raise RuntimeError("the NIC model refused a queue")
        return QueueHandle(sq=sq, qpn=qpn)

    def connect(self, window: WindowMemory, queues, peers: List[PeerInfo]) -> None:
        for p in peers:
            if p.rank == self.ctx.rank:
                local = self.own.address
            else:
                path, nbytes = p.public
                self.maps[p.rank] = _Mapping(path, nbytes, False, self.cuda and self.load_store)
                local = self.maps[p.rank].address
            if self.lib.nms_set_key(self.svc, p.rank + 1, p.base, p.public[1], local) != 0:
                raise RuntimeError(f"the NIC model refused key {p.rank + 1}")
        self.lib.nms_start(self.svc)

    def peer_load_store_base(self, peer: PeerInfo) -> int:
        m = self.maps.get(peer.rank)
        return m.address if (m is not None and self.load_store) else 0

    def local_address(self, rank: int) -> int:
        """Where this process reaches rank's window (its own included)."""
        return self.own.address if rank == self.ctx.rank else self.maps[rank].address

    def close(self) -> None:
        if self.svc:
            self.problems = self.lib.nms_destroy(self.svc)   # the thread stops before memory goes
            self.svc = None
        for m in self.maps.values():
            m.close()
        if self.own is not None:
            self.own.close()
            os.unlink(self.own.path)
            self.own = None
