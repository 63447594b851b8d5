"""Bootstrap and host-side collectives over a torch `ProcessGroup` or an `mpi4py` communicator.

Everything the library needs from the launcher goes through `Comm`: rank/size, exchanging small
objects (IPC handles, unique ids), barriers, and the byte all-to-all that the reference transport
uses. Tensors that the process group's backend cannot move (e.g. CUDA tensors over gloo, or several
ranks sharing one GPU, which NCCL refuses) are staged through host memory.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist


class DeadlinePassed(Exception):
    """A posted operation had not completed when its deadline passed (it stays posted: nothing here cancels
    it, so the group's connections stay open; the caller decides what the lateness means)."""


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
    def allgather_object(self, obj: Any, timeout_s: Optional[float] = None) -> List[Any]:
        """Every rank's `obj`, in rank order. With `timeout_s`, DeadlinePassed when some rank has not taken
        part by then (which one, a collective cannot tell)."""
        if timeout_s is not None:
            data = self._allgather_bytes_by(pickle.dumps(obj), time.monotonic() + timeout_s)
            return [pickle.loads(d) for d in data]
        if self._mpi is not None:
            return self._mpi.allgather(obj)
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _allgather_bytes_by(self, data: bytes, deadline: float) -> List[bytes]:
        if self._mpi is not None:
            import numpy as np

            sizes = np.zeros(self.size, dtype=np.int64)
            wait_by(self._mpi.Iallgather(np.array([len(data)], dtype=np.int64), sizes), deadline)
            displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            out = np.empty(int(sizes.sum()), dtype=np.uint8)
            from mpi4py import MPI

            wait_by(self._mpi.Iallgatherv(np.frombuffer(data, dtype=np.uint8),
                                          [out, (sizes.tolist(), displs.tolist()), MPI.BYTE]), deadline)
            return [out[o:o + n].tobytes() for o, n in zip(displs.tolist(), sizes.tolist())]
        dev = self.message_device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        wait_by(dist.all_gather(sizes, size, group=self._pg, async_op=True), deadline)
        lengths = [int(x.item()) for x in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        wait_by(dist.all_gather(outs, padded, group=self._pg, async_op=True), deadline)
        return [bytes(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, lengths)]

    # ---- point-to-point messages (agreement.py) ------------------------------------------------------
    def message_device(self) -> torch.device:
        """Where small host messages live for this group's backend (NCCL moves CUDA tensors only)."""
        if self._pg is not None and "gloo" not in self.backend and "mpi" not in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def post_send(self, peer: int, data: bytes, tag: int) -> "Posted":
        """Send `data` to `peer` (who posts a receive of the same size); returns at once. A marker byte follows
        the data: gloo's receives never report completion to a poll, so a receiver polls for the marker."""
        payload = bytes(data) + bytes([_MARK])
        if self._mpi is not None:
            import numpy as np

            buf = np.frombuffer(payload, dtype=np.uint8).copy()
            return Posted(self._mpi.Isend(buf, dest=peer, tag=tag), buf)
        t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.message_device())
        return Posted(dist.isend(t, dst=dist.get_global_rank(self._pg, peer), group=self._pg, tag=tag), t)

    def post_recv(self, peer: int, nbytes: int, tag: int) -> "Posted":
        """Receive `nbytes` from `peer`; returns at once (Posted.done() polls, .data() reads)."""
        if self._mpi is not None:
            import numpy as np

            buf = np.zeros(nbytes + 1, dtype=np.uint8)
            return Posted(self._mpi.Irecv(buf, source=peer, tag=tag), buf, receive=True)
        t = torch.zeros(nbytes + 1, dtype=torch.uint8, device=self.message_device())
        return Posted(dist.irecv(t, src=dist.get_global_rank(self._pg, peer), group=self._pg, tag=tag), t,
                      receive=True)

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
                         recv_counts: Sequence[int], timeout_s: Optional[float] = None) -> torch.Tensor:
        """Variable all-to-all of a flat uint8 tensor: `send_counts[r]` bytes go to rank r, in rank
        order; returns the received bytes, ordered by source rank, on `send`'s device. With `timeout_s`,
        DeadlinePassed when it has not completed by then."""
        assert send.dtype == torch.uint8 and send.dim() == 1
        device = send.device
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._pg_moves(device):
            recv = torch.empty(sum(recv_counts), dtype=torch.uint8, device=device)
            work = dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self._pg,
                                          async_op=True)
            wait_by(work, deadline)
            return recv
        host = send.to("cpu").contiguous()
        if self._mpi is not None:
            recv_host = _mpi_alltoallv(self._mpi, host, send_counts, recv_counts, deadline)
        else:
            recv_host = torch.empty(sum(recv_counts), dtype=torch.uint8)
            work = dist.all_to_all_single(recv_host, host, recv_counts, send_counts, group=self._pg, async_op=True)
            wait_by(work, deadline)
        return recv_host.to(device)

    def all_to_all_counts(self, counts: Sequence[int], timeout_s: Optional[float] = None) -> List[int]:
        """counts[r] = what this rank sends rank r; returns what each rank sends this rank."""
        rows = self.allgather_object([int(c) for c in counts], timeout_s)
        return [rows[src][self.rank] for src in range(self.size)]


