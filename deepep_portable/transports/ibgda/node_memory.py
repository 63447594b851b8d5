"""Window memory that the ranks of one node map by load/store: how an ibgda provider on a real NIC gives the
kernels its node's peers over NVLink (docs/IBGDA.md "Node peers").

`CudaIpcMemory` is the legacy CUDA IPC path of windows/ipc.py (IpcWindow without `shareable`): the window is a
cuMemAlloc allocation, its 64-byte IPC handle travels to the peers in the ibgda window's one allgather (the
provider's public half), and a peer of the same node opens it (cuIpcOpenMemHandle) to get an address its kernels
load from and store to. The same allocation is what the NIC registers (dmabuf of cuMemAlloc memory), so a node
peer's stores and a remote rank's RDMA WRITEs land in one window.

Why not the shareable VMM memory IpcWindow uses by default: an RDMA registration of VMM memory needs the
allocation made GPUDirect-RDMA capable (CUmemAllocationProp.allocFlags.gpuDirectRDMACapable), which the runtime's
shareable allocation does not ask for, and its descriptor exchange (windows.ipc.exchange_fds) is collective over a
communicator of one machine's ranks, where an ibgda window's group spans nodes.

The interface a provider uses (tests give a stand-in of the same shape): alloc(nbytes, align) -> (base, public),
open(public) -> address here, close(address), free(base). Every call raises on failure with the driver's message.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from ...layout import align_up


class CudaIpcMemory:
    """Node-shared window memory on CUDA device `device` (module docstring)."""

    name = "CUDA IPC"

    def __init__(self, device: int) -> None:
        self.dev = device
        self._own: Dict[int, int] = {}      # aligned base -> the allocation's start
        self._opened: Dict[int, int] = {}   # address handed out -> the mapping's start

    def alloc(self, nbytes: int, align: int) -> Tuple[int, Any]:
        """`nbytes` of zeroed device memory at an `align`-aligned address: (that address, what a peer opens)."""
        from ... import _C

        start = _C.mem_alloc(self.dev, nbytes + align)
        base = align_up(start, align)
        self._own[base] = start
        _C.memset_d8_async(self.dev, base, 0, nbytes, 0)
        _C.stream_synchronize(self.dev, 0)
        # The handle names the whole allocation: the peer adds the offset of the aligned base.
        return base, dict(handle=_C.ipc_get_mem_handle(self.dev, start), offset=base - start)

    def open(self, public: Any) -> int:
        """A peer's window (its alloc's `public`) mapped in this process: the address of its aligned base."""
        from ... import _C

        start = _C.ipc_open_mem_handle(self.dev, public["handle"])
        address = start + int(public["offset"])
        self._opened[address] = start
        return address

    def close(self, address: int) -> None:
        from ... import _C

        _C.ipc_close_mem_handle(self.dev, self._opened.pop(address))

    def free(self, base: int) -> None:
        from ... import _C

        _C.mem_free(self.dev, self._own.pop(base))
