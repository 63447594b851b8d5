"""Node peers of the ibgda backend on a GPU, under mpirun (ranks may share one GPU under MPS):

  mpirun -n 4 python -m pytest --with-mpi -q tests/mpi/test_ibgda_node_peers_gpu_mpi.py

Two logical nodes (ranks_per_node = half the ranks; 1 at two ranks, so each rank's node is itself).

1. The mlx5 DevX provider's own node mapping between processes: the provider over the fake of its C glue
   (tests/test_ibgda_devx.py: no NIC is touched), its window in node-shared memory over real CUDA IPC
   (node_memory.CudaIpcMemory). Every rank stores through its mapping of each node peer's window from the GPU,
   and each window holds what its node peers stored; QPs are made to the other node's ranks only (to every
   rank, self included, with allow_nvlink_for_low_latency_mode=False); everything is released.
2. The low-latency ops over the tests' NIC model (tests/ibgda_model.py, declaring the node mapping it makes
   between logical nodes), checked against the oracle, then the WQE basic blocks each of my queues posted
   (sq.cuh's reserve word): with the option on, my node's ranks (me included) have no queue and every other
   rank's queues carried traffic; with it off, every rank's queues did, my node's too.

Skipped without CUDA or with fewer than 2 ranks; the second also where the NIC model cannot be built. Collectives
never meet a rank that failed alone: results are exchanged before any assert."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tests/mpi
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/

import deepep_portable as deep_ep  # noqa: E402
from deepep_portable.comm import Comm  # noqa: E402
from deepep_portable.contract import BufferContext  # noqa: E402
from deepep_portable.windows.base import _DeviceRange  # noqa: E402

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="node peers are mapped by CUDA IPC: a GPU")]

C = 2   # channels (queues per peer)


def _layout(size: int) -> int:
    """Ranks per node for this job: two logical nodes, or one rank per node where the ranks cannot be halved."""
    return size // 2 if size >= 4 and size % 2 == 0 else 1


def _node(rank: int, per_node: int):
    return [r for r in range(rank // per_node * per_node, rank // per_node * per_node + per_node)]


def _word(address: int, device) -> torch.Tensor:
    return torch.as_tensor(_DeviceRange(address, 8), device=device).view(torch.int64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nvlink", [True, False])
def test_devx_provider_maps_its_node_over_cuda_ipc(mpi_comm, pg, device, nvlink):
    from test_ibgda_devx import FakeGlue, _sysfs

    from deepep_portable.transports.ibgda import roce
    from deepep_portable.transports.ibgda.devx import DevxProvider
    from deepep_portable.transports.ibgda.window import IbgdaWindow

    R, me = mpi_comm.Get_size(), mpi_comm.Get_rank()
    P = _layout(R)
    node = _node(me, P)
    torch.zeros(1, device=device)   # the primary context is current
    ctx = BufferContext(comm=Comm(pg), rank=me, num_ranks=R, device=device, num_nvl_bytes=0, num_rdma_bytes=1 << 20,
                        low_latency_mode=True, uid=-5, timeout_s=30.0, ranks_per_node=P,
                        options=dict(num_qps_per_rank=C, allow_nvlink_for_low_latency_mode=nvlink,
                                     ibgda=roce.ibgda_options({}, environ={})))
    glue = FakeGlue(me)
    found = []
    window = None
    try:
        provider = DevxProvider(ctx, glue=glue, devices=_sysfs(), gpu_device_dir="")
        window = IbgdaWindow(ctx, 1 << 20, channels=C, depth=64, provider=provider)
        mapped = [window.node_base(r) for r in range(R)]
        if any(mapped[r] == 0 for r in node) or any(mapped[r] for r in range(R) if r not in node):
            found.append(f"node_base {mapped} for node {node}")
        want_queues = [0 if (nvlink and r in node) else C for r in range(R)]
        if [len(q) for q in window.queues] != want_queues:
            found.append(f"queues per rank {[len(q) for q in window.queues]}, want {want_queues}")
        qps = sum(1 for kind, _ in glue.commands if kind == "create") // 2   # a CQ and a QP per queue
        if qps != sum(want_queues):
            found.append(f"{qps} QPs created, want {sum(want_queues)}")
        want_bases = [mapped[r] if (nvlink and r in node) else 0 for r in range(R)]
        if window.bases != want_bases:
            found.append(f"transport_params' peer table {window.bases}, want {want_bases}")
        for p in node:   # the GPU stores into each node peer's window through this process's mapping
            _word(mapped[p] + 8 * (me + 1), device).fill_(1000 * p + me)
        torch.cuda.synchronize(device)
    except Exception as e:   # noqa: BLE001 - agreed below
        found.append(f"{type(e).__name__}: {e}")
    dist.barrier(group=pg)
    if window is not None and not found:
        got = {src: int(_word(window.base + 8 * (src + 1), device).item()) for src in node}
        if got != {src: 1000 * me + src for src in node}:
            found.append(f"my window holds {got} from my node's stores")
    try:
        if window is not None:
            window.close()   # collective
            if glue.live:
                found.append(f"left behind: {glue.live}")
    except Exception as e:   # noqa: BLE001
        found.append(f"close: {type(e).__name__}: {e}")
    everyone = mpi_comm.allgather(found)
    assert not any(everyone), [f"rank {r}: {f}" for r, f in enumerate(everyone) if f]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nvlink", [True, False])
def test_low_latency_node_traffic_skips_the_nic(mpi_comm, pg, device, request, base_seed, nvlink):
    import ibgda_model
    from test_intranode_gpu_mpi import GpuChecker
    from test_low_latency_gpu_mpi import run_pair
    from test_reference_mpi import generator

    R, me = mpi_comm.Get_size(), mpi_comm.Get_rank()
    problem = None
    if me == 0:
        try:
            ibgda_model.build_library()
        except Exception as e:   # noqa: BLE001 - every rank skips with it
            problem = f"the NIC model cannot be built: {type(e).__name__}: {e}"
    problem = mpi_comm.bcast(problem, root=0)
    if problem:
        pytest.skip(problem)

    class NodeModel(ibgda_model.ModelProvider):
        """The NIC model with the node mapping it makes between logical nodes declared (the window then makes no
        queue to the node)."""

        @property
        def maps_node_peers(self) -> bool:
            return self.load_store

    P = _layout(R)
    node = _node(me, P)
    old_sms = deep_ep.Buffer.num_sms
    with ibgda_model.installed(lambda ctx: NodeModel(ctx)):
        deep_ep.Buffer.set_num_sms(8)
        found, buf = [], None
        try:
            hidden, experts = 2048, 256 // R * R
            rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, hidden, R, experts)
            buf = deep_ep.Buffer(pg, 0, rdma, low_latency_mode=True, num_qps_per_rank=C, transport="ibgda",
                                 ranks_per_node=P, allow_nvlink_for_low_latency_mode=nvlink, explicitly_destroy=True)
            ck = GpuChecker(pg)
            gen = generator(request, base_seed, me)
            run_pair(buf, pg, gen, device, ck, hidden=hidden, num_tokens=128, mode="bf16", tag="node peers")
            ck.done()   # collective: every rank's findings, asserted on every rank
            window = buf.backend.engine("low_latency").window
            torch.cuda.synchronize(device)
            posted = [sum(int(_word(q.sq.reserve, device).item()) for q in row) for row in window.queues]
            queues = [len(row) for row in window.queues]
            if nvlink:
                if any(queues[r] for r in node) or any(queues[r] != C for r in range(R) if r not in node):
                    found.append(f"queues per rank {queues} (node {node})")
                if any(posted[r] == 0 for r in range(R) if r not in node):
                    found.append(f"WQEBBs posted per rank {posted}: another node's rank got none")
                if buf.capabilities["peer_load_store"]:
                    found.append("capabilities say every peer is load/store over two nodes")
            else:
                if queues != [C] * R or any(p == 0 for p in posted):
                    found.append(f"queues {queues}, WQEBBs posted per rank {posted}: every rank through the NIC")
        except Exception as e:   # noqa: BLE001 - agreed below
            found.append(f"{type(e).__name__}: {e}")
        finally:
            everyone = mpi_comm.allgather(found)
            try:
                if buf is not None and not any(everyone):
                    window = buf.backend.engine("low_latency").window
                    buf.destroy()   # collective
                    if window.provider.problems:
                        found.append(f"the NIC model saw {window.provider.problems} broken rules")
            finally:
                deep_ep.Buffer.num_sms = old_sms
    everyone = mpi_comm.allgather(found)
    assert not any(everyone), [f"rank {r}: {f}" for r, f in enumerate(everyone) if f]
