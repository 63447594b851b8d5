"""`bench --compare MODULE`: a library with DeepEP V1's API (e.g. `deep_ep` itself) driven in the same
processes, on the same inputs (same seeds), with the same timing method, right after our own rows of
each token count (normal mode: layout, dispatch, combine). Its rows carry the module's name in the
transport column and our ceilings; `print_comparison` adds, per op, its time over ours.

Low-latency mode (low_latency_dispatch / low_latency_combine, eager loops and graph replays as our LL
rows) is compared only when every rank has a GPU of its own (or on the CPU): DeepEP V1's low-latency
kernels size their grid by the expert count and cannot all be resident when ranks share a GPU
(docs/PERFORMANCE.md), so there the LL rows stand beside the ceiling only.
"""
from __future__ import annotations

import argparse
import importlib
from typing import List, Optional, Tuple

import torch

from ..config import Config
from ..fp8 import cast as fp8_cast
from ..buffer import Buffer
from ..transports import registry
from .timing import LL_LOOP, graph_seconds, layout_parts, slowest, start_line, timer


def _peer_buffer(mod, group, world: int, hidden: int, tokens: int):
    """The peer's Buffer for normal mode, as its own tests make one: (group, num_nvl_bytes, 0)."""
    ours = Config().get_nvl_buffer_size_hint(hidden * 2, world, tokens)
    try:   # DeepEP's hint (its buffer is sized by chunks, not tokens)
        theirs = mod.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world)
    except Exception:   # noqa: BLE001 - any peer without it gets our size
        theirs = 0
    return mod.Buffer(group, max(ours, theirs), 0)


def _peer_dispatch(buf, rank: int, cfg: argparse.Namespace, tokens: int, device: torch.device, random_topk):
    """(topk_idx, dispatch): the peer's dispatch of bench_normal's inputs for `tokens` (same seed, same draws),
    its layout computed once."""
    gen = torch.Generator().manual_seed(1000 * rank + tokens)   # bench_normal's seed: the same inputs
    x = torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)
    topk_idx = random_topk(tokens, cfg.experts, cfg.topk, device, gen)
    topk_weights = torch.rand(tokens, cfg.topk, generator=gen).to(device)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, cfg.experts)
    x_in = fp8_cast(x, False) if cfg.fp8 else x

    def dispatch():
        return buf.dispatch(x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                            topk_weights=topk_weights)
    return topk_idx, dispatch


def _peer_round_trip(module: str, buf, dispatch, rank: int, cfg: argparse.Namespace, tokens: int):
    """One dispatch and combine of the peer, its output's shape checked; returns (combine input, handle)."""
    recv_x, _, _, _, handle, _ = dispatch()
    combine_in = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) \
        if cfg.fp8 else recv_x
    combined, _, _ = buf.combine(combine_in, handle)
    if combined.shape != (tokens, cfg.hidden):
        raise AssertionError(f"rank {rank}: {module}'s combine returned {tuple(combined.shape)}")
    return combine_in, handle


def bench_peer_normal(module: str, rank: int, world: int, group, cfg: argparse.Namespace, tokens: int,
                      rows: List, row_cls, random_topk) -> None:
    """Time `module`'s get_dispatch_layout, dispatch and combine on bench_normal's inputs for `tokens`
    (random_topk: bench's routing generator) and append a `row_cls` row per op beside ours."""
    mod = importlib.import_module(module)
    if cfg.num_sms is not None:
        mod.Buffer.set_num_sms(cfg.num_sms)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    hidden, experts = cfg.hidden, cfg.experts
    buf = _peer_buffer(mod, group, world, hidden, tokens)
    topk_idx, dispatch = _peer_dispatch(buf, rank, cfg, tokens, device, random_topk)
    combine_in, handle = _peer_round_trip(module, buf, dispatch, rank, cfg, tokens)
    # The same timing as our rows: every sample starts at the GPU start line (hosted by a Buffer of ours
    # that moves nothing), after a barrier.
    with start_line(Buffer(group, 0, 0, transport=registry.oracle()), cfg):
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
    _add_peer_rows(rows, row_cls, timed, module, cfg, tokens)
    if hasattr(buf, "destroy") and getattr(buf, "explicitly_destroy", False):
        buf.destroy()


def bench_peer_sweep(module: str, rank: int, world: int, group, cfg: argparse.Namespace, tokens: int,
                     budgets: List[Optional[int]], random_topk) -> List[Tuple[str, Optional[int], float]]:
    """Time `module`'s dispatch, get_dispatch_layout + dispatch in one call (the work of one V2 dispatch) and
    combine on bench_normal's inputs for `tokens` at each SM budget of `budgets` (None: the module's own, as on
    the CPU), in one Buffer: sized at the largest budget (DeepEP sizes its buffer by channels, two SMs each),
    then `set_num_sms` per budget, which its default configs read at every call. Each budget's combine takes
    that budget's handle (DeepEP's handle holds per-channel prefixes). Returns (op, budget, seconds) rows."""
    mod = importlib.import_module(module)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    before = mod.Buffer.num_sms
    given = [sms for sms in budgets if sms is not None]
    timed: List[Tuple[str, Optional[int], float]] = []
    try:
        if given:
            mod.Buffer.set_num_sms(max(given))
        buf = _peer_buffer(mod, group, world, cfg.hidden, tokens)
        topk_idx, dispatch = _peer_dispatch(buf, rank, cfg, tokens, device, random_topk)

        def layout_and_dispatch():
            buf.get_dispatch_layout(topk_idx, cfg.experts)
            return dispatch()

        with start_line(Buffer(group, 0, 0, transport=registry.oracle()), cfg):   # as bench_peer_normal times
            for sms in budgets:
                if sms is not None:
                    mod.Buffer.set_num_sms(sms)
                combine_in, handle = _peer_round_trip(module, buf, dispatch, rank, cfg, tokens)
                for op, fn in (("dispatch", dispatch), ("layout+dispatch", layout_and_dispatch),
                               ("combine", lambda: buf.combine(combine_in, handle))):
                    timed.append((op, sms, slowest(timer(device, fn, cfg.warmup, cfg.iters, group), group)))
        if hasattr(buf, "destroy") and getattr(buf, "explicitly_destroy", False):
            buf.destroy()
    finally:
        mod.Buffer.set_num_sms(before)
    return timed


