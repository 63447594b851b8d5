"""Shared fixtures for tests run under mpirun (`mpirun -n N python -m pytest --with-mpi tests/mpi`).

- `mpi_comm`: MPI.COMM_WORLD.
- `launch`: what the launcher told this process (deepep_portable.launch_env: rank, local rank, hosts).
- `pg`: one gloo ProcessGroup over the same ranks for the whole session: rank 0 picks a free port and
  broadcasts "address:port" over MPI; the address is 127.0.0.1 when the job is on one host, else rank
  0's routable address, and gloo gets this host's interface (launch_env.choose_interface), so the
  suite runs across hosts (docs/CLUSTER.md).
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

import dataclasses
import datetime
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist

from deepep_portable import launch_env

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/ (oracle)


@pytest.fixture(scope="session")
def mpi_comm():
    mpi4py = pytest.importorskip("mpi4py")
    from mpi4py import MPI  # noqa: F401

    return mpi4py.MPI.COMM_WORLD


@pytest.fixture(scope="session")
def launch(mpi_comm):
    """What the launcher told this process (launch_env); where it names no local rank (another MPI's
    mpiexec), MPI's own numbering of the ranks that share this host."""
    info = launch_env.read_launch()
    if info is None or (info.rank, info.world_size) != (mpi_comm.Get_rank(), mpi_comm.Get_size()):
        info = launch_env.LaunchInfo("mpi", mpi_comm.Get_rank(), mpi_comm.Get_size(), None, None)
    if info.local_rank is None or info.local_size is None:
        from mpi4py import MPI

        here = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        info = dataclasses.replace(info, local_rank=here.Get_rank(), local_size=here.Get_size())
    return info


@pytest.fixture(scope="session")
def device(launch):
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(scope="session")
def pg(mpi_comm, launch, device):
    if not dist.is_initialized():
        # one host: 127.0.0.1; several: rank 0's routable address, shared over MPI, and gloo on this
        # host's interface towards it
        address, port = launch_env.rendezvous(launch, mpi_comm=mpi_comm)
        launch_env.set_gloo_interface(launch, address)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=launch.rank,
                                world_size=launch.world_size, timeout=datetime.timedelta(seconds=120))
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

    with ibgda_model.installed():
        yield


@pytest.fixture(scope="session", autouse=True)
def nccl_gin_mock():
    if os.environ.get("DEEPEP_TEST_NCCL_GIN_MOCK") != "1":
        yield
        return
    import nccl_gin_mock as mock

    with mock.installed():
        yield
