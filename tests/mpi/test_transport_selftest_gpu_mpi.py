"""Conformance of every backend to the transport contract, on GPUs, under mpirun (several ranks may
share one GPU under MPS):

  mpirun -n 2 python -m pytest --with-mpi -q tests/mpi/test_transport_selftest_gpu_mpi.py

For each backend with a window (the registry's kernel transports), the conformance kernel
(csrc/common/kernels/transport_selftest.cu, host side engines/transport_selftest.py) runs on that
backend's window: every primitive, each ordering promise, fetch_add atomicity, get_value, peer_ptr,
flush (a put still reading a poisoned source would be caught), twice in a row (signals keep growing),
then a wait on a word nobody writes must time out with an error record naming the peer. The NVSHMEM
backend runs once more with its load/store table withheld, so NVSHMEM's own routines (puts,
put-with-signal, signal_op, AMOs, gets, quiet) carry the traffic between P2P peers too. The ibgda backend
runs over the tests' NIC model (tests/ibgda_model.py): its device code posts WQEs that a host thread per
process executes against every rank's window (passed at 4 ranks on the H200). The nccl_gin
backend also runs over the tests' mock of NCCL's device API (tests/nccl_gin_mock.py), every peer through its
GIN branches (not run on a GPU yet).
Skipped without CUDA, with fewer than 2 ranks, or where the backend's probe says it cannot run.
Collectives never meet a rank that failed alone: set-up errors are agreed over MPI first, every wait in
the kernel has a deadline, and results are exchanged before any assert.
"""
from __future__ import annotations

import os

import pytest
import torch

from deepep_portable import errors
from deepep_portable.comm import Comm
from deepep_portable.contract import BufferContext
from deepep_portable.engines.transport_selftest import TransportSelftest, window_bytes
from deepep_portable.transports import available_transports, backend_class, registry

KERNEL_BACKENDS = [b.name for b in registry.BACKENDS if b.module is not None and b.name != "reference"]
# Backends' device code driven against the tests' stand-ins, with the fixture that installs each: ibgda against
# the NIC model (tests/ibgda_model.py) instead of a NIC, nccl_gin against the mock of NCCL's device API
# (tests/nccl_gin_mock.py: every peer through its GIN branches, ranks sharing a GPU allowed).
MODEL_RUNS = {"ibgda-model": "nic_model", "nccl_gin-mock": "gin_mock"}


def _skip_reason(size: int, backend: str, mock: bool = False):
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if size < 2:
        return "needs >= 2 ranks (mpirun -n 2)"
    if mock:
        return None
    shared = torch.cuda.device_count() < size and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1"
    if backend == "nccl_gin" and shared:
        return "nccl_gin: ranks share a GPU, which NCCL refuses (tests/gpu/test_nccl_gin_gpu.py runs it at one rank)"
    status = available_transports()[backend]
    return None if status.usable else f"{backend}: {status.reason}"


@pytest.fixture
def nic_model():
    """The tests' NIC model installed as the ibgda backend's provider for one test."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ibgda_model

    with ibgda_model.installed():   # the session's model, when DEEPEP_TEST_IBGDA_MODEL=1 installed one, comes back
        yield


@pytest.fixture
def gin_mock():
    """The mock of NCCL's device API under the nccl_gin backend's windows, for one test."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import nccl_gin_mock

    with nccl_gin_mock.installed():
        yield


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS + list(MODEL_RUNS))
def test_backend_conforms_to_the_transport_contract(mpi_comm, pg, device, backend, request):
    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    mock = backend in MODEL_RUNS
    if mock:
        request.getfixturevalue(MODEL_RUNS[backend])
        backend = backend.split("-")[0]
    reasons = mpi_comm.allgather(_skip_reason(size, backend, mock))
    if any(reasons):
        pytest.skip(next(r for r in reasons if r))
    torch.zeros(1, device=device)   # the device's primary context is current on this thread
    ctx = BufferContext(comm=Comm(pg), rank=rank, num_ranks=size, device=device, num_nvl_bytes=0,
                        num_rdma_bytes=0, low_latency_mode=True, uid=-1, timeout_s=30.0)
    window = backend_class(backend).make_ll_window(ctx, window_bytes(size))   # collective
    verdicts, timeouts = [], []
    try:
        err = None
        try:   # compile + load, local: agreed before the first collective launch
            test = TransportSelftest(ctx, window)
        except Exception as e:  # noqa: BLE001
            err = f"rank {rank}: {type(e).__name__}: {e}"
        errs = [e for e in mpi_comm.allgather(err) if e]
        if errs:
            raise RuntimeError("self-test set-up failed: " + "; ".join(errs))
        runs = [None, None]
        if backend == "nvshmem":   # without the load/store table: NVSHMEM's routines between P2P peers
            t = window.transport_params()
            runs.append(type(t)(t.base, t.rank, t.num_ranks, 0))
        for transport in runs:
            verdicts.append(test.verdict(ctx.comm.allgather_object(test.run(transport))))
        timeouts = ctx.comm.allgather_object(test.run_timeout(peer=(rank + 1) % size))
    finally:
        window.close()   # collective

    for i, bad in enumerate(verdicts):
        assert not bad, f"{backend}, run {i}: {bad}"
    codes, ops = errors.table()
    op = {name: op_id for op_id, name in ops.items()}["transport_selftest"]
    for res in timeouts:
        r = res["rank"]
        assert res["timed_out"] == 1, f"rank {r}: the wait on a word nobody writes did not time out"
        assert res["error"] == (codes["timeout"], op, r, (r + 1) % size, 0, 1), res["error"]
        exc = errors.from_record(res["error"], 0.2)
        assert isinstance(exc, errors.CommTimeoutError) and f"waiting for peer {(r + 1) % size}" in str(exc)
