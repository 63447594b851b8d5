"""The ibgda backend's GPU posting at its edges, against the tests' NIC model, under mpirun
with ranks sharing a GPU:

  mpirun -n 4 python -m pytest --with-mpi -q tests/mpi/test_ibgda_gpu_mpi.py

* Wrap-around: queues of 16 WQEBBs carry the conformance kernel for thousands of rounds, so every queue's ring
  wraps thousands of times and its 16-bit WQE index (and the collapsed CQ's 16-bit counter) wraps past 65536
  posts; every round is checked as in the conformance test, and the posters' counters show how far they went.
* Error completion: one rank's queue to its next peer names a wrong rkey; the GPU poster's WQE comes back as
  an error CQE (remote access error, syndrome 0x13; on a collapsed CQ the later WQEs' flush entries, syndrome
  0x05, may overwrite it before the poster reads it) that the kernel records and the host turns into an error
  naming the op, the rank, the peer, the channel and the syndrome, never a hang.
Skipped without CUDA or with fewer than 2 ranks. Not run on a GPU yet.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from deepep_portable import errors
from deepep_portable.comm import Comm
from deepep_portable.contract import BufferContext
from deepep_portable.engines.transport_selftest import TransportSelftest, window_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ibgda_model  # noqa: E402

DEPTH = 16


def _window(mpi_comm, pg, device, bytes_per_put=256):
    from deepep_portable.transports.ibgda.window import IbgdaWindow

    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    torch.zeros(1, device=device)   # the device's primary context is current on this thread
    ctx = BufferContext(comm=Comm(pg), rank=rank, num_ranks=size, device=device, num_nvl_bytes=0, num_rdma_bytes=0,
                        low_latency_mode=True, uid=-5, timeout_s=30.0)
    provider = ibgda_model.ModelProvider(ctx)
    return ctx, provider, IbgdaWindow(ctx, window_bytes(size, bytes_per_put), depth=DEPTH, provider=provider)


def _skip(mpi_comm):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if mpi_comm.Get_size() < 2:
        pytest.skip("needs >= 2 ranks")


@pytest.mark.mpi(min_size=2)
def test_rings_and_wqe_index_wrap_on_the_gpu(mpi_comm, pg, device):
    _skip(mpi_comm)
    ctx, provider, window = _window(mpi_comm, pg, device)
    try:
        test = TransportSelftest(ctx, window, bytes_per_put=256, rounds=12000, timeout_s=60.0)
        verdict = test.verdict(ctx.comm.allgather_object(test.run()))
        # The posters' own words (reserve, turn, completed) of every queue: how many WQEs each one carried.
        posted = [int(words.cpu()[0]) for words in provider.queue_memory[1::2]]
    finally:
        window.close()
    assert not verdict, verdict
    assert provider.problems == 0, f"the NIC model saw {provider.problems} rule(s) broken by the GPU posters"
    assert max(posted) > 65536, f"the busiest queue carried {max(posted)} WQEs: the 16-bit index did not wrap"


@pytest.mark.mpi(min_size=2)
def test_an_error_completion_becomes_an_error_naming_the_queue(mpi_comm, pg, device):
    _skip(mpi_comm)
    ctx, provider, window = _window(mpi_comm, pg, device)
    size, rank = ctx.num_ranks, ctx.rank
    bad_peer = (rank + 1) % size
    try:
        test = TransportSelftest(ctx, window, bytes_per_put=256, rounds=2, timeout_s=3.0)
        assert not test.verdict(ctx.comm.allgather_object(test.run()))   # healthy first
        index = bad_peer * window.channels
        window.endpoint_structs[index].rkey = size + 7   # a key no rank registered
        window.endpoints.copy_(torch.frombuffer(bytearray(bytes(window.endpoint_structs)), dtype=torch.uint8))
        record = test.run()["error"]
    finally:
        window.close()
    codes, ops = errors.table()
    assert record[0] == codes["nic"] and ops[record[1]] == "transport_selftest", record
    assert tuple(record[2:5]) == (rank, bad_peer, 0) and record[5] in (0x13, 0x05), record
    message = str(errors.from_record(record, 3.0))
    assert f"rank {rank}" in message and f"peer {bad_peer} (channel 0)" in message
    assert f"syndrome {record[5]:#x}" in message
