"""The main job: a dispatch -> combine round trip across local ranks, checked, timed, with its ceiling.

Every measured op is printed beside the ceiling from the same run: one plain copy of exactly the
same bytes on the same device (a device-to-device copy on the GPU, a memcpy on the CPU); in internode
mode, the op's own traffic through its own paths (internode_ceiling.py). Logical
bandwidth follows DeepEP: payload bytes a rank sends (dispatch) or receives (combine), its own copy
included, over the op's time; the time reported is the slowest rank's median.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..buffer import Buffer, topk_idx_t
from ..config import Config
from ..fp8 import cast as fp8_cast
from . import compare
from .ceilings import ceiling, copy_ceiling, nccl_all_to_all
from .internode_ceiling import internode_ceiling
from .spawn import run_local
from .timing import (LL_LOOP, PICK_TOLERANCE, best_budget, graph_seconds, layout_parts, measured_model_inputs,
                     pick_budget, print_graph_trace, print_host_profile, print_profile, slowest, start_line, timer)


@dataclass
class Row:
    op: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    precision: str
    time_us: float
    gbps: float
    ceiling_us: float
    ceiling_gbps: float
    transport: str
    sms: Optional[int]   # blocks of the op's kernels and of its ceiling's copy; None: no SMs (the CPU), or not ours
    budget: Optional[int] = None   # --num-sms sweep: the SM budget asked for (the engine may cap the blocks)
    api: str = ""                  # --num-sms sweep: "v1" or "v2" (a --compare peer: "v1")

    def cells(self) -> List[str]:
        ratio = self.ceiling_us / self.time_us if self.time_us > 0 else 0.0
        return [self.op, str(self.tokens), str(self.hidden), str(self.topk), str(self.experts), self.precision,
                f"{self.time_us:.1f}", f"{self.gbps:.2f}", f"{self.ceiling_gbps:.2f}", f"{100 * ratio:.1f}%",
                "-" if self.sms is None else str(self.sms), self.transport]


HEADER = ["op", "tokens", "hidden", "topk", "experts", "prec", "time_us", "GB/s", "ceil_GB/s", "of_ceil",
          "SMs", "transport"]


def _add_rows(rows: List[Row], buf, cfg: argparse.Namespace, tokens: int, measured, mode: str = "normal") -> None:
    """One Row per (op, seconds, ceiling seconds, payload bytes, precision)."""
    for op, t, c, nbytes, prec in measured:
        rows.append(Row(op, tokens, cfg.hidden, cfg.topk, cfg.experts, prec, t * 1e6, nbytes / t / 1e9, c * 1e6,
                        nbytes / c / 1e9, buf.transport, _blocks(buf, mode) if buf.device.type == "cuda" else None))


def _blocks(buf: Buffer, mode: str = "normal") -> int:
    """Blocks the communication kernels of `mode` ("normal" or "low_latency") really use: the engine caps
    the caller's budget when ranks share a GPU. (The LL rows once took the normal engine's, absent from an
    LL-only Buffer, so their ceilings ran uncapped: 20 blocks against the LL kernels' 16 on 8 ranks.)"""
    engine = buf.backend.engine(mode)
    return engine.grid(Buffer.num_sms) if engine is not None else Buffer.num_sms


def _add_baseline_rows(rows: List[Row], cfg: argparse.Namespace, tokens: int, matrix: List[List[int]], rank: int,
                       group, device: torch.device, ops, loop: int = 1) -> None:
    """The same rows moved by all_to_all_single over NCCL, beside the op's ceilings. ops: (name,
    dispatch direction?, row bytes, payload bytes, ceiling seconds, precision)."""
    world = len(matrix)
    send_rows = list(matrix[rank])
    recv_rows = [matrix[s][rank] for s in range(world)]
    for name, forward, row_bytes, nbytes, ceiling_s, prec in ops:
        t = nccl_all_to_all(rank, world, group, send_rows if forward else recv_rows,
                            recv_rows if forward else send_rows, row_bytes, device, cfg, loop)
        if t is None:
            if rank == 0:
                print("baseline skipped: all_to_all_single over NCCL needs one GPU per rank and an NCCL group",
                      flush=True)
            return
        rows.append(Row(name, tokens, cfg.hidden, cfg.topk, cfg.experts, prec, t * 1e6, nbytes / t / 1e9,
                        ceiling_s * 1e6, nbytes / ceiling_s / 1e9, "nccl a2a", None))


def _random_topk(num_tokens: int, num_experts: int, topk: int, device: torch.device, gen: torch.Generator):
    scores = torch.rand(num_tokens, num_experts, generator=gen).to(device)
    idx = torch.topk(scores, topk, dim=-1, sorted=False).indices.to(topk_idx_t)
    # Some tokens drop an expert (-1), as real routers with capacity limits do.
    drop = torch.rand(num_tokens, topk, generator=gen).to(device) < 0.05
    return idx.masked_fill(drop, -1).contiguous()


def _dispatch_row_bytes(hidden: int, fp8: bool) -> int:
    """Payload bytes of one dispatched row: FP8 data and its float32 scale per 128 channels, or BF16."""
    return hidden + hidden // 128 * 4 if fp8 else hidden * 2


