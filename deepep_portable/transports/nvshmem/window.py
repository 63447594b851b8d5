"""A window on NVSHMEM's symmetric heap: what the low-latency engine stands on with transport="nvshmem".

Same surface as the nvlink window (windows.base.Window: grid, recorded_error, kernel,
transport_params; base, peer_bases, errors, close), so the engine does not care which one it holds.
Differences:
  * the memory is one nvshmem_malloc (collective, same size on every PE) in the process's shared
    NVSHMEM runtime (runtime.shared_runtime: initialised by unique id over the Buffer's group the
    first time);
  * peer_bases[r] = nvshmem_ptr(base, r): a load/store address for P2P-reachable PEs (same node or
    same GPU) and 0 for PEs behind a network; the kernels reach every peer through the transport
    (csrc/backends/nvshmem/device.cuh), whose struct carries that table;
  * kernels are device-linked against libnvshmem_device.a (link.py) and registered with
    nvshmemx_cumodule_init before their first launch (kernel()).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ... import jit
from ...contract import BufferContext
from ...device import device_index, device_uuid
from ...windows.base import ERROR_WORDS, KernelBuild, MappedWords, Window
from . import link
from . import runtime as nr
from .abi import NvshmemTransportParams

# Kernels over the contract for this backend (selected_transport.cuh); fetch_add is cheap (kCheapFetchAdd).
NVSHMEM_BUILD = KernelBuild("backends/nvshmem/device.cuh", "NvshmemTransport")

# Heap headroom beyond the first window: later Buffers of the job allocate from the same heap (8 PEs
# sharing one GPU each reserve it, so not more). NVSHMEM_SYMMETRIC_SIZE / nvshmem_options override.
HEAP_FACTOR = 2
HEAP_MIN = 1 << 30


class NvshmemWindow(Window):
    build = NVSHMEM_BUILD
    cheap_fetch_add = True

    def __init__(self, ctx: BufferContext, nbytes: int, options: Optional[dict] = None) -> None:
        """Collective over ctx.comm (the runtime's PEs are that group's ranks)."""
        from ... import _C

        self.ctx = ctx
        self.dev = device_index(ctx.device)
        torch.zeros(1, device=ctx.device)   # the device's primary context is current on this thread
        heap = max(HEAP_MIN, HEAP_FACTOR * nbytes + (64 << 20))
        self.rt = nr.shared_runtime(ctx.comm, self.dev, options, min_heap_bytes=heap)
        self.base, self.size = self.rt.malloc(nbytes), nbytes   # collective; zeroed before anyone signals into it
        _C.memset_d8_async(self.dev, self.base, 0, nbytes, 0)
        _C.stream_synchronize(self.dev, 0)
        me = device_uuid(self.dev)
        self._cap_blocks(me, ctx.comm.allgather_object(me))
        self.bases = [self.rt.ptr(self.base, pe) for pe in range(ctx.num_ranks)]
        self.network_peers = [pe for pe, b in enumerate(self.bases) if b == 0]
        self.peer_bases = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
        self.errors = MappedWords(self.dev, ERROR_WORDS)
        self._params = NvshmemTransportParams(self.base, self.rt.my_pe, self.rt.n_pes, self.peer_bases.data_ptr())
        self._modules: Dict[Tuple, object] = {}
        self._node_tables: list = []
        torch.cuda.synchronize(self.dev)
        self.rt.barrier_all()   # every PE's window is zeroed before any kernel runs

    def kernel(self, source: str, name: str, defines: dict):
        """The device-linked kernel `name` of `source`, its module registered with NVSHMEM (once)."""
        key = (source, tuple(sorted(defines.items())))
        mod = self._modules.get(key)
        if mod is None:
            compiled = link.compile_linked_cached(source, self.build.kernel_defines(defines), jit.device_arch(self.dev),
                                                  extra_flags=self.build.flags)
            mod = self._modules[key] = self.rt.load_module(compiled)
        return mod.function(name)

    def transport_params(self) -> NvshmemTransportParams:
        return self._params

    def node_transport_params(self, node_ranks) -> NvshmemTransportParams:
        """The struct with load/store addresses for `node_ranks` only: every other PE through NVSHMEM's puts
        (device.cuh takes the load/store path only where peer_bases has an address), even when
        nvshmem_ptr would map it (logical nodes on one machine)."""
        keep = set(node_ranks)
        bases = [b if pe in keep else 0 for pe, b in enumerate(self.bases)]
        table = torch.tensor(bases, dtype=torch.int64, device=self.ctx.device)
        self._node_tables.append(table)   # the struct holds its address: keep it alive with the window
        return NvshmemTransportParams(self.base, self.rt.my_pe, self.rt.n_pes, table.data_ptr())

    def close(self) -> None:
        """Collective: wait until no PE can still touch this window, then free it (the runtime stays)."""
        self._close_after_peers(lambda: self.rt.free(self.base))   # collective (nvshmem_free)
