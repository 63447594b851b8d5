"""The ibgda window's set-up (deepep_portable/transports/ibgda/window.py) between processes, with the tests'
NIC model as its provider (tests/ibgda_model.py), on CPU:

  mpirun -n 3 python -m pytest --with-mpi -q tests/mpi/test_ibgda_model_mpi.py

Every rank makes an IbgdaWindow (queues to every rank and channel, keys and QP numbers exchanged over the
group, queues connected), then, as the GPU would, posts through the endpoint table the device gets: a 4 KB
block to every peer (self included) and then a signal on the same queue, for several rounds and channels,
with the model's chaos on (a WRITE's pieces land in random order, the NIC stalls between WQEs); each rank
checks every block it was signalled for. A WRITE with a wrong rkey comes back as the model's error CQE
(syndrome 0x13). The model reports no rule broken by the posters (index, QPN, doorbell ahead of its record).
Skipped without nvcc (the model is a host library built with it)."""
from __future__ import annotations

import ctypes
import os
import sys
import time

import pytest
import torch

from deepep_portable.comm import Comm
from deepep_portable.contract import BufferContext
from deepep_portable.transports.ibgda.abi import EndpointParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ibgda_model  # noqa: E402

BLOCK = 4096
CHANNELS = 2
ROUNDS = 4
SIGNALS = 1 << 20   # signals at SIGNALS + 8 * (round * R + source), blocks below


def _build_or_skip(comm) -> str:
    ok, why = True, ""
    if comm.rank == 0:
        try:
            ibgda_model.build_library()
        except Exception as e:   # no nvcc, or the build failed: every rank learns it
            ok, why = False, f"{type(e).__name__}: {e}"
    ok, why = comm.allgather_object((ok, why))[0]
    if not ok:
        if "nvcc" in why.lower() and "not found" in why.lower():
            pytest.skip(why)
        pytest.fail(why)
    return ibgda_model.library_path()


def _ctx(comm, uid: int) -> BufferContext:
    return BufferContext(comm=comm, rank=comm.rank, num_ranks=comm.size, device=torch.device("cpu"),
                         num_nvl_bytes=0, num_rdma_bytes=2 << 20, low_latency_mode=True, uid=uid, timeout_s=30.0,
                         options={"num_qps_per_rank": CHANNELS})


def _pattern(source: int, dest: int, round_: int) -> bytes:
    return bytes((source * 31 + dest * 7 + round_ * 13 + i) % 251 for i in range(BLOCK))


@pytest.mark.mpi(min_size=2)
def test_window_setup_and_posting_through_the_model(mpi_comm):
    from deepep_portable.transports.ibgda.window import IbgdaWindow

    comm = Comm(comm=mpi_comm)
    _build_or_skip(comm)
    R, me = comm.size, comm.rank
    ctx = _ctx(comm, 7001)
    provider = ibgda_model.ModelProvider(ctx, chaos=True)
    window = IbgdaWindow(ctx, 2 << 20, channels=CHANNELS, depth=16, provider=provider)
    failures = []
    try:
        # The endpoint table the device gets: my queue to (peer, channel), the peer's window and key, my key.
        for p in range(R):
            for ch in range(CHANNELS):
                e = window.endpoint(p, ch)
                if (e.raddr_base, e.rkey, e.lkey) != (window.peers[p].base, p + 1, me + 1) or e.q.depth != 16:
                    failures.append(f"endpoint ({p}, {ch}): {e.raddr_base:#x} {e.rkey} {e.lkey} depth {e.q.depth}")
        raw = window.endpoints.numpy().tobytes()
        if raw != bytes(window.endpoint_structs) or len(raw) != R * CHANNELS * ctypes.sizeof(EndpointParams):
            failures.append("the device copy of the endpoint table differs from the host's")
        mine = window.mem.base
        staging = (ctypes.c_char * BLOCK).from_address(mine + (1 << 19))
        for round_ in range(ROUNDS):
            for p in range(R):
                staging[:] = _pattern(me, p, round_)
                rc = provider.lib.nms_post_write_signal(window.endpoint_address(p, round_ % CHANNELS), mine + (1 << 19),
                                                        BLOCK * me, BLOCK, SIGNALS + 8 * (round_ * R + me), round_ + 1,
                                                        30.0)
                if rc != 0:
                    failures.append(f"round {round_}: post to rank {p} returned {rc}")
            # Each source's signal in my window says its block is there (the queue kept data before signal).
            for s in range(R):
                word = ctypes.c_uint64.from_address(mine + SIGNALS + 8 * (round_ * R + s))
                deadline = time.monotonic() + 30
                while word.value != round_ + 1 and time.monotonic() < deadline:
                    time.sleep(0.0005)
                if word.value != round_ + 1:
                    failures.append(f"round {round_}: no signal from rank {s}")
                elif ctypes.string_at(mine + BLOCK * s, BLOCK) != _pattern(s, me, round_):
                    failures.append(f"round {round_}: rank {s}'s block differs")
            comm.barrier()   # nobody overwrites a block before its reader checked it
        # A wrong rkey: the model's NIC answers with an error CQE on that queue (the last use of the queue). One
        # WQE only (a signal, no data): a later WQE's WR_FLUSH entry could overwrite the error on a collapsed CQ.
        bad = EndpointParams.from_buffer_copy(window.endpoint((me + 1) % R, 0))
        bad.rkey = R + 5
        rc = provider.lib.nms_post_write_signal(ctypes.addressof(bad), mine + (1 << 19), 0, 0, SIGNALS, 1, 30.0)
        if rc != 0x13:
            failures.append(f"a WRITE with a bad rkey returned {rc:#x}, not the remote access error 0x13")
    finally:
        comm.barrier()
        window.close()
    if provider.problems:
        failures.append(f"the NIC model saw {provider.problems} rule(s) broken by the posters")
    everyone = comm.allgather_object(failures)
    assert not any(everyone), everyone


@pytest.mark.mpi(min_size=2)
def test_node_table_maps_the_peers_windows(mpi_comm):
    """node_transport_params: load/store addresses for the node's ranks (where the provider maps them) and 0
    for every other; transport_params: every peer through the NIC."""
    from deepep_portable.transports.ibgda.window import IbgdaWindow

    comm = Comm(comm=mpi_comm)
    _build_or_skip(comm)
    R, me = comm.size, comm.rank
    ctx = _ctx(comm, 7002)
    provider = ibgda_model.ModelProvider(ctx, load_store=True)
    window = IbgdaWindow(ctx, 1 << 16, channels=1, depth=8, provider=provider)
    try:
        node = [r for r in range(R) if r // 2 == me // 2]
        params = window.node_transport_params(node)
        table = (ctypes.c_int64 * R).from_address(params.peer_bases)
        got = list(table)
        want = [provider.local_address(r) if r in node else 0 for r in range(R)]
        plain = list((ctypes.c_int64 * R).from_address(window.transport_params().peer_bases))
        ok = got == want and plain == [0] * R and params.channels == 1 and params.rank == me
        ok = ok and params.scratch_offset >= (1 << 16) and params.num_ranks == R
        # `bases` says what transport_params' table holds (the self-test checks peer_ptr against it): nothing;
        # node_base offers the mapping to the internode kernels.
        ok = ok and window.bases == [0] * R and [window.node_base(r) for r in range(R)] == [
            provider.local_address(r) for r in range(R)]
    finally:
        window.close()
    everyone = comm.allgather_object((ok, got, want))
    assert all(o for o, _, _ in everyone), everyone
