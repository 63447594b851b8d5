"""One rank of the two-host job (tests/test_two_hosts.py starts it in each "host"'s network namespace).

Forms the process group through the project's launch code (deepep_portable.tools.spawn.init_group,
which reads the launcher's variables with deepep_portable.launch_env), then does one dispatch -> combine
round trip over deep_ep.Buffer(group, ..., transport="reference") and checks it against tests/oracle.py.
Every rank rebuilds every rank's inputs from DEEPEP_TEST_SEED, so the expectation needs no collective.
Prints "launch: ..." (what it read and chose) and, when every check passed, "round trip ok"; exits 1 on a
mismatch. DEEPEP_TEST_PG_TIMEOUT_S bounds the group's set-up and collectives.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/ (oracle)

import oracle  # noqa: E402

import deepep_portable as deep_ep  # noqa: E402
from deepep_portable import launch_env  # noqa: E402
from deepep_portable.tools.spawn import init_group, launched_rank_world  # noqa: E402

HIDDEN, TOPK, EXPERTS_PER_RANK, TOKENS = 128, 2, 2, 6


def inputs(seed: int, rank: int, num_experts: int):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(TOKENS, num_experts, generator=gen).argsort(dim=1)[:, :TOPK].to(torch.int64).contiguous()
    weights = torch.rand(TOKENS, TOPK, generator=gen)
    return x, idx, weights


def expert_outputs(seed: int, rank: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + 500 + rank)
    return torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)


def main() -> int:
    seed = int(os.environ["DEEPEP_TEST_SEED"])
    rank, world = launched_rank_world()
    group = init_group(rank, world, timeout=datetime.timedelta(seconds=float(os.environ.get(
        "DEEPEP_TEST_PG_TIMEOUT_S", "60"))))
    info = launch_env.read_launch()
    print(f"launch: rank {rank}/{world} local {info.local_rank}/{info.local_size} "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
          f"gloo_ifname {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
    num_experts = EXPERTS_PER_RANK * world
    everyone = [inputs(seed, r, num_experts) for r in range(world)]
    x, idx, weights = everyone[rank]
    in_rank_all = [oracle.dispatch_layout(i, num_experts, world)[2] for _, i, _ in everyone]
    per_expert_all = [oracle.dispatch_layout(i, num_experts, world)[1] for _, i, _ in everyone]

    hint = deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world, TOKENS)
    buf = deep_ep.Buffer(group, hint, 0, transport="reference")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=weights)
    expected_all = [oracle.dispatch(r, num_experts, [e[0] for e in everyone], in_rank_all, None,
                                    [e[1] for e in everyone], [e[2] for e in everyone], per_expert_all)
                    for r in range(world)]
    expected = expected_all[rank]
    y_all = [expert_outputs(seed, r, expected_all[r].num_recv_tokens) for r in range(world)]
    combined, _, _ = buf.combine(y_all[rank], handle)
    expected_combined, _ = oracle.combine(rank, y_all, in_rank_all)

    wrong = [what for what, got, want in (("recv_x", recv_x, expected.recv_x),
                                          ("recv_topk_idx", recv_idx, expected.recv_topk_idx),
                                          ("recv_topk_weights", recv_w, expected.recv_topk_weights),
                                          ("combined_x", combined, expected_combined))
             if got.shape != want.shape or not torch.equal(got, want)]
    if recv_x.shape[0] == 0 or combined.shape[0] != TOKENS:
        wrong.append(f"degenerate round trip ({recv_x.shape[0]} rows received)")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if wrong:
        print(f"rank {rank}: differs from the oracle: {', '.join(wrong)}", flush=True)
        return 1
    print(f"rank {rank}: round trip ok ({recv_x.shape[0]} rows received)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