def ll_inputs(rank: int, tokens: int, cfg: argparse.Namespace, device: torch.device, random_topk):
    """(x, topk_idx, topk_weights) of bench's low-latency rows for `tokens` on `rank`, seeded: a peer gets the same."""
    gen = torch.Generator().manual_seed(2000 * rank + tokens)
    x = torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)
    topk_idx = random_topk(tokens, cfg.experts, cfg.topk, device, gen)
    topk_weights = torch.rand(tokens, cfg.topk, generator=gen).to(device)
    return x, topk_idx, topk_weights


def ll_expert_outputs(recv_x):
    """Identity experts: the received rows as BF16 (FP8 ones dequantized), a copy, since the next dispatches
    rewrite recv_x."""
    if isinstance(recv_x, tuple):
        data, scales = recv_x
        return (data.float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)
    return recv_x.clone()


def bench_peer_low_latency(module: str, rank: int, world: int, group, cfg: argparse.Namespace, tokens: int,
                           rows: List, row_cls, random_topk) -> None:
    """Time `module`'s low_latency_dispatch and low_latency_combine on bench_low_latency's inputs for `tokens`
    (eager: LL_LOOP calls back to back; and replayed from CUDA graphs), a `row_cls` row per op beside ours.
    The caller runs it only where the peer's kernels can all be resident (see the module docstring)."""
    mod = importlib.import_module(module)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    hidden, experts = cfg.hidden, cfg.experts
    rdma_bytes = mod.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, experts)
    buf = mod.Buffer(group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=max(1, experts // world))
    x, topk_idx, topk_weights = ll_inputs(rank, tokens, cfg, device, random_topk)

    def dispatch():
        return buf.low_latency_dispatch(x, topk_idx, tokens, experts, use_fp8=cfg.fp8)

    recv_x, _, handle, _, _ = dispatch()
    combine_in = ll_expert_outputs(recv_x)

    def combine():
        return buf.low_latency_combine(combine_in, topk_idx, topk_weights, handle)

    combined, _, _ = combine()
    if combined.shape != (tokens, hidden):
        raise AssertionError(f"rank {rank}: {module}'s low_latency_combine returned {tuple(combined.shape)}")
    with start_line(Buffer(group, 0, 0, transport=registry.oracle()), cfg):
        loop = LL_LOOP if device.type == "cuda" else 1
        timed = [("ll_dispatch", slowest(timer(device, dispatch, cfg.warmup, cfg.iters, group, loop), group)),
                 ("ll_combine", slowest(timer(device, combine, cfg.warmup, cfg.iters, group, loop), group))]
        if device.type == "cuda":
            timed += [("ll_dispatch_graph", graph_seconds(dispatch, device, cfg, group)),
                      ("ll_combine_graph", graph_seconds(combine, device, cfg, group))]
    _add_peer_rows(rows, row_cls, timed, module, cfg, tokens)
    if hasattr(buf, "destroy") and getattr(buf, "explicitly_destroy", False):
        buf.destroy()


def _add_peer_rows(rows: List, row_cls, timed, module: str, cfg: argparse.Namespace, tokens: int) -> None:
    """A row per (op, seconds) of the peer, with our row's payload, precision and ceiling (same inputs)."""
    ours = {r.op: r for r in rows if r.tokens == tokens and r.transport != module}
    for op, t in timed:
        mine = ours.get(op)
        if mine is None:
            continue
        nbytes = mine.gbps * mine.time_us * 1e3   # the same payload as our row
        rows.append(row_cls(op, tokens, cfg.hidden, cfg.topk, cfg.experts, mine.precision, t * 1e6,
                            nbytes / t / 1e9, mine.ceiling_us, mine.ceiling_gbps, module, mine.sms))


def print_comparison(rows: List, module: str) -> None:
    """Per (op, tokens): the peer's time over ours (> 1: we are faster)."""
    peer = {(r.op, r.tokens): r for r in rows if r.transport == module}
    pairs = [(r, peer[(r.op, r.tokens)]) for r in rows if r.transport != module and (r.op, r.tokens) in peer]
    if not pairs:
        return
    print(f"\n{module} time / ours (same processes, inputs and timing; > 1: deepep_portable is faster)")
    # Our zero-copy ops (inputs written into our own rows; not DeepEP V1 APIs) beside the peer's op
    pairs += [(r, peer[(r.op[:-3], r.tokens)]) for r in rows
              if r.op in ("dispatch_zc", "combine_zc") and r.transport != module and (r.op[:-3], r.tokens) in peer]
    for r, p in pairs:
        print(f"  {r.op:>10s} {r.tokens:>6d} tokens {r.precision:>5s}: {p.time_us:9.1f} us / {r.time_us:9.1f} us"
              f" = {p.time_us / r.time_us:.3f}")