def _identity_round_trip(x: torch.Tensor, in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """What combine returns when every expert hands its rows back unchanged: x once per destination rank,
    summed as the oracle does (over nodes: a bf16 partial per node, node ascending)."""
    if not ranks_per_node:
        return (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
    per_node = in_rank.view(in_rank.size(0), -1, ranks_per_node).sum(2).float()
    acc = torch.zeros_like(x, dtype=torch.float32)
    for m in range(per_node.size(1)):
        acc += (x.float() * per_node[:, m:m + 1]).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def _internode_rows(in_rank: torch.Tensor, rank: int, ranks_per_node: int):
    """(rows my tokens put on the network: one per other destination node, rows my node's ranks pull over
    NVLink for my tokens: one per destination rank)."""
    nodes = in_rank.view(in_rank.size(0), -1, ranks_per_node).any(2)
    net = int(nodes.sum()) - int(nodes[:, rank // ranks_per_node].sum())
    return net, int(in_rank.sum())


def _time_zero_copy(buf, device, cfg, group, x_in, dispatch, recv_x, combine_in, handle, combined):
    """(dispatch, combine) times of the zero-copy ops (not DeepEP V1 APIs; the intranode engine's): the same tokens
    and expert outputs written into the Buffer's own rows (get_next_dispatch_buffer / get_next_combine_buffer,
    timed with the op: its prologue kernel), which the kernels read in place. The producer's write is not timed,
    as in the op rows; the rows stay in place between calls. Each op is first checked against the staged one."""
    fp8 = isinstance(x_in, tuple)
    tokens = x_in[0] if fp8 else x_in
    rows = buf.get_next_dispatch_buffer(tokens.size(0), tokens.size(1), tokens.dtype)
    rows.copy_(tokens)
    x_zc = (rows, x_in[1]) if fp8 else rows
    got = dispatch(x_zc)[0]
    if not all(torch.equal(a, b) for a, b in zip(got if fp8 else (got,), recv_x if fp8 else (recv_x,))):
        raise AssertionError(f"rank {dist.get_rank(group)}: the zero-copy dispatch differs from the staged one")

    def zero_copy_dispatch():   # its prologue included
        buf.get_next_dispatch_buffer(tokens.size(0), tokens.size(1), tokens.dtype)
        return dispatch(x_zc)
    t_dispatch = slowest(timer(device, zero_copy_dispatch, cfg.warmup, cfg.iters, group), group)

    area = buf.get_next_combine_buffer(handle)
    area.copy_(combine_in)
    if not torch.equal(buf.combine(area, handle)[0], combined):
        raise AssertionError(f"rank {dist.get_rank(group)}: the zero-copy combine differs from the staged one")

    def zero_copy_combine():
        buf.get_next_combine_buffer(handle)
        return buf.combine(area, handle)
    return t_dispatch, slowest(timer(device, zero_copy_combine, cfg.warmup, cfg.iters, group), group)


def bench_normal(rank: int, world: int, group, cfg: argparse.Namespace, tokens: int, rows: List[Row]) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(1000 * rank + tokens)
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.experts
    nvl_bytes = Config().get_nvl_buffer_size_hint(hidden * 2, world, tokens)
    per_node = 0
    if cfg.mode == "internode":   # logical nodes of --ranks-per-node ranks (default: two nodes)
        per_node = cfg.ranks_per_node or max(1, world // 2)
        rdma = Config().get_rdma_buffer_size_hint(hidden * 2, world, tokens, ranks_per_node=per_node)
        buf = Buffer(group, nvl_bytes, rdma, transport=cfg.transport, ranks_per_node=per_node)
    else:
        buf = Buffer(group, nvl_bytes, 0, transport=cfg.transport)
    with start_line(buf, cfg):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
        topk_idx = _random_topk(tokens, experts, topk, device, gen)
        topk_weights = torch.rand(tokens, topk, generator=gen).to(device)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
        x_in = fp8_cast(x, False) if cfg.fp8 else x

        def dispatch(tokens=x_in):
            return buf.dispatch(tokens, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

        def layout():
            return buf.get_dispatch_layout(topk_idx, experts)

        recv_x, recv_idx, recv_w, counts, handle, _ = dispatch()
        # Check: the rows received are what every source sent here; the round trip sums each token
        # once per destination rank (identity experts), exactly.
        all_per_rank = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(all_per_rank, per_rank, group=group)
        expected_rows = int(sum(int(t[rank]) for t in all_per_rank))
        got_rows = (recv_x[0] if cfg.fp8 else recv_x).size(0)
        if got_rows != expected_rows:
            raise AssertionError(f"rank {rank}: received {got_rows} rows, expected {expected_rows}")
        combine_in = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) \
            if cfg.fp8 else recv_x
        combined, _, _ = buf.combine(combine_in, handle)
        ref_src = (x_in[0].float() * x_in[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) if cfg.fp8 else x
        expected = _identity_round_trip(ref_src, in_rank, per_node)
        if not torch.equal(combined, expected):
            bad = (combined != expected).any(1).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"rank {rank}: combine differs from the oracle at tokens {bad}")

        sent_rows = int(in_rank.sum())
        row_bytes = _dispatch_row_bytes(hidden, cfg.fp8)
        dispatch_bytes = sent_rows * row_bytes
        combine_bytes = sent_rows * hidden * 2
        t_dispatch = slowest(timer(device, dispatch, cfg.warmup, cfg.iters, group), group)
        if os.environ.get("DEEPEP_PORTABLE_PROFILE_HOST") == "1":   # every rank calls (a collective op)
            print_host_profile(f"dispatch, {tokens} tokens", dispatch, device, rank == 0)
            print_host_profile(f"get_dispatch_layout, {tokens} tokens", layout, device, rank == 0)
            print_host_profile(f"combine, {tokens} tokens", lambda: buf.combine(combine_in, handle), device, rank == 0)
        t_combine = slowest(timer(device, lambda: buf.combine(combine_in, handle), cfg.warmup, cfg.iters, group),
                            group)
        t_dispatch_zc = t_combine_zc = None
        if getattr(buf.backend.engine("normal"), "next_dispatch_buffer", None) is not None:
            t_dispatch_zc, t_combine_zc = _time_zero_copy(buf, device, cfg, group, x_in, dispatch, recv_x,
                                                          combine_in, handle, combined)
        # The layout reads topk_idx once: its ceiling is one copy of those bytes (same timing method).
        layout_host_times: list = []   # the same samples' host time per call: the eager row's host share
        t_layout = slowest(timer(device, layout, cfg.warmup, cfg.iters, group, host_times=layout_host_times), group)
        layout_bytes = topk_idx.numel() * topk_idx.element_size()
        # Its parts (graph replay, host time, back-to-back calls): timing.layout_parts
        layout_rows = layout_parts(layout, device, cfg, group, layout_host_times) if device.type == "cuda" else []
        matrix = [[int(v) for v in t.tolist()] for t in all_per_rank]
        node_counts, c_dispatch, c_combine = None, None, None
        if per_node:   # the op's traffic through its own paths (internode_ceiling.py), where the engine runs
            mine = in_rank.view(in_rank.size(0), -1, per_node).any(2).sum(0).to(torch.int64)
            everyone = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine, group=group)
            node_counts = [[int(v) for v in t.tolist()] for t in everyone]
            c_dispatch = internode_ceiling(buf, matrix, node_counts, True, row_bytes, _blocks(buf), device, cfg, group)
            c_combine = internode_ceiling(buf, matrix, node_counts, False, hidden * 2, _blocks(buf), device, cfg,
                                          group)
        if c_dispatch is None:
            c_dispatch = ceiling(buf, matrix, True, row_bytes, dispatch_bytes, _blocks(buf), device, cfg, group)
            c_combine = ceiling(buf, matrix, False, hidden * 2, combine_bytes, _blocks(buf), device, cfg, group)
        else:
            cfg.internode_ceiling = True
        print_profile(buf.backend.engine("normal"), rank, tokens)
        prec = "fp8" if cfg.fp8 else "bf16"
        c_layout = copy_ceiling(layout_bytes, device, cfg, group, _blocks(buf), 1, False)
        measured = [("layout", t_layout, c_layout, layout_bytes, "int64"),
                    ("dispatch", t_dispatch, c_dispatch, dispatch_bytes, prec),
                    ("combine", t_combine, c_combine, combine_bytes, "bf16")]
        measured[1:1] = [(op, t, c_layout, layout_bytes, "int64") for op, t in layout_rows]
        if t_dispatch_zc is not None:
            measured.append(("dispatch_zc", t_dispatch_zc, c_dispatch, dispatch_bytes, prec))
            measured.append(("combine_zc", t_combine_zc, c_combine, combine_bytes, "bf16"))
        if per_node:   # DeepEP's two bandwidths: rows that cross the network once per node, and NVLink rows,
            # each beside the rate the op's ceiling moves them at (the op row's ceiling time)
            net_rows, nvl_rows = _internode_rows(in_rank, rank, per_node)
            for op, t, c, nbytes_row, p in (("dispatch", t_dispatch, c_dispatch, row_bytes, prec),
                                            ("combine", t_combine, c_combine, hidden * 2, "bf16")):
                for part, n in (("net", net_rows), ("nvl", nvl_rows)):
                    measured.append((f"{op}:{part}", t, c, n * nbytes_row, p))
        _add_rows(rows, buf, cfg, tokens, measured)
        if cfg.baseline:
            _add_baseline_rows(rows, cfg, tokens, matrix, rank, group, device,
                               (("a2a_dispatch", True, row_bytes, dispatch_bytes, c_dispatch, prec),
                                ("a2a_combine", False, hidden * 2, combine_bytes, c_combine, "bf16")))


def bench_low_latency(rank: int, world: int, group, cfg: argparse.Namespace, tokens: int, rows: List[Row]) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.experts
    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, experts)
    buf = Buffer(group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=max(1, experts // world),
                 transport=cfg.transport)
    with start_line(buf, cfg):
        x, topk_idx, topk_weights = compare.ll_inputs(rank, tokens, cfg, device, _random_topk)

        def dispatch():
            return buf.low_latency_dispatch(x, topk_idx, tokens, experts, use_fp8=cfg.fp8)

        recv_x, recv_count, handle, _, _ = dispatch()
        # Identity experts in BF16: combine returns sum_k w_k * x exactly as the oracle computes it.
        recv_bf16 = compare.ll_expert_outputs(recv_x)
        if cfg.fp8:
            src = fp8_cast(x, False)   # correctly rounded on any device, as the kernels
            ref_x = (src[0].float() * src[1].repeat_interleave(128, dim=1)).to(torch.bfloat16)
        else:
            ref_x = x

        def combine():
            return buf.low_latency_combine(recv_bf16, topk_idx, topk_weights, handle)

        combined, _, _ = combine()
        w = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
        expected = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        for k in range(topk):
            expected += w[:, k:k + 1] * ref_x.float()
        err = (combined.float() - expected).abs().max().item() if tokens else 0.0
        scale = expected.abs().max().item() if tokens else 1.0
        if err > 1e-2 * max(scale, 1e-6):
            raise AssertionError(f"rank {rank}: low-latency combine differs from the oracle (max abs err {err})")

        pairs = int((topk_idx >= 0).sum())
        d_row = _dispatch_row_bytes(hidden, cfg.fp8)
        dispatch_bytes = pairs * d_row
        combine_bytes = pairs * hidden * 2
        loop = LL_LOOP if device.type == "cuda" else 1
        t_dispatch = slowest(timer(device, dispatch, cfg.warmup, cfg.iters, group, loop), group)
        t_combine = slowest(timer(device, combine, cfg.warmup, cfg.iters, group, loop), group)
        # matrix[s][d]: (token, expert) pairs rank s sends rank d (LL sends a token once per expert).
        experts_per_rank = experts // world
        per_rank = torch.bincount((topk_idx[topk_idx >= 0] // experts_per_rank).flatten(), minlength=world)
        per_rank = per_rank.to(torch.int64)
        gathered = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(gathered, per_rank, group=group)
        matrix = [[int(v) for v in t.tolist()] for t in gathered]
        blocks = _blocks(buf, "low_latency")
        c_dispatch = ceiling(buf, matrix, True, d_row, dispatch_bytes, blocks, device, cfg, group, loop)
        c_combine = ceiling(buf, matrix, False, hidden * 2, combine_bytes, blocks, device, cfg, group, loop)
        if os.environ.get("DEEPEP_PORTABLE_PROFILE_HOST") == "1":   # every rank calls (collective ops)
            print_host_profile(f"low_latency_dispatch, {tokens} tokens", dispatch, device, rank == 0)
            print_host_profile(f"low_latency_combine, {tokens} tokens", combine, device, rank == 0)
        print_profile(buf.backend.engine("low_latency"), rank, tokens)
        prec = "fp8" if cfg.fp8 else "bf16"
        _add_rows(rows, buf, cfg, tokens, (("ll_dispatch", t_dispatch, c_dispatch, dispatch_bytes, prec),
                                           ("ll_combine", t_combine, c_combine, combine_bytes, "bf16")), "low_latency")
        if device.type == "cuda":
            # The same calls replayed from CUDA graphs (how decode steps run them): GPU time without the
            # Python host path, which the eager rows above include whenever the GPU waits for the host.
            g_dispatch = graph_seconds(dispatch, device, cfg, group)
            g_combine = graph_seconds(combine, device, cfg, group)
            gc_dispatch = ceiling(buf, matrix, True, d_row, dispatch_bytes, blocks, device, cfg, group, graph=True)
            gc_combine = ceiling(buf, matrix, False, hidden * 2, combine_bytes, blocks, device, cfg, group, graph=True)
            _add_rows(rows, buf, cfg, tokens, (("ll_dispatch_graph", g_dispatch, gc_dispatch, dispatch_bytes, prec),
                                               ("ll_combine_graph", g_combine, gc_combine, combine_bytes, "bf16")),
                      "low_latency")
            engine = buf.backend.engine("low_latency")
            if getattr(engine, "trace", None) is not None:   # DEEPEP_PORTABLE_PROFILE=1
                for what, fn in (("low_latency_dispatch", dispatch), ("low_latency_combine", combine)):
                    print_graph_trace(engine, fn, what, group, rank, tokens)
        if cfg.baseline:
            _add_baseline_rows(rows, cfg, tokens, matrix, rank, group, device,
                               (("a2a_dispatch", True, d_row, dispatch_bytes, c_dispatch, prec),
                                ("a2a_combine", False, hidden * 2, combine_bytes, c_combine, "bf16")), loop)


def _token_in_rank(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """[tokens, ranks] bool: whether a token has one of its top-k experts on each rank (from top-k alone,
    as the oracle routes; -1 entries route nowhere)."""
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // (num_experts // world), torch.zeros_like(topk_idx))
    ranks = torch.arange(world, device=topk_idx.device)
    return ((dest.unsqueeze(-1) == ranks) & valid.unsqueeze(-1)).any(1)


def _our_ops(cfg: argparse.Namespace, group, world: int, tokens: int):
    """(ElasticBuffer or None, V1 Buffer (underneath), dispatch(sms) -> fn, combine(sms, x, handle) -> fn,
    unpack(dispatch output) -> (recv_x, handle), inputs (x, x_in, topk_idx)) of the sweep's API, made to be
    destroyed: V2's ElasticBuffer (FP8 as its (data, scales) tuple, the layout folded into its dispatch) or V1's
    Buffer (the layout computed once, as bench_normal times it). A budget of None (the CPU): the API's default."""
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.experts
    if cfg.api == "v2":
        from ..buffers.elastic import ElasticBuffer

        elastic = ElasticBuffer(group, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk,
                                use_fp8_dispatch=cfg.fp8, transport=cfg.transport, explicitly_destroy=True)
        buf = elastic.runtime
    else:
        elastic, buf = None, Buffer(group, Config().get_nvl_buffer_size_hint(hidden * 2, world, tokens), 0,
                                    transport=cfg.transport, explicitly_destroy=True)
    rank = buf.rank
    gen = torch.Generator().manual_seed(1000 * rank + tokens)   # bench_normal's draws: a peer gets the same
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(buf.device)
    topk_idx = _random_topk(tokens, experts, topk, buf.device, gen)
    topk_weights = torch.rand(tokens, topk, generator=gen).to(buf.device)
    x_in = fp8_cast(x, False) if cfg.fp8 else x
    if elastic is not None:
        def dispatch(sms):
            return lambda: elastic.dispatch(x_in, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=experts,
                                            num_sms=sms or 0)

        def combine(sms, y, handle):
            return lambda: elastic.combine(y, handle, num_sms=sms or 0)

        def unpack(out):
            return out[0], out[3]
    else:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)

        def config(sms, make):
            return None if sms is None else dataclasses.replace(make(world), num_sms=sms)

        def dispatch(sms):
            c = config(sms, Buffer.get_dispatch_config)
            return lambda: buf.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                                        config=c)

        def combine(sms, y, handle):
            c = config(sms, Buffer.get_combine_config)
            return lambda: buf.combine(y, handle, config=c)

        def unpack(out):
            return out[0], out[4]
    return elastic, buf, dispatch, combine, unpack, (x, x_in, topk_idx)


def bench_sweep(rank: int, world: int, group, cfg: argparse.Namespace, tokens: int, rows: List[Row],
                models: Dict[Tuple[str, int], List[str]]) -> None:
    """Normal-mode dispatch and combine at every SM budget of --num-sms, in one Buffer (V2's ElasticBuffer with
    --api v2, else V1's), the budget given per call; each budget's round trip is checked against the oracle
    before it is timed, and printed beside the ceiling with the same blocks. Then, with --compare and our Buffer
    gone (as bench_normal's is before its peer runs), the peer's own sweep (--compare-num-sms) on the same
    inputs, beside the ceilings with its blocks. With --api v2, `models` gets get_theoretical_num_sms's picks
    per op, with their inputs. On the CPU there are no SMs: the sweep runs as one row per op."""
    gpu = torch.cuda.is_available()
    peer_budgets: List[Optional[int]] = (list(cfg.compare_sms) if gpu else [None]) if cfg.compare else []
    ceilings, nbytes = _sweep_ours(rank, world, group, cfg, tokens, rows, models, peer_budgets)
    if cfg.compare:
        prec = "fp8" if cfg.fp8 else "bf16"
        for op, sms, t in compare.bench_peer_sweep(cfg.compare, rank, world, group, cfg, tokens, peer_budgets,
                                                   _random_topk):
            c = ceilings[sms][op == "combine"]
            n = nbytes[op == "combine"]
            rows.append(Row(op, tokens, cfg.hidden, cfg.topk, cfg.experts, "bf16" if op == "combine" else prec,
                            t * 1e6, n / t / 1e9, c * 1e6, n / c / 1e9, cfg.compare, sms, sms, "v1"))


def _sweep_ours(rank: int, world: int, group, cfg: argparse.Namespace, tokens: int, rows: List[Row],
                models: Dict[Tuple[str, int], List[str]], peer_budgets: List[Optional[int]]):
    """bench_sweep's rows of ours; returns the ceilings ({blocks (None off SMs): (dispatch, combine) seconds},
    ours and the peer's budgets' blocks) and the ops' payload bytes (dispatch, combine)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gpu = device.type == "cuda"
    budgets: List[Optional[int]] = list(cfg.sms_sweep) if gpu else [None]
    hidden, prec = cfg.hidden, "fp8" if cfg.fp8 else "bf16"
    elastic, buf, dispatch, combine, unpack, (x, x_in, topk_idx) = _our_ops(cfg, group, world, tokens)
    with start_line(buf, cfg):
        in_rank = _token_in_rank(topk_idx, cfg.experts, world)
        per_rank = in_rank.sum(0).to(torch.int64)
        everyone = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(everyone, per_rank, group=group)
        matrix = [[int(v) for v in t.tolist()] for t in everyone]
        expected_rows = sum(matrix[s][rank] for s in range(world))
        ref_src = (x_in[0].float() * x_in[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) if cfg.fp8 else x
        expected = _identity_round_trip(ref_src, in_rank, 0)
        sent_rows = int(in_rank.sum())
        row_bytes = _dispatch_row_bytes(hidden, cfg.fp8)
        dispatch_bytes, combine_bytes = sent_rows * row_bytes, sent_rows * hidden * 2
        timed = []
        for sms in budgets:
            recv_x, handle = unpack(dispatch(sms)())
            got_rows = (recv_x[0] if cfg.fp8 else recv_x).size(0)
            if got_rows != expected_rows:
                raise AssertionError(f"rank {rank}, {sms} SMs: received {got_rows} rows, expected {expected_rows}")
            combine_in = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16) \
                if cfg.fp8 else recv_x
            combined = combine(sms, combine_in, handle)()[0]
            if not torch.equal(combined, expected):
                bad = (combined != expected).any(1).nonzero().flatten()[:5].tolist()
                raise AssertionError(f"rank {rank}, {sms} SMs: combine differs from the oracle at tokens {bad}")
            host_d: list = []   # each timed sample's host seconds per call (from entering the op to its return)
            host_c: list = []
            timed.append((sms, slowest(timer(device, dispatch(sms), cfg.warmup, cfg.iters, group, host_times=host_d),
                                       group),
                          slowest(timer(device, combine(sms, combine_in, handle), cfg.warmup, cfg.iters, group,
                                        host_times=host_c), group)))
            if gpu and host_d:   # an op whose host part is as long as its GPU time is host-bound at this budget
                hd, hc = (slowest(statistics.median(h), group) * 1e6 for h in (host_d, host_c))
                if rank == 0:
                    print(f"[sweep {cfg.api}] {sms} SMs: host time per call (slowest rank) dispatch {hd:.1f} us, "
                          f"combine {hc:.1f} us", flush=True)
            if gpu and os.environ.get("DEEPEP_PORTABLE_PROFILE_HOST") == "1" and sms == budgets[0]:
                print_host_profile(f"{cfg.api} dispatch, {sms} SMs, {tokens} tokens", dispatch(sms), device, rank == 0)
                print_host_profile(f"{cfg.api} combine, {sms} SMs, {tokens} tokens", combine(sms, combine_in, handle),
                                   device, rank == 0)
        engine = buf.backend.engine("normal")
        blocks = {sms: (engine.grid(sms) if engine is not None else sms) if gpu else None for sms in budgets}
        ceilings = {}   # blocks -> (dispatch, combine) ceiling seconds, each measured once
        for b in sorted({b for b in blocks.values() if b is not None} | {b for b in peer_budgets if b is not None}) \
                or [None]:
            n = b if b is not None else _blocks(buf)
            ceilings[b] = (ceiling(buf, matrix, True, row_bytes, dispatch_bytes, n, device, cfg, group),
                           ceiling(buf, matrix, False, hidden * 2, combine_bytes, n, device, cfg, group))
    api = cfg.api
    for sms, t_dispatch, t_combine in timed:
        c_dispatch, c_combine = ceilings[blocks[sms]]
        for op, t, c, nbytes, p in (("dispatch", t_dispatch, c_dispatch, dispatch_bytes, prec),
                                    ("combine", t_combine, c_combine, combine_bytes, "bf16")):
            rows.append(Row(op, tokens, hidden, cfg.topk, cfg.experts, p, t * 1e6, nbytes / t / 1e9, c * 1e6,
                            nbytes / c / 1e9, buf.transport, blocks[sms], sms, api))
    if elastic is not None:
        for op in ("dispatch", "combine"):
            models[(op, tokens)] = model_lines(elastic, cfg.experts, cfg.topk,
                                               [r for r in rows if r.op == op and r.tokens == tokens and r.api == api])
    # Gone before the next Buffer opens (the peer's, the next token count's): open Buffers share a rank's SMs
    (elastic or buf).destroy()
    return ceilings, (dispatch_bytes, combine_bytes)


def model_lines(elastic, num_experts: int, num_topk: int, rows: List[Row]) -> List[str]:
    """get_theoretical_num_sms's picks for one op, with the inputs each used: its nominal ones (what a V2 caller
    gets with no rates given) and this run's (measured_model_inputs), where the rows ran on SMs."""
    import inspect

    from ..buffers import elastic as elastic_module
    from .model import ranks_per_token

    defaults = {k: v.default for k, v in inspect.signature(elastic.get_theoretical_num_sms).parameters.items()}
    distinct = ranks_per_token(elastic.num_ranks, num_experts, num_topk)
    nominal = elastic.get_theoretical_num_sms(num_experts, num_topk)
    lines = [f"get_theoretical_num_sms({num_experts}, {num_topk}) = {nominal} with its nominal inputs: NVLink "
             f"{elastic_module.NOMINAL_NVLINK_GBS:.0f} GB/s, SM read {defaults['sm_read_gbs']} GB/s, SM write "
             f"{defaults['sm_write_gbs']} GB/s, {distinct:.2f} ranks per token, {elastic.num_nvlink_ranks} of "
             f"{elastic.num_ranks} ranks over NVLink"]
    measured = measured_model_inputs(rows)
    if measured is not None:
        link, rate, how = measured
        pick = elastic.get_theoretical_num_sms(num_experts, num_topk, nvlink_gbs=link, sm_write_gbs=rate)
        lines.append(f"get_theoretical_num_sms(..., nvlink_gbs={link:.1f}, sm_write_gbs={rate:.1f}) = {pick} with "
                     f"this run's inputs: link = the sweep's fastest ceiling; per SM: {how}")
    return lines


SWEEP_HEADER = ["op", "tokens", "api", "transport", "SMs", "blocks", "time_us", "GB/s", "ceil_GB/s", "of_ceil"]


def print_sweep(rows: List[Row], world: int, models: Dict[Tuple[str, int], List[str]], peer: Optional[str] = None,
                budgets: Optional[List[int]] = None, peer_ceiling: bool = False,
                tolerance: float = PICK_TOLERANCE) -> None:
    """The --num-sms sweep's table (a row per op, API and SM budget; SMs: the budget asked for, blocks: what the
    kernels and their ceiling ran) and, per op, the measured best budget, the pick (the fewest SMs within
    `tolerance` of the best), get_theoretical_num_sms's picks (`models`) and the peer's best over its own
    sweep with its time over ours. Rows without SMs (the CPU) have no SM columns and no best or pick."""
    with_sms = any(r.sms is not None for r in rows)
    print(f"\n{world} ranks on {_device_name()}; SM sweep; ceiling = {_ceiling_words(peer_ceiling)}same run"
          + (", with the row's blocks" if with_sms else ""))
    if not with_sms and budgets:
        print(f"(the CPU has no SMs: --num-sms {' '.join(map(str, budgets))} ran as one row per op)")
    peer_best: Dict[Tuple[str, int], Row] = {}   # the peer's best per op: its fastest budget, ties to fewer SMs
    for r in sorted((r for r in rows if peer is not None and r.transport == peer),
                    key=lambda r: (r.time_us, r.budget or 0)):
        peer_best.setdefault((r.op, r.tokens), r)
    header = [h for h in SWEEP_HEADER if with_sms or h not in ("SMs", "blocks")]
    if peer_best:
        header.append(f"{peer}_best/time")
    cells = [header]
    for r in rows:
        line = [r.op, str(r.tokens), r.api, r.transport] + ([str(r.budget), str(r.sms)] if with_sms else []) + [
            f"{r.time_us:.1f}", f"{r.gbps:.2f}", f"{r.ceiling_gbps:.2f}", f"{100 * r.ceiling_us / r.time_us:.1f}%"]
        if peer_best:
            best = peer_best.get((r.op, r.tokens))
            line.append(f"{best.time_us / r.time_us:.3f}" if best is not None and r.transport != peer else "-")
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    for tokens in dict.fromkeys(r.tokens for r in rows):
        for op in dict.fromkeys(r.op for r in rows if r.tokens == tokens and r.transport != peer):
            mine = [r for r in rows if r.op == op and r.tokens == tokens and r.transport != peer]
            said = []
            times = {r.budget: r.time_us for r in mine if r.budget is not None and r.sms is not None}
            if times:
                best, pick = best_budget(times), pick_budget(times, tolerance)
                said.append(f"measured best: {best} SMs, {times[best]:.1f} us; pick (fewest SMs within "
                            f"{100 * tolerance:.0f} % of the best): {pick} SMs, {times[pick]:.1f} us "
                            f"(+{100 * (times[pick] / times[best] - 1):.1f} %)")
            said += models.get((op, tokens), [])
            for peer_op in (op, "layout+" + op):
                p = peer_best.get((peer_op, tokens))
                if p is None:
                    continue
                swept = sorted(r.budget for r in rows if r.transport == peer and r.op == peer_op
                               and r.tokens == tokens and r.budget is not None)
                where = f"best over {' '.join(map(str, swept))} SMs: {p.budget} SMs, " if swept else ""
                ours = f"; its time / ours at the pick = {p.time_us / times[pick]:.3f}" if times else \
                    f"; its time / ours = {p.time_us / mine[0].time_us:.3f}"
                said.append(f"{peer} {peer_op}: {where}{p.time_us:.1f} us{ours}")
            if said:
                print(f"\n{op}, {tokens} tokens, {mine[0].api} ({mine[0].transport}):\n  " + "\n  ".join(said))
    sys.stdout.flush()


def _worker(rank: int, world: int, group, cfg: argparse.Namespace) -> None:
    if not torch.cuda.is_available():   # ranks share the cores: no oversubscribed thread pools
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.num_sms is not None:   # spawned ranks import the module afresh: set it here, not in the parent
        Buffer.set_num_sms(cfg.num_sms)
    cfg.peer_ceiling = torch.cuda.is_available() and (
        cfg.ceiling == "pattern" or (cfg.ceiling == "auto" and _ranks_span_gpus(group)))
    rows: List[Row] = []
    # A peer's LL kernels run only where every rank has a GPU of its own (or on the CPU): compare.py says why.
    peer_ll = not torch.cuda.is_available() or _ranks_span_gpus(group)
    sweep = cfg.tokens
    progress = sweep
    if rank == 0 and not cfg.no_progress:
        try:
            from tqdm import tqdm

            progress = tqdm(sweep, desc=f"bench {cfg.mode} x{world}", file=sys.stderr)
        except ImportError:
            pass
    sweep_models: Dict[Tuple[str, int], List[str]] = {}
    for tokens in progress:
        if cfg.sms_sweep is not None:
            bench_sweep(rank, world, group, cfg, tokens, rows, sweep_models)
            continue
        (bench_low_latency if cfg.mode == "low_latency" else bench_normal)(rank, world, group, cfg, tokens, rows)
        if cfg.compare and cfg.mode == "normal":
            compare.bench_peer_normal(cfg.compare, rank, world, group, cfg, tokens, rows, Row, _random_topk)
        elif cfg.compare and cfg.mode == "low_latency" and peer_ll:
            compare.bench_peer_low_latency(cfg.compare, rank, world, group, cfg, tokens, rows, Row, _random_topk)
    if rank == 0 and cfg.sms_sweep is not None:
        print_sweep(rows, world, sweep_models, cfg.compare, cfg.sms_sweep, cfg.peer_ceiling)
    elif rank == 0:
        print_table(rows, world, cfg.peer_ceiling, getattr(cfg, "internode_ceiling", False))
        if cfg.compare:
            compare.print_comparison(rows, cfg.compare)
            if cfg.mode == "internode" or (cfg.mode == "low_latency" and not peer_ll):
                print(f"({cfg.mode} mode: {cfg.compare} not run here; see deepep_portable/tools/compare.py)")
        if cfg.plot:
            plot(rows, cfg.plot, world)


def _ranks_span_gpus(group) -> bool:
    """True when the ranks are on more than one GPU of one node (then the ceiling copies over the
    links; across nodes the pattern copy cannot map the peers' memory, so the plain copy stays)."""
    if not torch.cuda.is_available():
        return False
    from ..topology import node_identity
    from ..device import device_uuid

    where = [None] * dist.get_world_size(group)
    dist.all_gather_object(where, (node_identity(), device_uuid(torch.cuda.current_device())), group=group)
    return len({host for host, _ in where}) == 1 and len({uuid for _, uuid in where}) > 1


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def _ceiling_words(peer_ceiling: bool) -> str:
    return ("the op's traffic pattern copied straight into the peers' memory (over the GPU links), "
            if peer_ceiling else "one plain copy of the same bytes on the same device, ")


def print_table(rows: List[Row], world: int, peer_ceiling: bool = False, internode: bool = False) -> None:
    dev = _device_name()
    what = _ceiling_words(peer_ceiling)
    if internode:
        what = ("for dispatch / combine and their :net / :nvl parts, the op's own traffic in one launch through "
                "its paths (network rows by the transport's put, node rows by load/store; layout: "
                f"{what.rstrip(', ')}), ")
    with_sms = any(r.sms is not None for r in rows)   # no SMs column where nothing ran on SMs (the CPU)
    print(f"\n{world} ranks on {dev}; ceiling = {what}same run"
          + (", with the same number of blocks (SMs column)" if with_sms else ""))
    keep = [i for i, name in enumerate(HEADER) if with_sms or name != "SMs"]
    cells = [[line[i] for i in keep] for line in [HEADER] + [r.cells() for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keep))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    sys.stdout.flush()


MARKERS = "osD^vP*X"   # one per transport of an op (ours, a --compare peer, the NCCL baseline)


def plot_figure(rows: List[Row], world: int):
    """The --plot figure: logical GB/s over tokens per rank, both axes logarithmic (ops and token counts span
    orders of magnitude); one colour per op, shared by its ceiling (dashed), one marker per transport."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ops = list(dict.fromkeys(r.op for r in rows))   # in the table's order
    palette = plt.get_cmap("tab10" if len(ops) <= 10 else "tab20")
    transports = list(dict.fromkeys(r.transport for r in rows))
    for i, op in enumerate(ops):
        colour = palette(i % palette.N)
        mine = [r for r in rows if r.op == op]
        for transport in dict.fromkeys(r.transport for r in mine):
            pts = sorted((r for r in mine if r.transport == transport), key=lambda r: r.tokens)
            ax.plot([r.tokens for r in pts], [r.gbps for r in pts], color=colour,
                    marker=MARKERS[transports.index(transport) % len(MARKERS)], label=f"{op} ({transport})")
        ceiling = sorted({r.tokens: r for r in mine}.values(), key=lambda r: r.tokens)   # the same for every transport
        ax.plot([r.tokens for r in ceiling], [r.ceiling_gbps for r in ceiling], color=colour, linestyle="--",
                label=f"{op} ceiling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    tokens = sorted({r.tokens for r in rows})
    ax.set_xticks(tokens, [str(t) for t in tokens])   # the token counts run, as numbers
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("logical GB/s per rank")
    ax.set_title(f"deepep_portable bench, {world} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))   # beside the lines, never over them
    fig.tight_layout()
    return fig


def plot(rows: List[Row], path: str, world: int) -> None:
    fig = plot_figure(rows, world)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"plot written to {path}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--mode", choices=["normal", "low_latency", "internode"], default="normal",
                   help="internode: normal mode over logical nodes of --ranks-per-node ranks (docs/INTERNODE.md)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="internode mode: ranks per node (default: half)")
    p.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank, several values make a sweep (default: GPU 512 4096, CPU 64 256)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 dispatch (default: on for normal mode and low-latency)")
    p.add_argument("--transport", default="auto")
    p.add_argument("--num-sms", type=int, nargs="+", default=None,
                   help="SM budget per rank; several values make a sweep (normal mode): dispatch and combine at "
                        "each in one Buffer, the best, the fewest SMs within 10 %% of it and, with --api v2, "
                        "get_theoretical_num_sms's pick")
    p.add_argument("--api", choices=["v1", "v2"], default="v1",
                   help="v2: time ElasticBuffer's dispatch (its layout folded in; FP8 as V2's (data, scales) "
                        "tuple) and combine, as an SM sweep (normal mode)")
    p.add_argument("--compare-num-sms", dest="compare_sms", type=int, nargs="+", default=[8, 16, 24],
                   help="SM budgets of the --compare peer in an SM sweep (default: 8 16 24)")
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--baseline", action="store_true",
                   help="also time torch.distributed.all_to_all_single over NCCL for the same rows (one GPU per rank)")
    p.add_argument("--ceiling", choices=["auto", "copy", "pattern"], default="auto",
                   help="copy: one plain copy of the op's bytes on the device; pattern (GPU): the op's "
                        "rank-to-rank traffic copied into the peers' memory; auto: pattern when the ranks "
                        "span GPUs, else copy")
    p.add_argument("--start-line", choices=["gpu", "host"], default="gpu",
                   help="where a timed sample starts on every rank: gpu (default): after a barrier, at a "
                        "one-thread kernel that all ranks' streams leave together; host: after the barrier "
                        "only (the processes' exit skew then counts in the op's time)")
    p.add_argument("--compare", default=None, metavar="MODULE",
                   help="also drive MODULE (a library with DeepEP V1's API, e.g. deep_ep) on the same inputs with "
                        "the same timing, right after our rows, and print its time over ours (normal mode)")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--no-progress", action="store_true")


def main(cfg: argparse.Namespace) -> int:
    if cfg.tokens is None:
        cfg.tokens = ([128] if cfg.mode == "low_latency" else [512, 4096]) if torch.cuda.is_available() \
            else ([32, 128] if cfg.mode == "low_latency" else [64, 256])
    if cfg.fp8 is None:
        cfg.fp8 = True
    problem = sweep_settings(cfg)
    if problem:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    run_local(_worker, cfg.ranks, cfg)
    return 0


def sweep_settings(cfg: argparse.Namespace) -> Optional[str]:
    """Settle --num-sms and --api: cfg.num_sms becomes the one budget of a plain run (None: the default) and
    cfg.sms_sweep the budgets of an SM sweep (several values, or --api v2; None: no sweep). Returns what is
    wrong with the arguments, or None."""
    budgets = cfg.num_sms if isinstance(cfg.num_sms, list) else ([cfg.num_sms] if cfg.num_sms is not None else None)
    api = getattr(cfg, "api", "v1")
    cfg.api = api
    cfg.compare_sms = getattr(cfg, "compare_sms", [8, 16, 24])
    cfg.sms_sweep = None
    cfg.num_sms = budgets[0] if budgets is not None and len(budgets) == 1 else None
    if api == "v1" and (budgets is None or len(budgets) == 1):
        return None
    cfg.sms_sweep = list(dict.fromkeys(budgets)) if budgets is not None else [Buffer.num_sms]
    if cfg.mode != "normal":
        return f"an SM sweep (several --num-sms values, or --api v2) runs in normal mode only, not {cfg.mode}"
    for flag, value in (("--plot", cfg.plot), ("--baseline", cfg.baseline)):
        if value:
            return f"{flag} is not part of an SM sweep (several --num-sms values, or --api v2)"
    for sms in cfg.sms_sweep + (cfg.compare_sms if cfg.compare else []):
        if sms <= 0 or sms % 2:
            return f"SM budgets are even and positive (DeepEP's channels take two SMs each), got {sms}"
    return None
