"""`ibgda` transport: our own GPU-driven mlx5 queues (docs/IBGDA.md). Every kernel over the transport contract
(low-latency, internode, the conformance self-test) runs over it unchanged, built for
csrc/backends/ibgda/device.cuh, on an IbgdaWindow (window.py) whose NIC resources come from a provider
(provider.py). Channels = RC queues per peer = `num_qps_per_rank`, as in DeepEP.

What runs where: the device code on host threads against a software NIC (CI); the whole backend against the
NIC model (tests only) where a GPU is; the mlx5 DevX provider (devx.py) against a fake of its C glue (CI);
never on a real NIC. The ranks of a node reach each other by load/store where the provider maps their windows
(DevX: CUDA IPC), in the internode kernels always and in the low-latency ones unless
allow_nvlink_for_low_latency_mode=False (window.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ... import jit
from ...contract import BufferContext, Capabilities
from ..kernel import KernelTransport
from ..precompile import build_variants
from .abi import IBGDA_BUILD
from .window import IbgdaWindow


class IbgdaTransport(KernelTransport):
    name = "ibgda"
    internode_normal = True   # its window reaches other nodes through the NIC (engines/internode.py)
    # backends/ibgda/device.cuh's record: channels and load/store peers are known at run time only
    capabilities = Capabilities(peer_load_store=False, remote_atomics=True, ordered_delivery=True, max_channels=1,
                                graph_safe=True, network="other")

    @classmethod
    def make_ll_window(cls, ctx: BufferContext, nbytes: int) -> IbgdaWindow:
        return IbgdaWindow(ctx, nbytes, channels=cls.channels_for(ctx))

    @staticmethod
    def channels_for(ctx: BufferContext) -> int:
        return int(ctx.options.get("num_qps_per_rank", 1) or 1)

    def runtime_capabilities(self) -> Capabilities:
        caps = replace(self.capabilities, max_channels=self.channels_for(self.ctx))
        window = getattr(self.ll_engine, "window", None)
        if window is not None and getattr(window, "base", None) is not None and all(window.bases):
            caps = replace(caps, peer_load_store=True)   # one node, every rank mapped: no queue at all
        return caps

    def runtime_notes(self) -> dict:
        """What the NIC provider chose (DevX: the rails, who rings the doorbells, how GPU memory is registered),
        for Buffer.capabilities."""
        for engine in (self.ll_engine, self.normal_engine):
            provider = getattr(getattr(engine, "window", None), "provider", None)
            if provider is not None and hasattr(provider, "describe"):
                return {"nic_provider": provider.name, "nic": provider.describe()}
        return {}


def precompile_kernels(archs: Sequence[str]):
    """`python -m deepep_portable precompile --ibgda` (this backend's registry row's `precompile`): the
    low-latency and internode kernels of transports.precompile.suite_variants() built for this backend, as its
    windows build them at run time (the same device code on a NIC or on the tests' NIC model). Needs only nvcc."""
    def compile_one(source: str, defines: dict, arch: str):
        return jit.compile_cached(source, IBGDA_BUILD.kernel_defines(defines), arch, extra_flags=IBGDA_BUILD.flags)
    return build_variants("ibgda", compile_one, archs)
