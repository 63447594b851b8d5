"""Ranks that disagree on a Buffer's symmetric arguments (sizes, mode, queues, transport) all get the same clear
ValueError before anything is set up, and a correct Buffer on the same group works afterwards. Reference transport, so it runs on CPU in CI.

  mpirun -n 4 python -m pytest --with-mpi -q tests/mpi/test_buffer_agreement_mpi.py"""
from __future__ import annotations

import pytest
import torch

import deepep_portable as deep_ep
from test_reference_mpi import SMALL, generator, run_normal, world

NVL = 1 << 20


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("arg,values", [("num_nvl_bytes", (NVL, 2 * NVL)), ("num_rdma_bytes", (0, 1 << 20)),
                                        ("low_latency_mode", (False, True)), ("num_qps_per_rank", (24, 8))])
def test_disagreeing_ranks_all_raise_then_a_good_buffer_works(pg, device, request, base_seed, arg, values):
    rank, _ = world(pg)
    kwargs = dict(num_nvl_bytes=NVL, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24)
    kwargs[arg] = values[1] if rank == 1 else values[0]
    with pytest.raises(ValueError, match=f"ranks disagree on Buffer arguments .*{arg}: rank 0 .*rank 1 "):
        deep_ep.Buffer(pg, transport="reference", **kwargs)
    buf = deep_ep.Buffer(pg, NVL, 0, transport="reference")
    gen = generator(request, base_seed, rank)
    run_normal(buf, pg, gen, device, **SMALL, num_tokens=int(torch.randint(1, 9, (1,), generator=gen)))
