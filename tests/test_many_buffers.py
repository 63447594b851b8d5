"""Many Buffers in one process leave nothing behind (the CPU part: the reference transport over a
one-rank gloo group; the GPU windows' part runs in tests/mpi on the GPU machine)."""
import gc
import os

import torch

import deepep_portable as deep_ep


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_create_and_destroy_many_buffers(one_rank_group):
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(256 * 2, 1, 8)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 256, 1, 8)

    def cycle(n: int) -> None:
        for i in range(n):
            buf = deep_ep.Buffer(one_rank_group, nvl, rdma, low_latency_mode=True, transport="reference",
                                 explicitly_destroy=i % 2 == 0)
            x = torch.randn(4, 256).to(torch.bfloat16)
            idx = torch.tensor([[0, 1], [2, -1], [3, 4], [-1, 5]])   # every token goes somewhere (one rank)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
            recv, *_, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert)
            assert torch.equal(buf.combine(recv, handle)[0], x)
            recv_x, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
            buf.low_latency_combine(recv_x, idx, torch.ones(4, 2), ll_handle)
            buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
            if buf.explicitly_destroy:
                buf.destroy()
            del buf
        gc.collect()

    cycle(20)   # warm-up: lazy imports, caches
    fds = _open_fds()
    cycle(300)
    assert _open_fds() == fds
