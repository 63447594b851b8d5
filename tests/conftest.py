"""Fixtures shared by the single-process tests (tests/mpi/conftest.py has the multi-rank ones)."""
import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def one_rank_group():
    """The default process group as a one-rank gloo group (created on first use)."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a one-rank default group")
    return dist.group.WORLD
