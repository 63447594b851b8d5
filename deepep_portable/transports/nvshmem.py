"""`nvshmem` transport: the low-latency kernels over NVSHMEM's symmetric heap.

Low-latency ops run the same kernels as the `nvlink` transport (csrc/common/kernels/low_latency),
built against csrc/backends/nvshmem/device.cuh and device-linked with libnvshmem_device: the LL
buffer (`num_rdma_bytes`) is a symmetric allocation (nvshmem_window.NvshmemWindow), peers that are
P2P-reachable (same node, same GPU) are reached by NVSHMEM's load/store path and the others by
NVSHMEM puts (IBGDA when `nvshmem_options={"ibgda": True}`; RoCE/QoS settings through the other
options of nvshmem_runtime.PASS_THROUGH). NVSHMEM is initialised once per process, by unique id over
the first such Buffer's group.

Normal-mode ops (`num_nvl_bytes`) run the intranode kernels over CUDA IPC, as in `nvlink` (every rank
on one node). What was run where: docs/PERFORMANCE.md and the closing notes; the network path
(non-P2P peers) has not run (no RDMA NIC on the machines used so far).
"""
from __future__ import annotations

from dataclasses import replace

from ..contract import Capabilities
from .nvlink import NvlinkTransport


class NvshmemTransport(NvlinkTransport):
    name = "nvshmem"
    ll_window = "nvshmem"
    # backends/nvshmem/device.cuh: peer load/store is known only at run time (nvshmem_ptr per PE)
    capabilities = Capabilities(peer_load_store=False, remote_atomics=True, ordered_delivery=False, max_channels=1,
                                graph_safe=True, network="other")

    def runtime_capabilities(self) -> Capabilities:
        window = getattr(self.ll_engine, "window", None)
        if window is None or getattr(window, "base", None) is None:
            return self.capabilities
        return replace(self.capabilities, peer_load_store=not window.network_peers)
