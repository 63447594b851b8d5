"""Quick start: one MoE dispatch -> experts -> combine round trip on every rank.

    python examples/quickstart.py                        # spawns 2 local ranks (GPU if any, else CPU + gloo)
    torchrun --nproc-per-node 4 examples/quickstart.py   # or one process per rank (torchrun, mpirun)
"""
import torch
import torch.distributed as dist

import deepep_portable as deep_ep
from deepep_portable.tools.spawn import run_local


def main(rank: int, world: int, group: dist.ProcessGroup) -> None:
    # run_local has called dist.init_process_group: NCCL when every rank has a GPU of its own, else gloo.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokens, hidden, num_experts, topk = 128, 1024, 16, 4

    # One Buffer per group, the same size on every rank. "auto": nvlink on one node when its kernels can be
    # built here, else the first usable transport (a machine without a GPU gets "reference").
    num_nvl_bytes = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, world, tokens)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, transport="auto")

    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device=device)
    topk_weights, topk_idx = scores.softmax(dim=-1).topk(topk, dim=-1)   # the router
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)

    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)

    expert_out = recv_x   # the local experts would run here; identity experts keep the check simple
    combined_x, _, _ = buffer.combine(expert_out, handle)

    # combine sums each token's rows over the ranks it went to: here x times the number of those ranks.
    expected = (x.float() * is_token_in_rank.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(combined_x, expected), f"rank {rank}: combine returned an unexpected sum"
    dist.barrier(group)
    if rank == 0:
        print(f"quickstart OK: {world} ranks, transport {buffer.transport}, "
              f"rank 0 received {recv_x.size(0)} of {world * tokens} tokens")


if __name__ == "__main__":
    run_local(main, 2)   # under torchrun / mpirun: this process's rank; else spawn 2 local ranks
