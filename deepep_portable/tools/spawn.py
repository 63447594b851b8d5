"""Run a function on N ranks: under torchrun / mpirun / srun as they are (on one host or many), or by
spawning N ranks on this host.

Each rank gets a torch ProcessGroup: NCCL when every rank has a GPU of its own, else gloo (ranks
sharing one GPU, or no GPU; the reference transport stages CUDA tensors through the host then).
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import launch_env


def launched_rank_world() -> Optional[tuple]:
    """(rank, world) when started by torchrun, mpirun (Open MPI, MPICH) or srun, else None."""
    info = launch_env.read_launch()
    return None if info is None else (info.rank, info.world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, timeout: Optional[datetime.timedelta] = None) -> dist.ProcessGroup:
    """Pick the device for this rank and start the process group.

    Under a launcher (launch_env) the device is the local rank's, and the rendezvous and the gloo
    interface come from launch_env.prepare_torch_env, so a job spanning hosts forms its group; spawned
    ranks (run_local) are all on this host and rendezvous on MASTER_ADDR/MASTER_PORT as set."""
    info = launch_env.read_launch()
    if info is not None and (info.rank, info.world_size) != (rank, world):
        info = None   # the caller numbers ranks its own way: trust its numbers, not the launcher's
    local_rank = info.local_rank if info is not None and info.local_rank is not None else rank
    local_size = info.local_size if info is not None and info.local_size is not None else world
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # NCCL needs a GPU per rank: count this host's ranks against this host's GPUs
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_size else "gloo"
    if not dist.is_initialized():
        if info is not None:
            launch_env.prepare_torch_env()
        elif "MASTER_PORT" not in os.environ:
            raise RuntimeError("MASTER_PORT is not set")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        extra = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, rank=rank, world_size=world, **extra)
    return dist.group.WORLD


def _spawned(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    watchdog = float(os.environ.get("DEEPEP_PORTABLE_WATCHDOG_S", "0"))
    if watchdog > 0:   # debugging aid: print every thread's stack and exit if the rank is stuck
        import faulthandler

        faulthandler.dump_traceback_later(watchdog, exit=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    group = init_group(rank, world)
    try:
        fn(rank, world, group, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_local(fn: Callable, num_ranks: int, *args) -> None:
    """Call fn(rank, world, group, *args) on every rank; spawn num_ranks processes if not launched."""
    launched = launched_rank_world()
    if launched is not None:
        rank, world = launched
        created = not dist.is_initialized()
        group = init_group(rank, world)
        fn(rank, world, group, *args)
        if created:
            # no gloo threads left running at exit (they abort the process under mpirun); only after
            # success: after an error the launcher ends the job, where a barrier could wait for ever
            dist.barrier()
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(num_ranks, _free_port(), fn, args), nprocs=num_ranks, join=True)
