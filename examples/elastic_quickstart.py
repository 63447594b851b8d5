"""Quick start, DeepEP V2's API: one dispatch -> experts -> combine round trip with ElasticBuffer.

    python examples/elastic_quickstart.py                        # spawns 2 local ranks (GPU if any, else CPU)
    torchrun --nproc-per-node 4 examples/elastic_quickstart.py   # or one process per rank
"""
import torch
import torch.distributed as dist

import deepep_portable as deep_ep
from deepep_portable.tools.spawn import run_local


def main(rank: int, world: int, group: dist.ProcessGroup) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokens, hidden, num_experts, topk = 128, 1024, 16, 4

    # Sized by the MoE settings (or by num_bytes, as V2); the layout is folded into dispatch.
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk)

    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device=device)
    topk_weights, topk_idx = scores.softmax(dim=-1).topk(topk, dim=-1)   # the router
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)

    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
    expert_out = recv_x   # the local experts would run here; identity experts keep the check simple
    combined_x, _, _ = buffer.combine(expert_out, handle)

    # combine sums each token's rows over the ranks it went to: here x times the number of those ranks.
    experts_per_rank = num_experts // world
    ranks_of_token = torch.zeros(tokens, world, dtype=torch.bool, device=device)
    ranks_of_token.scatter_(1, topk_idx // experts_per_rank, True)
    expected = (x.float() * ranks_of_token.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(combined_x, expected), f"rank {rank}: combine returned an unexpected sum"
    if rank == 0:
        print(f"elastic quickstart OK: {world} ranks, transport {buffer.runtime.transport}")


if __name__ == "__main__":
    run_local(main, 2)
