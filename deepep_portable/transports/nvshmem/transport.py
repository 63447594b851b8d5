"""`nvshmem` transport: the low-latency kernels over NVSHMEM's symmetric heap.

Low-latency ops run the same kernels as the `nvlink` transport (csrc/common/kernels/low_latency),
built for csrc/backends/nvshmem/device.cuh and device-linked with libnvshmem_device: the LL buffer
(`num_rdma_bytes`) is a symmetric allocation (window.NvshmemWindow), peers that are P2P-reachable (same
node, same GPU) are reached by NVSHMEM's load/store path and the others by NVSHMEM puts (IBGDA when
`nvshmem_options={"ibgda": True}`; RoCE/QoS settings through the other options of
runtime.PASS_THROUGH). NVSHMEM is initialised once per process, by unique id over the first such
Buffer's group.

Normal-mode ops (`num_nvl_bytes`) run the intranode kernels over peer-mapped buffers, as in `nvlink` (every rank
on one node). What was run where: docs/PERFORMANCE.md and the closing notes; the network path
(non-P2P peers) has not run (no RDMA NIC on the machines used so far).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Tuple

from ...contract import BufferContext, Capabilities
from ..kernel import KernelTransport
from ..precompile import build_variants
from . import link
from .window import NVSHMEM_BUILD, NvshmemWindow


class NvshmemTransport(KernelTransport):
    name = "nvshmem"
    internode_normal = True   # its window reaches other nodes by NVSHMEM puts (engines/internode.py)
    # backends/nvshmem/device.cuh: peer load/store is known only at run time (nvshmem_ptr per PE)
    capabilities = Capabilities(peer_load_store=False, remote_atomics=True, ordered_delivery=False, max_channels=1,
                                graph_safe=True, network="other")

    @classmethod
    def make_ll_window(cls, ctx: BufferContext, nbytes: int) -> NvshmemWindow:
        return NvshmemWindow(ctx, nbytes, ctx.options.get("nvshmem"))

    def runtime_capabilities(self) -> Capabilities:
        window = getattr(self.ll_engine, "window", None)
        if window is None or getattr(window, "base", None) is None:
            return self.capabilities
        return replace(self.capabilities, peer_load_store=not window.network_peers)


def precompile(archs=("sm_90",), jobs: Optional[int] = None, variants: Optional[Sequence[Tuple[str, dict]]] = None):
    """Device-link kernels for this backend (in parallel, `jobs` nvcc processes): `variants` ((source, defines)
    pairs, e.g. from the engines' round_variants), by default transports.precompile.suite_variants(). Returns
    [(label, arch, seconds, cache_hit)]; raises when NVSHMEM or nvcc is missing."""
    def compile_one(source: str, defines: dict, arch: str):
        return link.compile_linked_cached(source, NVSHMEM_BUILD.kernel_defines(defines), arch,
                                          extra_flags=NVSHMEM_BUILD.flags)
    return build_variants("nvshmem", compile_one, archs, jobs, variants)


def precompile_linked(archs: Sequence[str]):
    """`python -m deepep_portable precompile --nvshmem` (this backend's registry row's `precompile`): precompile()'s
    default kernels for `archs`, sm_80 left out."""
    return precompile(tuple(a for a in archs if a != "sm_80"))
