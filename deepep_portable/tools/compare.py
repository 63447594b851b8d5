"""`bench --compare MODULE`: a library with DeepEP V1's API (e.g. `deep_ep` itself) driven in the same
processes, on the same inputs (same seeds), with the same timing method, right after our own rows of
each token count (normal mode: layout, dispatch, combine). Its rows carry the module's name in the
transport column and our ceilings; `print_comparison` adds, per op, its time over ours.

Low-latency mode is not compared: DeepEP V1's low-latency kernels size their grid by the expert count
and cannot all be resident when ranks share a GPU (docs/PERFORMANCE.md), so LL rows stand beside the
ceiling only.
"""
from __future__ import annotations

import argparse
import importlib
from typing import List

import torch

from ..config import Config
from ..transports.reference import _fp8_cast as _reference_fp8_cast
from ..buffer import Buffer
from .timing import layout_parts, slowest, start_line, timer


def _peer_buffer(mod, group, world: int, hidden: int, tokens: int):
    """The peer's Buffer for normal mode, as its own tests make one: (group, num_nvl_bytes, 0)."""
    ours = Config().get_nvl_buffer_size_hint(hidden * 2, world, tokens)
    try:   # DeepEP's hint (its buffer is sized by chunks, not tokens)
        theirs = mod.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world)
    except Exception:   # noqa: BLE001 - any peer without it gets our size
        theirs = 0
    return mod.Buffer(group, max(ours, theirs), 0)


def bench_peer_normal(module: str, rank: int, world: int, group, cfg: argparse.Namespace, tokens: int,
                      rows: List, row_cls, random_topk) -> None:
    """Time `module`'s get_dispatch_layout, dispatch and combine on bench_normal's inputs for `tokens`
    (random_topk: bench's routing generator) and append a `row_cls` row per op beside ours."""
    mod = importlib.import_module(module)
    if cfg.num_sms is not None:
        mod.Buffer.set_num_sms(cfg.num_sms)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(1000 * rank + tokens)   # bench_normal's seed: the same inputs
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.experts
    buf = _peer_buffer(mod, group, world, hidden, tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    topk_idx = random_topk(tokens, experts, topk, device, gen)
    topk_weights = torch.rand(tokens, topk, generator=gen).to(device)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
    x_in = _reference_fp8_cast(x, False) if cfg.fp8 else x

    def dispatch():
        return buf.dispatch(x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                            topk_weights=topk_weights)

    recv_x, _, _, _, handle, _ = dispatch()
    combine_in = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) \
        if cfg.fp8 else recv_x
    combined, _, _ = buf.combine(combine_in, handle)
    if combined.shape != (tokens, hidden):
        raise AssertionError(f"rank {rank}: {module}'s combine returned {tuple(combined.shape)}")
    # The same timing as our rows: every sample starts at the GPU start line (hosted by a Buffer of ours
    # that moves nothing), after a barrier.
    with start_line(Buffer(group, 0, 0, transport="reference"), cfg):
        layout = lambda: buf.get_dispatch_layout(topk_idx, experts)  # noqa: E731
        layout_host_times: list = []
        t_layout = slowest(timer(device, layout, cfg.warmup, cfg.iters, group, host_times=layout_host_times), group)
        t_dispatch = slowest(timer(device, dispatch, cfg.warmup, cfg.iters, group), group)
        t_combine = slowest(timer(device, lambda: buf.combine(combine_in, handle), cfg.warmup, cfg.iters, group),
                            group)
        # The layout's parts, as our rows split it (timing.layout_parts)
        timed = [("layout", t_layout), ("dispatch", t_dispatch), ("combine", t_combine)]
        if device.type == "cuda":
            timed += layout_parts(layout, device, cfg, group, layout_host_times, peer=module)
    ours = {r.op: r for r in rows if r.tokens == tokens and r.transport != module}
    for op, t in timed:
        mine = ours.get(op)
        if mine is None:
            continue
        nbytes = mine.gbps * mine.time_us * 1e3   # the same payload as our row
        rows.append(row_cls(op, tokens, hidden, topk, experts, mine.precision, t * 1e6, nbytes / t / 1e9,
                            mine.ceiling_us, mine.ceiling_gbps, module, mine.sms))
    if hasattr(buf, "destroy") and getattr(buf, "explicitly_destroy", False):
        buf.destroy()


def print_comparison(rows: List, module: str) -> None:
    """Per (op, tokens): the peer's time over ours (> 1: we are faster)."""
    peer = {(r.op, r.tokens): r for r in rows if r.transport == module}
    pairs = [(r, peer[(r.op, r.tokens)]) for r in rows if r.transport != module and (r.op, r.tokens) in peer]
    if not pairs:
        return
    print(f"\n{module} time / ours (same processes, inputs and timing; > 1: deepep_portable is faster)")
    # Our zero-copy combine (expert outputs written into our area; not a DeepEP V1 API) beside the peer's combine
    pairs += [(r, peer[("combine", r.tokens)]) for r in rows
              if r.op == "combine_zc" and r.transport != module and ("combine", r.tokens) in peer]
    for r, p in pairs:
        print(f"  {r.op:>10s} {r.tokens:>6d} tokens {r.precision:>5s}: {p.time_us:9.1f} us / {r.time_us:9.1f} us"
              f" = {p.time_us / r.time_us:.3f}")
