"""The nccl_gin window: a communicator of the Buffer's ranks (NCCL unique id over the group), the window from
ncclMemAlloc registered with ncclCommWindowRegister, the device communicator for it (LSA only on one node: no
GIN resource is asked for, so a node without a NIC works; GIN when the ranks span nodes), and the tables
csrc/backends/nccl_gin/device.cuh reads (the SET-signal shadow, the failure word, scratch for GIN reads past
the engines' bytes). Kernels are compiled against the loaded libnccl's own headers (host.py's version gate).

The communicator: the torch NCCL group's own when that is safe (torch_comm.py; `comm_source` says which), else
one from a unique id over the group. Not done yet: logical nodes (the device code cannot hide LSA peers).
NCCL refuses two ranks on one GPU before 2.30 (and from 2.30 without NCCL_MULTI_RANK_GPU_ENABLE=1): that is
refused here with that reason, before NCCL is asked.
Peer addresses come from the device (engines/peer_bases.py): NCCL before 2.29 has no host lookup.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from typing import Optional

import torch

from ... import jit
from ...contract import BufferContext
from ...device import device_index, device_uuid
from ...engines.peer_bases import peer_bases
from ...windows.base import ERROR_WORDS, MappedWords, Window, agreed_problems, rank_problem
from .. import libraries
from .abi import NCCL_GIN_BUILD, SCRATCH_WORDS, NcclGinTransportParams, SignalShadowParams, build_flags
from .host import HostLib, Request
from .options import PASS_THROUGH, apply_environment
from .torch_comm import collective_choice, local_candidate, still_owned

WIN_STRICT_ORDERING = 0x02   # nccl.h NCCL_WIN_STRICT_ORDERING: GIN VA signals need it
ALIGN = 4096                 # NCCL_WIN_REQUIRED_ALIGNMENT
SHADOW_CAPACITY = 1 << 16    # (peer, signal word) pairs one rank can SET over GIN


def _check(host: HostLib, rc: int, what: str, comm=None) -> None:
    if rc != 0:
        last = host.lib.dgin_last_error(comm).decode() if comm else ""
        raise RuntimeError(f"nccl_gin: {what} failed: {host.error(rc)}{': ' + last if last else ''}")


class NcclGinWindow(Window):
    build = NCCL_GIN_BUILD
    cheap_fetch_add = False
    remote_atomics = False   # no fetching atomic over GIN

    def __init__(self, ctx: BufferContext, nbytes: int, channels: int = 1, options: Optional[dict] = None) -> None:
        from ... import _C

        options = dict(options or {})
        self.ctx, self.dev, self.base = ctx, device_index(ctx.device), None
        torch.zeros(1, device=ctx.device)   # the device's primary context is current on this thread
        me = device_uuid(self.dev)
        uuids = ctx.comm.allgather_object(me)
        if len(set(uuids)) < len(uuids) and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            raise RuntimeError("nccl_gin: ranks of this group share a GPU, which NCCL refuses (NCCL >= 2.30 allows two "
                               "with NCCL_MULTI_RANK_GPU_ENABLE=1)")
        apply_environment(options)   # before the communicator: NCCL reads its environment at the first init
        host = self.host = HostLib()
        version = host.check_versions()
        self.flags = build_flags(libraries.nccl_info()["device_header"])
        self.defines = {"DEEPEP_NCCL_RUNTIME": version}   # keys the JIT cache by the library's version too
        self.gin = ctx.num_nodes > 1 if options.get("gin") is None else bool(options["gin"])
        lib = host.lib
        self.comm, self.owns_comm, self._group = ctypes.c_void_p(), True, None
        reuse, self.comm_source = self._torch_comm(options, version)
        if reuse:
            self.comm, self.owns_comm = ctypes.c_void_p(reuse), False
        else:
            uid = ctypes.create_string_buffer(lib.dgin_unique_id_size())
            if ctx.rank == 0:
                _check(host, lib.dgin_get_unique_id(uid), "ncclGetUniqueId")
            uid_bytes = ctx.comm.allgather_object(uid.raw if ctx.rank == 0 else None)[0]
            _check(host, lib.dgin_comm_init_rank(ctypes.byref(self.comm), ctx.num_ranks, uid_bytes, ctx.rank),
                   "ncclCommInitRank")
        self._mem = ctypes.c_void_p()
        self._win = ctypes.c_void_p()
        self._devcomm = None
        try:
            self.scratch_offset = (nbytes + ALIGN - 1) // ALIGN * ALIGN
            total = (self.scratch_offset + 8 * SCRATCH_WORDS + ALIGN - 1) // ALIGN * ALIGN
            # A failed allocation (out of memory, most often) is told to the peers before the registration, a
            # collective of NCCL's in which they would otherwise wait for this rank for good.
            problem = None
            try:
                _check(host, lib.dgin_mem_alloc(ctypes.byref(self._mem), total), "ncclMemAlloc")
                _C.memset_d8_async(self.dev, self._mem.value, 0, total, 0)
                _C.stream_synchronize(self.dev, 0)
            except Exception as e:   # noqa: BLE001 - raised on every rank below
                problem = rank_problem(ctx.rank, e)
            problems = agreed_problems(ctx.comm, problem)
            if problems:
                raise RuntimeError(f"nccl_gin: allocating the window of {nbytes} bytes (num_rdma_bytes) failed: "
                                   + "; ".join(problems))
            flags = WIN_STRICT_ORDERING if self.gin else 0
            _check(host, lib.dgin_window_register(self.comm, self._mem, total, flags,
                                                  ctypes.byref(self._win)), "ncclCommWindowRegister", self.comm)
            if not self._win.value:
                raise RuntimeError("nccl_gin: ncclCommWindowRegister gave no window (no symmetric memory support "
                                   "here: needs cuMem and peer access between the ranks' GPUs)")
            req = Request(lsa_barriers=1, gin=self.gin, gin_contexts=max(1, int(channels))).struct()
            self._devcomm = ctypes.create_string_buffer(lib.dgin_devcomm_size())
            why = ctypes.create_string_buffer(256)
            rc = lib.dgin_devcomm_create(self.comm, ctypes.byref(req), ctypes.addressof(self._devcomm),
                                         len(self._devcomm), why, 256)
            if rc != 0:
                self._devcomm = None
                raise RuntimeError(f"nccl_gin: ncclDevCommCreate failed: {why.value.decode() or host.error(rc)}")
            info = (ctypes.c_int * 5)()
            lib.dgin_devcomm_info(ctypes.addressof(self._devcomm), info)
            self.lsa_rank, self.lsa_size, self.gin_contexts = info[2], info[3], info[4] if self.gin else 0
            if self.gin and self.gin_contexts == 0:
                raise RuntimeError("nccl_gin: GIN was asked for but the device communicator has no GIN context "
                                   "(no GIN-capable NIC or plugin here)")
            self.devcomm = torch.frombuffer(bytearray(self._devcomm.raw), dtype=torch.uint8).to(ctx.device)
            self.lsa_first = ctx.rank - self.lsa_rank   # ncclTeamLsa: stride 1, so the team is contiguous
            self.lsa_team = list(range(self.lsa_first, self.lsa_first + self.lsa_size))
            self.base, self.size = self._mem.value, nbytes
            self._device_tables(ctx.device)
            # NCCL gives LSA addresses on the device only before 2.29: ask the device, so host and kernels agree.
            self.bases = peer_bases(self, ctx.num_ranks, ctx.device)
            # (My own entry is NCCL's LSA mapping of my window: another address of the same memory as `base`.)
            if [r for r, b in enumerate(self.bases) if b] != self.lsa_team:
                raise RuntimeError(f"nccl_gin: the device reports load/store addresses for ranks "
                                   f"{[r for r, b in enumerate(self.bases) if b]}, expected the LSA team "
                                   f"{self.lsa_team}")
            self.peer_bases = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
            self._cap_blocks(me, uuids)
            self.errors = MappedWords(self.dev, ERROR_WORDS)
            torch.cuda.synchronize(self.dev)
            ctx.comm.barrier()
        except BaseException:
            self._release()
            raise

    def _torch_comm(self, options: dict, version: int):
        """(torch's communicator pointer or 0, where the window's communicator comes from): collective. The same
        options and torch on every rank take the same branches up to the allgather."""
        if options.get("reuse_torch_comm", True) is False:
            return 0, "our own (nccl_options reuse_torch_comm=False)"
        given = sorted(k for k, v in options.items() if k in PASS_THROUGH and v is not None)
        if given:   # torch made its communicator with its own environment
            return 0, f"our own (nccl_options {given} must reach NCCL before its communicator is made)"
        ctx = self.ctx
        group = ctx.comm.raw if isinstance(ctx.comm.raw, torch.distributed.ProcessGroup) else None

        def warm_up() -> None:   # torch makes the communicator at the group's first collective
            torch.distributed.all_reduce(torch.zeros(1, device=ctx.device), group=group)
            torch.cuda.synchronize(ctx.device)

        mine = local_candidate(group, ctx.device, libraries.nccl_info()["lib"], version, warm_up)
        reuse, why = collective_choice(ctx.comm.allgather_object(mine))
        self._group = group
        return (mine[0] if reuse else 0), (why if reuse else f"our own ({why})")

    def _device_tables(self, device) -> None:
        """What device.cuh keeps besides the window: the SET-signal shadow, the failure word, the scratch ticket."""
        self.shadow_keys = torch.zeros(SHADOW_CAPACITY, dtype=torch.int64, device=device)
        self.shadow_values = torch.zeros(SHADOW_CAPACITY, dtype=torch.int64, device=device)
        self.failure = torch.zeros(3, dtype=torch.int32, device=device)
        self.scratch_ticket = torch.zeros(1, dtype=torch.int32, device=device)

    def kernel(self, source: str, name: str, defines: dict):
        if self._kernels is None:
            self._kernels = jit.KernelCache(self.dev)
        return self._kernels.get(source, name, self.build.kernel_defines({**defines, **self.defines}),
                                 (*self.build.flags, *self.flags))

    def transport_params(self) -> NcclGinTransportParams:
        shadow = SignalShadowParams(self.shadow_keys.data_ptr(), self.shadow_values.data_ptr(), SHADOW_CAPACITY)
        return NcclGinTransportParams(
            comm=self.devcomm.data_ptr(), win=self._win.value, base=self.base, rank=self.ctx.rank,
            num_ranks=self.ctx.num_ranks, gin_contexts=self.gin_contexts, lsa_first=self.lsa_first,
            lsa_size=self.lsa_size, pad=0, shadow=shadow,
            scratch_offset=self.scratch_offset, scratch_ticket=self.scratch_ticket.data_ptr(),
            failure=self.failure.data_ptr())

    def node_transport_params(self, node_ranks) -> NcclGinTransportParams:
        """The internode kernels reach node peers by load/store: here that is exactly my LSA team (the device code
        cannot hide an LSA peer, so logical nodes smaller than it are refused)."""
        if sorted(node_ranks) != self.lsa_team:
            raise ValueError(f"nccl_gin: the node {sorted(node_ranks)} is not this rank's LSA team {self.lsa_team} "
                             f"(logical nodes on one machine need transport='nvshmem')")
        return self.transport_params()

    def _release(self) -> None:
        lib = self.host.lib
        if self.comm.value and not self.owns_comm and not still_owned(self._group, self.ctx.device, self.comm.value):
            # torch destroyed or aborted the communicator first (destroy_process_group before Buffer.destroy, or
            # its watchdog): NCCL calls on it would touch freed memory. Leak the registration instead.
            warnings.warn("nccl_gin: torch released the NCCL communicator this Buffer borrowed before the Buffer "
                          "was destroyed; its window registration is leaked (destroy Buffers first)")
            self._devcomm, self._win = None, ctypes.c_void_p()   # the memory itself is ours: freed below
        if self._devcomm is not None:
            lib.dgin_devcomm_destroy(self.comm, ctypes.addressof(self._devcomm))
            self._devcomm = None
        if self._win.value:
            lib.dgin_window_deregister(self.comm, self._win)   # collective
            self._win = ctypes.c_void_p()
        if self._mem.value:
            lib.dgin_mem_free(self._mem)
            self._mem = ctypes.c_void_p()
        if self.comm.value and self.owns_comm:   # a reused communicator is torch's
            lib.dgin_comm_destroy(self.comm)
        self.comm = ctypes.c_void_p()

    def close(self) -> None:
        """Collective: nobody uses the window any more, then NCCL releases it."""
        self._close_after_peers(self._release)
