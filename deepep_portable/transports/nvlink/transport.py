"""`nvlink` transport: the intranode kernels over peer-mapped buffers (shareable VMM memory, or legacy CUDA IPC
memory), and the low-latency kernels over an
NvlinkWindow (csrc/backends/nvlink/device.cuh). Every rank of the group must be on one node (NVLink
or, for testing, several ranks on one GPU)."""
from __future__ import annotations

from ...contract import BufferContext, Capabilities
from ...engines import low_latency, transport_selftest
from ..kernel import KernelTransport
from .window import NvlinkWindow, nvlink_build, vmm_window_wanted


class NvlinkTransport(KernelTransport):
    name = "nvlink"
    capabilities = Capabilities(peer_load_store=True, remote_atomics=False, ordered_delivery=True, max_channels=1,
                                graph_safe=True, network="none")   # backends/nvlink/device.cuh

    @classmethod
    def make_ll_window(cls, ctx: BufferContext, nbytes: int) -> NvlinkWindow:
        return NvlinkWindow(ctx, nbytes, shareable=vmm_window_wanted())


# What `python -m deepep_portable precompile` and CI compile of the kernels over the contract (the
# default, VMM window's build).
low_latency.register_families(nvlink_build(shareable=True))
transport_selftest.register_family(nvlink_build(shareable=True))
