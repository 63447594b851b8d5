"""Shared fixtures for tests run under mpirun (`mpirun -n N python -m pytest --with-mpi tests/mpi`).

- `mpi_comm`: MPI.COMM_WORLD.
- `pg`: one gloo ProcessGroup over the same ranks for the whole session (rank 0 picks a free port
  and broadcasts it over MPI).
- `device`: cuda:<local rank % GPUs> when CUDA is available, else cpu.
- `base_seed`: a fresh random seed per run (or $DEEPEP_TEST_SEED), the same on every rank; tests
  derive per-rank, per-test seeds from it and print it so a failure can be replayed.
- DEEPEP_TEST_IBGDA_MODEL=1: the tests' NIC model (tests/ibgda_model.py) is the ibgda backend's provider for
  the whole session, so the suites run over transport="ibgda" without a NIC (DEEPEP_TEST_LL_TRANSPORT=ibgda,
  DEEPEP_TEST_INTERNODE_TRANSPORT=ibgda).
- DEEPEP_TEST_NCCL_GIN_MOCK=1: Buffer(..., transport="nccl_gin") gets the tests' mock of NCCL's device API
  (tests/nccl_gin_mock.py) for the whole session: the low-latency suite over the nccl_gin device code with
  every peer behind "GIN", ranks sharing a GPU (DEEPEP_TEST_LL_TRANSPORT=nccl_gin).
"""
from __future__ import annotations

import datetime
import os
import random
import socket
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/ (oracle)


@pytest.fixture(scope="session")
def mpi_comm():
    mpi4py = pytest.importorskip("mpi4py")
    from mpi4py import MPI  # noqa: F401

    return mpi4py.MPI.COMM_WORLD


@pytest.fixture(scope="session")
def device(mpi_comm):
    if torch.cuda.is_available():
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", mpi_comm.Get_rank()))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(scope="session")
def pg(mpi_comm, device):
    if not dist.is_initialized():
        port = None
        if mpi_comm.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = mpi_comm.bcast(port, root=0)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=mpi_comm.Get_rank(),
                                world_size=mpi_comm.Get_size(), timeout=datetime.timedelta(seconds=120))
    return dist.group.WORLD


@pytest.fixture(scope="session")
def base_seed(mpi_comm):
    seed = int(os.environ["DEEPEP_TEST_SEED"]) if "DEEPEP_TEST_SEED" in os.environ else random.randrange(1 << 30)
    seed = mpi_comm.bcast(seed, root=0)
    print(f"\n[tests/mpi] base seed {seed} (replay with DEEPEP_TEST_SEED={seed})")
    return seed


@pytest.fixture(scope="session", autouse=True)
def ibgda_nic_model():
    if os.environ.get("DEEPEP_TEST_IBGDA_MODEL") != "1":
        yield
        return
    import ibgda_model
    from deepep_portable.transports.ibgda import provider

    provider.install(lambda ctx: ibgda_model.ModelProvider(ctx))
    yield
    provider.install(None)


@pytest.fixture(scope="session", autouse=True)
def nccl_gin_mock():
    if os.environ.get("DEEPEP_TEST_NCCL_GIN_MOCK") != "1":
        yield
        return
    import nccl_gin_mock as mock

    with mock.installed():
        yield
