"""The nccl_gin backend's device code (csrc/backends/nccl_gin/device.cuh) over the tests' mock of NCCL's device
API (tests/native/nccl_gin_mock/), so its GIN branches run between ranks that share one GPU (NCCL itself
refuses those). Tests only.

`MockGinWindow` is an NcclGinWindow whose memory is a shareable VMM window every rank maps (the nvlink
window's), whose LSA team is the rank alone (its logical node when the Buffer spans several), and whose
"GIN" is the mock: puts land piece by piece in no order
after a delay, signals only add, a signal is strong (nccl_device.h there says exactly what it promises).
Everything the device code keeps (the SET-signal shadow, the failure word, scratch for GIN reads, the
transport struct) is built as the real window builds it.

Install it for a session with DEEPEP_TEST_NCCL_GIN_MOCK=1 (tests/mpi/conftest.py): Buffer(...,
transport="nccl_gin") then gets this window for its low-latency engine and for the internode kernels.
"""
from __future__ import annotations

import contextlib
import ctypes
import os

import torch

from deepep_portable.contract import BufferContext
from deepep_portable.transports.nccl_gin.abi import SCRATCH_WORDS
from deepep_portable.transports.nccl_gin.window import ALIGN, NcclGinWindow
from deepep_portable.windows.ipc import IpcWindow

MOCK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "nccl_gin_mock")


class MockDevComm(ctypes.Structure):
    """ncclDevComm of the mock (nccl_device.h there)."""

    _fields_ = [("rank", ctypes.c_int32), ("nRanks", ctypes.c_int32), ("lsaRank", ctypes.c_int32),
                ("lsaSize", ctypes.c_int32), ("ginContextCount", ctypes.c_int32), ("delayNs", ctypes.c_int32)]


class MockWindowStruct(ctypes.Structure):
    """ncclWindow_vidmem of the mock: every rank's window as mapped in this process."""

    _fields_ = [("bases", ctypes.c_uint64), ("rank", ctypes.c_int32), ("nRanks", ctypes.c_int32)]


def _to_device(struct: ctypes.Structure, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes(struct)), dtype=torch.uint8).to(device)


class MockGinWindow(NcclGinWindow):
    def __init__(self, ctx: BufferContext, nbytes: int, channels: int = 1, delay_ns: int = 2000) -> None:
        """Collective over ctx.comm (the inner window's exchange)."""
        self.ctx, self.base = ctx, None
        self.scratch_offset = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        total = self.scratch_offset + 8 * SCRATCH_WORDS
        self._inner = IpcWindow(ctx, total, total, "num_rdma_bytes", shareable=True)
        inner, me, R = self._inner, ctx.rank, ctx.num_ranks
        self.dev, self.size, self.errors, self.max_blocks = inner.dev, nbytes, inner.errors, inner.max_blocks
        self.flags, self.defines = ("-I" + MOCK_DIR,), {"DEEPEP_NCCL_RUNTIME": 0}
        self.gin = True
        # The LSA team: my logical node when the Buffer spans several (the internode kernels reach their node by
        # load/store, as on a real cluster), else myself alone (every peer through GIN).
        per_node = ctx.ranks_per_node if ctx.num_nodes > 1 else 1
        self.lsa_first = me // per_node * per_node
        self.lsa_team = list(range(self.lsa_first, self.lsa_first + per_node))
        self.lsa_rank, self.lsa_size = me - self.lsa_first, per_node
        self.gin_contexts = max(1, int(channels))
        self._all_bases = torch.tensor(inner.bases, dtype=torch.int64, device=ctx.device)   # the mock's "network"
        self._win_struct = _to_device(MockWindowStruct(self._all_bases.data_ptr(), me, R), ctx.device)
        self._win = ctypes.c_void_p(self._win_struct.data_ptr())
        self.devcomm = _to_device(MockDevComm(me, R, self.lsa_rank, self.lsa_size, self.gin_contexts, delay_ns),
                                  ctx.device)
        self._device_tables(ctx.device)
        self.base = inner.base
        self.bases = [b if r in self.lsa_team else 0 for r, b in enumerate(inner.bases)]   # load/store: my team
        self.peer_bases = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
        torch.cuda.synchronize(self.dev)

    def close(self) -> None:
        """Collective (the inner window's close)."""
        if self.base is not None:
            self.base = None
            self._inner.close()


@contextlib.contextmanager
def installed():
    """While inside: Buffer(..., transport="nccl_gin") gets a MockGinWindow for its low-latency engine and the
    internode kernels (this process)."""
    from deepep_portable.transports.nccl_gin.transport import NcclGinTransport

    def make_ll_window(cls, ctx: BufferContext, nbytes: int) -> MockGinWindow:
        return MockGinWindow(ctx, nbytes, channels=int(ctx.options.get("num_qps_per_rank", 1) or 1))

    before = NcclGinTransport.__dict__["make_ll_window"]
    NcclGinTransport.make_ll_window = classmethod(make_ll_window)
    try:
        yield
    finally:
        NcclGinTransport.make_ll_window = before
