"""Many Buffers created, used and destroyed in one process leave nothing behind in that process: torch's
reserved device memory, the windows (IPC / VMM memory, NVSHMEM's heap) still open, the device mappings in
its address space, mapped host words, file descriptors (the windows' exchanged descriptors, sockets). The
bounds are per process: the driver's free memory is the whole GPU's, shared with the other ranks (and MPS),
so it is printed, not bounded. Every rank alike, under mpirun (tests/mpi/conftest.py); DEEPEP_TEST_LL_TRANSPORT
picks nvlink (default) or nvshmem for the low-latency window."""
from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepep_portable as deep_ep  # noqa: E402
from test_reference_mpi import world  # noqa: E402

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the windows live on a CUDA GPU")]
TRANSPORT = os.environ.get("DEEPEP_TEST_LL_TRANSPORT", "nvlink")
T, HIDDEN, EXPERTS = 8, 512, 16
# Buffers created, used and destroyed after the warm-up (DEEPEP_TEST_MANY_BUFFERS=1000 takes about 2 minutes at
# 4 ranks sharing the H200; the default keeps the GPU suite short).
COUNT = int(os.environ.get("DEEPEP_TEST_MANY_BUFFERS", "100"))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cycle(pg, n: int) -> None:
    _, num_ranks = world(pg)
    experts = EXPERTS // num_ranks * num_ranks or num_ranks
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks, T)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, num_ranks, experts)
    for _ in range(n):
        buf = deep_ep.Buffer(pg, nvl, rdma, low_latency_mode=True, explicitly_destroy=True, transport=TRANSPORT)
        x = torch.randn(T, HIDDEN, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(experts, device="cuda")[:2] for _ in range(T)])
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=False)
        buf.low_latency_combine(recv.clone(), idx, torch.ones(T, 2, device="cuda"), handle)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        recv_x, *_, nh, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert)
        buf.combine(recv_x, nh)
        torch.cuda.synchronize()
        buf.destroy()
        del buf, recv, handle, recv_x, nh
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier(group=pg)


def _device_mappings() -> int:
    """Mappings of the GPU driver's device files in this process's address space (IPC / VMM imports among them)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/nvidia" in line)


def _held() -> dict:
    from deepep_portable.windows import base

    return dict(fds=_open_fds(), reserved_mib=torch.cuda.memory_reserved() >> 20, mappings=_device_mappings(),
                windows=sum(len(ws) for ws in base._live_windows.values()),
                gpu_free_mib=torch.cuda.mem_get_info()[0] >> 20)


def test_many_buffers_leave_nothing(pg):
    _cycle(pg, 5)   # warm-up: JIT modules, caches, lazy initialisations
    before = _held()
    _cycle(pg, COUNT)
    after = _held()
    print(f"\n[rank {dist.get_rank()}] after {COUNT} Buffers: " +
          ", ".join(f"{k} {before[k]} -> {after[k]}" for k in before))
    assert after["fds"] <= before["fds"], f"file descriptors grew: {before} -> {after}"
    assert after["windows"] == 0, f"windows still open after destroy(): {after}"
    assert after["mappings"] <= before["mappings"], f"device mappings grew: {before} -> {after}"
    # torch's caching allocator may keep a block or two of the last round's outputs, never a Buffer's worth a time
    assert after["reserved_mib"] <= before["reserved_mib"] + 64, f"torch's reserved memory grew: {before} -> {after}"
