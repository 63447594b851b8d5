"""Run a function on N local ranks: under torchrun / mpirun as they are, or by spawning them.

Each rank gets a torch ProcessGroup: NCCL when every rank has a GPU of its own, else gloo (ranks
sharing one GPU, or no GPU; the reference transport stages CUDA tensors through the host then).
"""
from __future__ import annotations

import os
import socket
from typing import Callable, Optional

import torch
import torch.distributed as dist


def launched_rank_world() -> Optional[tuple]:
    """(rank, world) when started by torchrun or mpirun, else None."""
    for rank_key, world_key in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_key in os.environ and world_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[world_key])
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int) -> dist.ProcessGroup:
    """Pick the device for this rank and start the process group."""
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        if "MASTER_PORT" not in os.environ:
            if launched_rank_world() is not None and "OMPI_COMM_WORLD_RANK" in os.environ:
                from mpi4py import MPI

                os.environ["MASTER_PORT"] = str(MPI.COMM_WORLD.bcast(_free_port() if rank == 0 else None, root=0))
            else:
                raise RuntimeError("MASTER_PORT is not set")
        dist.init_process_group(backend, rank=rank, world_size=world)
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
        group = init_group(rank, world)
        fn(rank, world, group, *args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(num_ranks, _free_port(), fn, args), nprocs=num_ranks, join=True)
