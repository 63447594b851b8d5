"""Bootstrap and host-side collectives over a torch `ProcessGroup` or an `mpi4py` communicator.

Everything the library needs from the launcher goes through `Comm`: rank/size, exchanging small
objects (IPC handles, unique ids), barriers, and the byte all-to-all that the reference transport
uses. Tensors that the process group's backend cannot move (e.g. CUDA tensors over gloo, or several
ranks sharing one GPU, which NCCL refuses) are staged through host memory.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist


class Comm:
    """Uniform view of a torch ProcessGroup or an mpi4py communicator."""

    def __init__(self, group_or_comm: Any = None, comm: Any = None) -> None:
        if group_or_comm is None and comm is None:
            raise ValueError("Either a torch ProcessGroup ('group') or an mpi4py communicator ('comm') must be provided")
        obj = group_or_comm if group_or_comm is not None else comm
        self._pg: Optional[dist.ProcessGroup] = None
        self._mpi = None
        if isinstance(obj, dist.ProcessGroup):
            self._pg = obj
            self.rank = obj.rank()
            self.size = obj.size()
            self.backend = str(dist.get_backend(obj))
        elif hasattr(obj, "Get_rank") and hasattr(obj, "Alltoallv"):
            self._mpi = obj
            self.rank = obj.Get_rank()
            self.size = obj.Get_size()
            self.backend = "mpi4py"
        else:
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or an mpi4py communicator, got {type(obj).__name__}")

    @property
    def raw(self) -> Any:
        return self._pg if self._pg is not None else self._mpi

    # ---- small objects -------------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> List[Any]:
        if self._mpi is not None:
            return self._mpi.allgather(obj)
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def allgather_bytes(self, data: bytes) -> List[bytes]:
        return [bytes(x) for x in self.allgather_object(bytes(data))]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        if self._mpi is not None:
            return self._mpi.bcast(obj, root=root)
        lst = [obj if self.rank == root else None]
        dist.broadcast_object_list(lst, src=dist.get_global_rank(self._pg, root), group=self._pg)
        return lst[0]

    def barrier(self) -> None:
        if self._mpi is not None:
            self._mpi.Barrier()
        else:
            # all_gather_object is a barrier that works on every backend and device placement.
            self.allgather_object(None)

    # ---- bulk data -----------------------------------------------------------------------------
    def _pg_moves(self, device: torch.device) -> bool:
        """Whether the process group's backend can move tensors of this device directly."""
        if self._pg is None:
            return False
        if device.type == "cpu":
            return "gloo" in self.backend or "mpi" in self.backend
        return "nccl" in self.backend and not _shares_gpu_with_peer(self)

    def all_to_all_bytes(self, send: torch.Tensor, send_counts: Sequence[int],
                         recv_counts: Sequence[int]) -> torch.Tensor:
        """Variable all-to-all of a flat uint8 tensor: `send_counts[r]` bytes go to rank r, in rank
        order; returns the received bytes, ordered by source rank, on `send`'s device."""
        assert send.dtype == torch.uint8 and send.dim() == 1
        device = send.device
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        if self._pg_moves(device):
            recv = torch.empty(sum(recv_counts), dtype=torch.uint8, device=device)
            dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self._pg)
            return recv
        host = send.to("cpu").contiguous()
        if self._mpi is not None:
            recv_host = _mpi_alltoallv(self._mpi, host, send_counts, recv_counts)
        else:
            recv_host = torch.empty(sum(recv_counts), dtype=torch.uint8)
            dist.all_to_all_single(recv_host, host, recv_counts, send_counts, group=self._pg)
        return recv_host.to(device)

    def all_to_all_counts(self, counts: Sequence[int]) -> List[int]:
        """counts[r] = what this rank sends rank r; returns what each rank sends this rank."""
        rows = self.allgather_object([int(c) for c in counts])
        return [rows[src][self.rank] for src in range(self.size)]


def _mpi_alltoallv(comm, host: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> torch.Tensor:
    import numpy as np
    from mpi4py import MPI

    def displs(counts):
        out, acc = [], 0
        for c in counts:
            out.append(acc)
            acc += c
        return out

    sendbuf = host.numpy()
    recvbuf = np.empty(sum(recv_counts), dtype=np.uint8)
    comm.Alltoallv([sendbuf, (send_counts, displs(send_counts)), MPI.BYTE],
                   [recvbuf, (recv_counts, displs(recv_counts)), MPI.BYTE])
    return torch.from_numpy(recvbuf)


_shared_gpu_cache: dict = {}


def _shares_gpu_with_peer(comm: Comm) -> bool:
    """True when two ranks of the group use the same physical GPU (NCCL cannot serve that)."""
    key = id(comm.raw)
    if key not in _shared_gpu_cache:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        uuids = comm.allgather_object(uuid)
        _shared_gpu_cache[key] = len(set(uuids)) < len(uuids)
    return _shared_gpu_cache[key]
