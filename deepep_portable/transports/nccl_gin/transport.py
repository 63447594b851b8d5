"""`nccl_gin` transport: the kernels over the transport contract on NCCL's device API (LSA peers by load/store,
GIN for the network; csrc/backends/nccl_gin/device.cuh), on a window from NCCL (window.py). Channels = GIN
contexts = `num_qps_per_rank`. Run on one H200: at one rank over NCCL 2.28 (which refuses ranks sharing a
GPU) and at two ranks sharing it over NCCL 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1): the contract self-test over LSA
and the low-latency and normal suites. GIN only over the tests' mock (no NIC here)."""
from __future__ import annotations

from ...contract import BufferContext, Capabilities
from ..kernel import KernelTransport
from .window import NcclGinWindow


class NcclGinTransport(KernelTransport):
    name = "nccl_gin"
    internode_normal = True   # GIN reaches the other nodes (engines/internode.py; LSA team = node)
    # backends/nccl_gin/device.cuh's record: LSA peers known at run time; no fetching atomic over GIN
    capabilities = Capabilities(peer_load_store=False, remote_atomics=False, ordered_delivery=False, max_channels=1,
                                graph_safe=True, network="other")

    @classmethod
    def make_ll_window(cls, ctx: BufferContext, nbytes: int) -> NcclGinWindow:
        channels = int(ctx.options.get("num_qps_per_rank", 1) or 1)
        return NcclGinWindow(ctx, nbytes, channels=channels, options=ctx.options.get("nccl_gin") or {})
