"""One window per rank, mapped by every peer: what the intranode and the low-latency engines of the
`nvlink` transport both stand on.

`IpcWindow` allocates the window, zeroes its control part, exchanges handles over the Buffer's group,
checks that the group can share memory (one node, the same size everywhere), maps every peer, and
owns the mapped host words through which kernels report errors (see
csrc/common/kernels/signal.cuh: ErrorSink). Two kinds of memory:
  * shareable VMM memory (`shareable=True`: cuMemCreate, exported as a POSIX file descriptor that the
    peers receive over a Unix socket, `exchange_fds`): the default of both engines of the nvlink
    transport. Atomics on a legacy IPC mapping are slow and on VMM mappings not (NVSHMEM shares its heap
    that way), and the intranode ops run faster over VMM windows although a plain streaming copy runs at
    the same rate over both (docs/PERFORMANCE.md);
  * legacy CUDA IPC (cuMemAlloc + cuIpcGetMemHandle, handles sent over the group): the fallback for
    systems that refuse the descriptor exchange (DEEPEP_PORTABLE_INTRANODE_VMM=0 for the intranode
    buffer, DEEPEP_PORTABLE_LL_VMM=0 for the low-latency window; docs/CONFIGURATION.md).
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..contract import BufferContext
from ..device import device_index, device_uuid
from ..topology import node_identity
from .base import ERROR_WORDS, MappedWords, Window, agreed_problems, rank_problem


def exchange_fds(comm, rank: int, num_ranks: int, fd: int, tag: str, timeout_s: float) -> List[Optional[int]]:
    """Collective over `comm` (ranks of one node): give every peer a duplicate of my file descriptor
    `fd` and return theirs (None at my own index; the caller closes what it received).

    Over Unix sockets in the abstract namespace (no file to clean up) named by `tag`, which must be the
    same on every rank and unpredictable (the caller puts a random nonce in it): a client first sends
    the tag and its rank, and a server answers only a client that knows the tag and runs as the same
    user (SO_PEERCRED), so another process on the node gets no descriptor. Every rank listens (a bind
    that failed anywhere makes every rank raise), then connects to every peer (a connect completes in
    the listener's backlog: nobody waits for an accept) and sends its hello, then accepts and answers
    its peers (SCM_RIGHTS), then reads the peers' answers: no cycle of waits. Every socket operation
    times out after `timeout_s` (a peer that never comes raises, it does not hang)."""
    import socket
    import struct

    def address(r: int) -> str:
        return f"\0deepep_portable.fds.{tag}.{r}"

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.settimeout(timeout_s)
    clients = {}
    out: List[Optional[int]] = [None] * num_ranks
    try:
        try:
            server.bind(address(rank))
            server.listen(max(1, num_ranks))
            problem = None
        except OSError as e:
            problem = f"rank {rank}: cannot listen on its Unix socket: {e}"
        problems = [p for p in comm.allgather_object(problem) if p]   # also: everyone listens now
        if problems:
            raise RuntimeError("file descriptor exchange: " + "; ".join(problems))
        for r in range(num_ranks):
            if r != rank:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.settimeout(timeout_s)
                clients[r] = c
                c.connect(address(r))
                c.sendall(f"{tag}:{rank}\n".encode())
        answered = set()
        while len(answered) < num_ranks - 1:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
                hello = conn.recv(len(tag) + 16).decode(errors="replace").strip()
                peer_tag, _, peer = hello.rpartition(":")
                if uid != os.getuid() or peer_tag != tag or not peer.isdigit() or int(peer) in answered:
                    continue   # not one of my peers: no descriptor for it
                answered.add(int(peer))
                socket.send_fds(conn, [b"x"], [fd])
        for r, c in clients.items():
            _, fds, _, _ = socket.recv_fds(c, 1, 1)
            if len(fds) != 1:
                raise RuntimeError(f"rank {rank}: no file descriptor from rank {r} over its Unix socket")
            out[r] = fds[0]
        return out
    except BaseException:
        for got in out:
            if got is not None:
                os.close(got)
        raise
    finally:
        for c in clients.values():
            c.close()
        server.close()


def _synchronize(device: int) -> None:
    torch.cuda.synchronize(device)


class IpcWindow(Window):
    def __init__(self, ctx: BufferContext, nbytes: int, zero_bytes: int, size_name: str,
                 shareable: bool = False, legacy_switch: Optional[str] = None) -> None:
        """Collective over ctx.comm. `size_name` names the Buffer argument in errors. `shareable`: VMM
        memory shared by file descriptor (see the module docstring) instead of legacy CUDA IPC;
        `legacy_switch`: the caller's variable that selects legacy IPC instead, named when sharing fails."""
        from .. import _C

        self.ctx = ctx
        self.dev = device_index(ctx.device)
        self.shareable = shareable
        self.legacy_switch = legacy_switch
        fd, self.base, self.size, handle, problem = -1, 0, 0, None, None
        try:
            # A failure here (out of memory, most often) is told to the peers in the first exchange below rather
            # than raised at once: they would wait in that exchange for this rank for good.
            try:
                if shareable:
                    self.base, self.size, fd = _C.vmm_alloc_shareable(self.dev, nbytes)
                else:
                    self.base, self.size = _C.mem_alloc(self.dev, nbytes), nbytes
                _C.memset_d8_async(self.dev, self.base, 0, zero_bytes, 0)
                _C.stream_synchronize(self.dev, 0)
                handle = None if shareable else _C.ipc_get_mem_handle(self.dev, self.base)
                host, uuid = node_identity(), device_uuid(self.dev)
            except Exception as e:   # noqa: BLE001 - raised on every rank after the exchange
                problem, host, uuid = rank_problem(ctx.rank, e), None, None
            me = dict(host=host, pid=os.getpid(), nonce=os.urandom(16).hex(), nbytes=nbytes,
                      shareable=shareable, uuid=uuid, handle=handle, problem=problem)
            peers = ctx.comm.allgather_object(me)
            problems = [p.get("problem") for p in peers if p.get("problem")]
            if problems:
                if self.base:
                    self._free_own()
                raise RuntimeError(f"allocating the window of {nbytes} bytes ({size_name}) failed: "
                                   + "; ".join(problems))
            hosts = {p["host"] for p in peers}
            if len(hosts) != 1:
                self._free_own()
                raise RuntimeError(f"kernels over CUDA IPC (every normal-mode op, and low-latency ops of the nvlink "
                                   f"transport) need every rank on one node; ranks are on {sorted(hosts)} "
                                   f"(normal mode across nodes is not implemented yet)")
            sizes = {p["nbytes"] for p in peers}
            if len(sizes) != 1:
                self._free_own()
                raise ValueError(f"every rank must create its Buffer with the same {size_name}; got {sorted(sizes)}")
            kinds = {p["shareable"] for p in peers}
            if len(kinds) != 1:
                self._free_own()
                raise ValueError("ranks disagree on the window's memory ("
                                 + (f"{self.legacy_switch} must be the same on every rank)" if self.legacy_switch
                                    else "every rank must ask for the same kind)"))
            self._cap_blocks(me["uuid"], [p["uuid"] for p in peers])
            self._opened: List[int] = []
            self.errors: Optional[MappedWords] = None
            bases = [self.base if r == ctx.rank else 0 for r in range(len(peers))]
            if shareable:
                self._map_shared(peers, fd, bases)
        finally:
            if fd >= 0:
                os.close(fd)
        self._finish(peers, bases)

    def _finish(self, peers: list, bases: List[int]) -> None:
        """The window's last steps (legacy IPC: opening every peer's handle), then the barrier before any kernel
        runs: every peer has mapped everyone's zeroed window. The barrier is an agreement, so a step that fails
        on one rank (a peer's handle that will not open, no memory left for the small tensors) is told to every
        rank, which unmaps and frees its window and raises naming that rank, instead of waiting for it."""
        from .. import _C

        ctx, problem = self.ctx, None
        try:
            if not self.shareable:
                for r, p in enumerate(peers):
                    if r != ctx.rank:
                        bases[r] = _C.ipc_open_mem_handle(self.dev, p["handle"])
                        self._opened.append(bases[r])
            self.bases = bases
            self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=ctx.device)
            self.errors = MappedWords(self.dev, ERROR_WORDS)
            _synchronize(self.dev)
        except Exception as e:   # noqa: BLE001 - raised on every rank below
            problem = rank_problem(ctx.rank, e)
        problems = agreed_problems(ctx.comm, problem)
        if problems:
            self._release()
            raise RuntimeError("mapping the peers' windows failed: " + "; ".join(problems))

    def _map_shared(self, peers: list, fd: int, bases: List[int]) -> None:
        """Receive every peer's descriptor and map its window (fills `bases`). Collective, and so are its
        failures: every rank learns whether all succeeded, and on failure frees what it mapped and its
        own window and raises with every rank's reason (no rank is left waiting in a later collective)."""
        from .. import _C

        ctx, problem = self.ctx, None
        fds: List[Optional[int]] = [None] * len(peers)
        try:
            # The tag: rank 0's random nonce (the same on every rank, unguessable by other processes).
            if len(peers) > 1:
                fds = exchange_fds(ctx.comm, ctx.rank, len(peers), fd, peers[0]["nonce"], ctx.timeout_s)
            for r in range(len(peers)):
                if r != ctx.rank:
                    bases[r] = _C.vmm_import(self.dev, fds[r], self.size)
                    self._opened.append(bases[r])
        except Exception as e:   # noqa: BLE001 - reported on every rank below
            problem = rank_problem(ctx.rank, e)
        finally:
            for got in fds:
                if got is not None:
                    os.close(got)
        problems = agreed_problems(ctx.comm, problem)
        if problems:
            self._release()
            raise RuntimeError("sharing the window as VMM memory by file descriptor failed: " + "; ".join(problems)
                               + (f" ({self.legacy_switch}=0 on every rank uses legacy CUDA IPC instead)"
                                  if self.legacy_switch else ""))

    def _free_own(self) -> None:
        from .. import _C

        if self.shareable:
            _C.vmm_free(self.dev, self.base, self.size)
        else:
            _C.mem_free(self.dev, self.base)
        self.base = None

    def close(self) -> None:
        """Collective: wait until no peer can still touch this window, then unmap and free."""
        if self.base is None:
            return
        _synchronize(self.dev)
        try:
            self.ctx.comm.barrier()
        finally:
            self._release()

    def _release(self) -> None:
        """Unmap every peer's window, free my own and the error record; the window no longer counts among the
        process's open ones (Window.grid)."""
        from .. import _C

        for b in self._opened:
            if self.shareable:
                _C.vmm_free(self.dev, b, self.size)
            else:
                _C.ipc_close_mem_handle(self.dev, b)
        self._opened = []
        self._free_own()
        if self.errors is not None:
            self.errors.free()
        self._stop_counting()
