"""Two Buffers on two different groups of the same ranks, in one process:

  mpirun -n 4 python -m pytest --with-mpi -q tests/mpi/test_two_buffers_mpi.py

Used alternately (each round trip checked against the oracle), then at once: both dispatches issued before
either result is read, then both combines, on two CUDA streams where there is a GPU; each result must be
bit-identical to the same call made alone (the grids of Buffers open together share the rank's SMs, so all
their blocks stay resident: windows/base.py Window.grid). Transport: DEEPEP_TEST_TRANSPORT (default: nvlink on a
GPU, reference on CPU)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import deepep_portable as deep_ep
from test_reference_mpi import BIG, SMALL, generator, make_topk, num_experts_for, run_normal, world

TOKENS = 48


def _transport() -> str:
    return os.environ.get("DEEPEP_TEST_TRANSPORT", "nvlink" if torch.cuda.is_available() else "reference")


@pytest.fixture(scope="module")
def two_buffers(pg):
    _, num_ranks = world(pg)
    ranks = list(range(num_ranks))
    groups = [dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo")]
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(BIG["hidden"] * 2, num_ranks, TOKENS)
    bufs = [deep_ep.Buffer(g, nvl, 0, transport=_transport()) for g in groups]
    return bufs


@pytest.mark.mpi(min_size=2)
def test_alternating_round_trips(two_buffers, pg, device, request, base_seed):
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    for round_ in range(3):
        for i, buf in enumerate(two_buffers):
            shape = BIG if (round_ + i) % 2 else SMALL
            run_normal(buf, pg, gen, device, **shape, num_tokens=int(torch.randint(1, TOKENS + 1, (1,), generator=gen)),
                       num_bias=i)


def make_inputs(gen, device, num_ranks, tokens=TOKENS, shape=BIG):
    """(x, topk_idx, topk_weights, num_experts) of `tokens` random tokens of `shape` (test_reference_mpi's shapes)."""
    experts = num_experts_for(shape["experts"], num_ranks)
    x = torch.randn(tokens, shape["hidden"], generator=gen).to(torch.bfloat16).to(device)
    idx = make_topk(tokens, shape["topk"], experts, gen).to(device)
    w = torch.rand(tokens, shape["topk"], generator=gen).to(device)
    return x, idx, w, experts


def dispatch_with_layout(buf, x, idx, w, experts, layout_idx=None):
    """get_dispatch_layout (of `layout_idx` when given, else of idx) then dispatch with idx and w."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx if layout_idx is None else layout_idx, experts)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=w)


def run_both_at_once(buffers, pg, gen, device, tokens=TOKENS, num_bias=0):
    """Each Buffer's round trip alone, then both at once (both dispatches issued before either result is read,
    then both combines, each Buffer from a stream of its own where there is a GPU): the same bits, on every
    rank; an op that failed is named (Buffer.synchronize raises what its kernels recorded)."""
    rank, num_ranks = world(pg)
    inputs = [make_inputs(gen, device, num_ranks, tokens) for _ in buffers]
    biases = [torch.randn(tokens, BIG["hidden"], generator=gen).to(torch.bfloat16).to(device)
              for _ in range(num_bias)]
    bias = tuple(biases) if num_bias == 2 else (biases[0] if biases else None)
    alone = []
    for buf, (x, idx, w, experts) in zip(buffers, inputs):
        recv_x, _, recv_w, _, handle, _ = dispatch_with_layout(buf, x, idx, w, experts)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
        alone.append((recv_x.cpu(), combined.cpu(), combined_w.cpu()))
    streams = [torch.cuda.Stream() for _ in buffers] if device.type == "cuda" else [None] * len(buffers)

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    errors = []
    results = []
    try:
        outs = []
        for buf, (x, idx, w, experts), stream in zip(buffers, inputs, streams):
            with on(stream):
                outs.append(dispatch_with_layout(buf, x, idx, w, experts))
        for buf, out, stream in zip(buffers, outs, streams):
            recv_x, _, recv_w, _, handle, _ = out
            with on(stream):
                results.append((recv_x, *buf.combine(recv_x, handle, topk_weights=recv_w, bias=bias)[:2]))
        for buf in buffers:
            buf.synchronize()
    except Exception as e:   # noqa: BLE001 - reported to every rank below
        errors.append(f"{type(e).__name__}: {e}")
    bad = errors + [f"buffer {i}: {name}" for i, (got, ref) in enumerate(zip(results, alone))
                    for name, a, b in zip(("recv_x", "combined", "combined_weights"), got, ref)
                    if not torch.equal(a.cpu(), b)]
    everyone = [None] * num_ranks
    dist.all_gather_object(everyone, bad, group=pg)
    assert not any(everyone), everyone


@pytest.mark.mpi(min_size=2)
def test_both_at_once_match_each_alone(two_buffers, pg, device, request, base_seed):
    rank, _ = world(pg)
    run_both_at_once(two_buffers, pg, generator(request, base_seed, rank), device)