_MARK = 0xAB   # the last byte of every point-to-point message (Comm.post_send)


class Posted:
    """A posted send or receive (a torch Work or an MPI request) and the buffer it uses (kept alive with it:
    the backend may write into a receive's buffer at any time until it completes)."""

    def __init__(self, request: Any, buffer: Any, receive: bool = False) -> None:
        self._request, self._buffer, self._receive = request, buffer, receive
        self._done = False

    def done(self) -> bool:
        """Whether it completed (raises what the backend raised if it failed). Never blocks for long."""
        if self._done:
            return True
        r, b = self._request, self._buffer
        if isinstance(b, torch.Tensor) and b.device.type == "cpu" and hasattr(r, "is_completed"):
            # gloo: a point-to-point Work never reports completion before wait(), but the bytes land in order:
            # the marker, written last, says the message is in (wait() then returns at once).
            if not self._receive or int(b[-1]) != _MARK:
                return False
            r.wait()
            self._done = True
        elif hasattr(r, "is_completed"):   # a torch Work of a backend that reports it (NCCL)
            if r.is_completed():
                r.wait()
                self._done = True
        else:                              # an MPI request
            self._done = bool(r.Test())
        return self._done

    def finish(self) -> None:
        """Wait for it (a send whose peer is known to have posted the matching receive)."""
        if not self._done:
            r = self._request
            r.wait() if hasattr(r, "is_completed") else r.Wait()
            self._done = True

    def data(self) -> bytes:
        b = self._buffer
        raw = bytes(b.cpu().numpy().tobytes()) if isinstance(b, torch.Tensor) else b.tobytes()
        return raw[:-1] if self._receive else raw


def wait_by(request: Any, deadline: Optional[float]) -> None:
    """Wait for a torch Work or an MPI request; DeadlinePassed if `deadline` (time.monotonic()) passes first.
    Polls instead of a timed wait: gloo closes a connection whose timed wait expired, and the group with it."""
    if deadline is None:
        if hasattr(request, "is_completed"):
            request.wait()
        else:
            request.Wait()
        return
    posted = Posted(request, None)
    while not posted.done():
        if time.monotonic() > deadline:
            raise DeadlinePassed()
        time.sleep(0.0002)


def _mpi_alltoallv(comm, host: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                   deadline: Optional[float] = None) -> torch.Tensor:
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
    wait_by(comm.Ialltoallv([sendbuf, (send_counts, displs(send_counts)), MPI.BYTE],
                            [recvbuf, (recv_counts, displs(recv_counts)), MPI.BYTE]), deadline)
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
