"""Fuzz: seeded random but valid calls of every normal-mode and low-latency feature, each checked exactly
against tests/oracle.py (issue 20's CPU part: the reference transport, over gloo, in CI).

A case's shape (hidden, top-k, experts per rank, precision, alignment, padding, biases, logical nodes,
skewed routing, hooks, zero-copy...) comes from its seed, the same on every rank; its data and token counts
(0 and 1 included) from the seed and the rank. A failing case names its seed; rerun just that case with
    DEEPEP_FUZZ_SEED=<seed> DEEPEP_FUZZ_CASES=1 DEEPEP_FUZZ_PALETTE=<0|1> mpirun -n <ranks> \
        python -m pytest --with-mpi tests/mpi/test_fuzz_mpi.py
DEEPEP_FUZZ_CASES (default 60 per mode) sets how many cases run; DEEPEP_FUZZ_SEED (default: from the run's
base seed) the first seed; DEEPEP_FUZZ_PALETTE (below) whether hidden and top-k come from a small palette.
DEEPEP_FUZZ_TRANSPORT (default "reference") runs the same cases on another transport (on a GPU machine:
"nvlink", whose normal mode needs one node, so logical nodes are left out; "nvshmem", whose cases over
logical nodes run the internode kernels).
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepep_portable as deep_ep  # noqa: E402
from test_reference_mpi import num_experts_for, run_low_latency, run_normal, world  # noqa: E402

pytestmark = pytest.mark.mpi
CASES = int(os.environ.get("DEEPEP_FUZZ_CASES", "60"))
TRANSPORT = os.environ.get("DEEPEP_FUZZ_TRANSPORT", "reference")
INTERNODE = ("reference", "nvshmem")   # transports whose normal mode spans (logical) nodes
# On a GPU every new (hidden, top-k) is kernels to JIT-compile, seconds each: there the cases draw them from a
# small palette (DEEPEP_FUZZ_PALETTE=1, the default off the reference transport), so thousands of cases fit
# in minutes once the JIT cache holds the palette; everything else stays free. The palette keeps a hidden that
# is not a multiple of 512 and odd top-k widths. A seed replays the same case only with the same setting.
PALETTE = os.environ.get("DEEPEP_FUZZ_PALETTE", "0" if TRANSPORT == "reference" else "1") == "1"
NORMAL_HIDDEN = {False: [264, 7168], True: [384, 7168]}   # by fp8
LL_HIDDEN, LL_HIDDEN_UE8M0 = [2944, 7168], [1536, 7168]
PALETTE_TOPK = [1, 5, 8]


def _topk(r: random.Random, experts: int) -> int:
    if PALETTE:
        return r.choice([k for k in PALETTE_TOPK if k <= experts])
    return min(r.randint(1, 16), experts)


def _first_seed(base_seed: int, salt: int) -> int:
    env = os.environ.get("DEEPEP_FUZZ_SEED")
    return int(env) if env else (base_seed * 7919 + salt) % (1 << 31)


def normal_case(seed: int, num_ranks: int) -> dict:
    """The shape of one normal-mode case (identical on every rank)."""
    r = random.Random(seed)
    fp8 = r.choice([None, None, "float", "int32", "float-column-major"])
    if PALETTE:
        hidden = r.choice(NORMAL_HIDDEN[fp8 is not None])
    else:
        hidden = 128 * r.randint(1, 12) if fp8 else 8 * r.randint(1, 160)
    divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
    experts = num_ranks * r.randint(1, 64)
    return dict(hidden=hidden, topk=_topk(r, experts), experts=experts, fp8=fp8,
                use_topk=r.random() < 0.8, expert_alignment=r.choice([1, 1, 2, 4, 8]),
                num_worst_extra=r.choice([None, None, 0, 3]), num_bias=r.randint(0, 2),
                p_none=r.choice([0.0, 0.1, 0.5, 1.0]), skew=r.random() < 0.15,
                ranks_per_node=r.choice(divisors) if TRANSPORT in INTERNODE and r.random() < 0.4 else 0,
                max_tokens=r.choice([1, 2, 17, 64]))


def ll_case(seed: int, num_ranks: int) -> dict:
    r = random.Random(seed)
    mode = r.choice(["bf16", "fp8", "fp8-round", "fp8-ue8m0"])
    if PALETTE:
        hidden = r.choice(LL_HIDDEN_UE8M0 if mode == "fp8-ue8m0" else LL_HIDDEN)
    else:
        hidden = 512 * r.randint(1, 6) if mode == "fp8-ue8m0" else 128 * r.randint(1, 24)
    experts = num_ranks * r.randint(1, 64)
    return dict(hidden=hidden, topk=_topk(r, experts), experts=experts, mode=mode,
                max_tokens=r.choice([1, 3, 16, 64]), hook=r.random() < 0.5, zero_copy=r.random() < 0.3,
                use_out=r.random() < 0.3, p_none=r.choice([0.0, 0.1, 0.5, 1.0]))


def _tokens(seed: int, rank: int, most: int) -> int:
    """0, 1, the most, or anything between, per rank."""
    r = random.Random(seed * 1_000_003 + rank)
    return r.choice([0, 1, most, r.randint(0, most)])


def _run(name: str, seed: int, params: dict, fn) -> None:
    try:
        fn()
    except AssertionError as e:
        raise AssertionError(f"fuzz {name} case seed={seed} {params} failed; reproduce with DEEPEP_FUZZ_SEED={seed} "
                             f"DEEPEP_FUZZ_CASES=1 DEEPEP_FUZZ_PALETTE={int(PALETTE)}:\n{e}") from None


def test_fuzz_normal(pg, device, base_seed):
    rank, num_ranks = world(pg)
    first = _first_seed(base_seed, 1)
    print(f"\n[rank {rank}] normal-mode fuzz: {CASES} cases from seed {first} ({TRANSPORT})")
    for seed in range(first, first + CASES):
        p = normal_case(seed, num_ranks)
        gen = torch.Generator().manual_seed(seed * 131 + rank)
        most, per_node = p.pop("max_tokens"), p.pop("ranks_per_node")
        nvl = deep_ep.Config().get_nvl_buffer_size_hint(p["hidden"] * 2, num_ranks, max(most, 1))
        rdma = 0 if TRANSPORT == "reference" or not per_node else deep_ep.Config().get_rdma_buffer_size_hint(
            p["hidden"] * 2, num_ranks, max(most, 1), ranks_per_node=per_node)   # the internode kernels' window
        buf = deep_ep.Buffer(pg, nvl, rdma, transport=TRANSPORT, ranks_per_node=per_node or None,
                             explicitly_destroy=True)
        try:
            _run("normal", seed, dict(p, ranks_per_node=per_node), lambda: run_normal(
                buf, pg, gen, device, num_tokens=_tokens(seed, rank, most), ranks_per_node=per_node, **p))
        finally:   # every rank gets here (a case's checker raises on all of them), all ops done: free it now
            buf.destroy()


def test_fuzz_low_latency(pg, device, base_seed):
    rank, num_ranks = world(pg)
    first = _first_seed(base_seed, 2)
    print(f"\n[rank {rank}] low-latency fuzz: {CASES} cases from seed {first} ({TRANSPORT})")
    for seed in range(first, first + CASES):
        p = ll_case(seed, num_ranks)
        gen = torch.Generator().manual_seed(seed * 131 + rank)
        experts = num_experts_for(p["experts"], num_ranks)
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(p["max_tokens"], p["hidden"], num_ranks, experts)
        buf = deep_ep.Buffer(pg, 0, rdma, low_latency_mode=True, transport=TRANSPORT, explicitly_destroy=True)
        try:
            _run("low-latency", seed, p, lambda: run_low_latency(
                buf, pg, gen, device, num_tokens=_tokens(seed, rank, p["max_tokens"]), **p))
        finally:
            buf.destroy()
