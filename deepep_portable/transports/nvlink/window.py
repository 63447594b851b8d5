"""The `nvlink` backend's window: an IpcWindow whose kernels are built for csrc/backends/nvlink/device.cuh.

Shareable VMM memory by default: the low-latency dispatch's fetch_add (one per expert and sender) is
cheap on VMM mappings and slow on legacy CUDA IPC ones (measured on the H200, docs/PERFORMANCE.md), so
the build says which it got (DEEPEP_WINDOW_VMM -> NvlinkTransport::kCheapFetchAdd) and the engine
places the dispatch's rows accordingly (Window.cheap_fetch_add, the host mirror).
DEEPEP_PORTABLE_LL_VMM=0 keeps a legacy CUDA IPC window (the dispatch then packs rows on receive).
"""
from __future__ import annotations

import ctypes
import os

from ...contract import BufferContext
from ...windows.base import KernelBuild
from ...windows.ipc import IpcWindow


class NvlinkTransportParams(ctypes.Structure):
    """Host mirror of transport::NvlinkTransport (csrc/backends/nvlink/device.cuh)."""

    _fields_ = [("bases", ctypes.c_uint64), ("rank", ctypes.c_int32), ("num_ranks", ctypes.c_int32)]


def nvlink_build(shareable: bool) -> KernelBuild:
    """Kernels for windows of shareable VMM memory (fetch_add cheap) or of legacy CUDA IPC memory."""
    return KernelBuild("backends/nvlink/device.cuh", "NvlinkTransport",
                       (("DEEPEP_WINDOW_VMM", 1),) if shareable else ())


VMM_SWITCH = "DEEPEP_PORTABLE_LL_VMM"


def vmm_window_wanted() -> bool:
    """DEEPEP_PORTABLE_LL_VMM=0: a legacy CUDA IPC window (must be the same on every rank)."""
    return os.environ.get(VMM_SWITCH, "1") != "0"


class NvlinkWindow(IpcWindow):
    def __init__(self, ctx: BufferContext, nbytes: int, shareable: bool, size_name: str = "num_rdma_bytes") -> None:
        """Collective over ctx.comm; all `nbytes` zeroed. `size_name` names the size in errors."""
        super().__init__(ctx, nbytes, nbytes, size_name, shareable=shareable, legacy_switch=VMM_SWITCH)
        self.build = nvlink_build(shareable)
        self.cheap_fetch_add = shareable
        self._params = NvlinkTransportParams(self.peer_bases.data_ptr(), ctx.rank, ctx.num_ranks)

    def transport_params(self) -> NvlinkTransportParams:
        return self._params
