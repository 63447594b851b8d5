"""Decode-style expert parallelism: low_latency_dispatch / low_latency_combine over a few steps.

    python examples/low_latency.py                        # spawns 2 local ranks (GPU if any, else CPU + gloo)
    torchrun --nproc-per-node 4 examples/low_latency.py   # or one process per rank (torchrun, mpirun)

The low-latency ops move a small batch (at most num_max_dispatch_tokens_per_rank tokens per rank) with
no host synchronisation, so a decode step can be captured in a CUDA graph. Each local expert receives
its tokens packed in recv_x[expert, :recv_count[expert]].
"""
import torch
import torch.distributed as dist

import deepep_portable as deep_ep
from deepep_portable.tools.spawn import run_local


def main(rank: int, world: int, group: dist.ProcessGroup) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    max_tokens, hidden, topk = 32, 1024, 4    # hidden: a multiple of 128 for the low-latency ops
    num_experts = 4 * world                   # 4 local experts per rank
    num_local_experts = num_experts // world

    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_local_experts, transport="auto")

    torch.manual_seed(rank)
    scales = torch.arange(1, num_local_experts + 1, device=device, dtype=torch.float32)  # expert e scales by e+1
    for step in range(3):
        tokens = max_tokens - step                     # any batch up to max_tokens
        x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
        topk_weights, topk_idx = torch.randn(tokens, num_experts, device=device).softmax(-1).topk(topk, dim=-1)
        topk_idx = topk_idx.to(deep_ep.topk_idx_t)

        # return_recv_hook=True: only the send is launched; hook() receives, so work can run in between.
        (recv_x, recv_count, handle, _, hook) = buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, use_fp8=False, return_recv_hook=True)
        hook()

        # The local experts: recv_x is [num_local_experts, world * max_tokens, hidden]; rows past
        # recv_count[e] are unused. Here expert e multiplies its tokens by e + 1.
        expert_out = (recv_x.float() * scales.view(-1, 1, 1)).to(torch.bfloat16)
        combined_x, _, _ = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

        # combine returns sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]) on the token's own rank.
        factor = (topk_weights * (topk_idx % num_local_experts + 1).float()).sum(dim=1, keepdim=True)
        torch.testing.assert_close(combined_x.float(), x.float() * factor, rtol=2e-2, atol=2e-2)
    dist.barrier(group)
    if rank == 0:
        print(f"low_latency OK: {world} ranks, transport {buffer.transport}, 3 decode steps")


if __name__ == "__main__":
    run_local(main, 2)   # under torchrun / mpirun: this process's rank; else spawn 2 local ranks
