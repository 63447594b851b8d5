"""`python -m deepep_portable model`: what the normal-mode ops should take on real NVLink,
from rates measured on the two-H200 machine, and which part of each op would dominate there.

The model follows the intranode kernels as built (docs/INTRANODE.md): an op is a fixed part (host path,
count exchange, launches, the host's wait for the receive count) plus a local staging copy plus one main copy
across the ranks, which the SMs drive (so its rate grows with the block budget) until this GPU's NVLink is
the limit (only the bytes to other GPUs cross it):

    t = fixed + staged_bytes / HBM copy rate + main_bytes / min(blocks x per-block rate,
                                                                 link rate / share of main bytes that is remote)

  dispatch: staged = my tokens once (FP8: 7168 + 56 x 4 bytes a row); main = the rows every rank receives
            (a token goes once to each distinct rank of its top-k experts);
  combine:  staged = the rows I received from other ranks, BF16 (a rank's own rows are read in its x, not
            staged); main = every row I received, read back by its source.
  dispatch_zc / combine_zc (`--zero-copy`): the same ops when the caller wrote their rows into the Buffer
            (get_next_dispatch_buffer / get_next_combine_buffer): no staging copy, the rest unchanged.

Inputs (docs/PERFORMANCE.md, the two-H200 run, `nvidia-h200-x2`, EP 2, 20 blocks): the P2P copy-engine rate
between the two H200s (390 GB/s a direction), the local copy rate (2070 GB/s), and the op times at 4096 and
16384 tokens (dispatch FP8 392.4 / 862.6 us, combine BF16 488.3 / 1400.6 us), from which `fit()` solves each
op's fixed part and per-block rate (two equations, two unknowns). Those combines staged every received row, own
ones included: the fit counts the bytes of the code it was measured on (`own_rows_staged=True`), the
predictions those of today's. EP 2 tells nothing about many peers at
once: the prediction assumes an NVSwitch node gives every GPU the same per-direction rate to all its peers
together as the measured pair had, and the fixed part does not grow with the rank count. Both are
assumptions to check on the first 8-GPU run.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from math import comb
from typing import Dict, List, Tuple

HIDDEN, TOPK, EXPERTS = 7168, 8, 256
FP8_ROW = HIDDEN + HIDDEN // 128 * 4
BF16_ROW = HIDDEN * 2
LINK_GBPS = 390.0          # P2P copy engine, GPU0 <-> GPU1 (NV18), a direction
HBM_COPY_GBPS = 2070.0     # local copy_ on one H200
EP2_BLOCKS = 20
# (op, tokens) -> measured us at EP 2, 20 blocks (the two-H200 run, docs/PERFORMANCE.md)
EP2_MEASURED = {("dispatch", 4096): 392.4, ("dispatch", 16384): 862.6,
                ("combine", 4096): 488.3, ("combine", 16384): 1400.6}


def ranks_per_token(num_ranks: int, experts: int = EXPERTS, topk: int = TOPK) -> float:
    """Expected distinct ranks among a token's top-k experts (experts spread evenly, uniform routing)."""
    per_rank = experts // num_ranks
    miss = comb(experts - per_rank, topk) / comb(experts, topk)   # P(no expert of one rank)
    return num_ranks * (1.0 - miss)


def _base(op: str) -> str:
    """The op a zero-copy form ("<op>_zc") is of."""
    return op[:-3] if op.endswith("_zc") else op


def op_bytes(op: str, num_ranks: int, tokens: int, own_rows_staged: bool = False) -> Tuple[float, float]:
    """(staged bytes, main bytes) per rank of one op (its zero-copy form "<op>_zc" stages nothing). The combine
    stages the rows from other ranks only (each rank is sent 1/R of the rows), unless `own_rows_staged` (the code
    the EP 2 measurements ran, which staged a rank's own rows too)."""
    rows = tokens * ranks_per_token(num_ranks)
    base = _base(op)
    if base == "dispatch":
        staged, main = tokens * FP8_ROW, rows * FP8_ROW
    else:
        staged, main = rows * BF16_ROW * (1.0 if own_rows_staged else (num_ranks - 1) / num_ranks), rows * BF16_ROW
    return (0.0 if base != op else staged), main


def main_rate(per_block_gbps: float, blocks: int, num_ranks: int, link_gbps: float = LINK_GBPS) -> Tuple[float, str]:
    """GB/s of the main copy and what bounds it: the SMs, or this GPU's NVLink (remote share (R-1)/R)."""
    sms = blocks * per_block_gbps
    remote = (num_ranks - 1) / num_ranks
    link = link_gbps / remote if remote > 0 else float("inf")
    return (sms, "SMs") if sms <= link else (link, "NVLink")


@dataclass(frozen=True)
class Fit:
    fixed_us: float
    per_block_gbps: float


def fit(op: str) -> Fit:
    """The op's fixed part and per-block rate from its two EP 2 measurements (at EP 2, 20 blocks the SMs bound)."""
    (s1, m1), (s2, m2) = op_bytes(op, 2, 4096, True), op_bytes(op, 2, 16384, True)   # the measured code
    t1, t2 = EP2_MEASURED[(op, 4096)], EP2_MEASURED[(op, 16384)]
    stage = lambda s: s / HBM_COPY_GBPS / 1e3   # noqa: E731  (bytes -> us at GB/s)
    rate = (m2 - m1) / ((t2 - stage(s2)) - (t1 - stage(s1))) / 1e3   # GB/s of the main copy at 20 blocks
    fixed = t1 - stage(s1) - m1 / rate / 1e3
    return Fit(fixed, rate / EP2_BLOCKS)


@dataclass
class Prediction:
    op: str
    ranks: int
    tokens: int
    blocks: int
    fixed_us: float
    stage_us: float
    main_us: float
    bound: str

    @property
    def total_us(self) -> float:
        return self.fixed_us + self.stage_us + self.main_us

    @property
    def dominant(self) -> str:
        parts = {"fixed (host, counts, launches)": self.fixed_us, "staging copy": self.stage_us,
                 f"main copy ({self.bound}-bound)": self.main_us}
        return max(parts, key=parts.get)


def predict(op: str, num_ranks: int, tokens: int, blocks: int, link_gbps: float = LINK_GBPS,
            own_rows_staged: bool = False) -> Prediction:
    f = fit(_base(op))
    staged, main = op_bytes(op, num_ranks, tokens, own_rows_staged)
    rate, bound = main_rate(f.per_block_gbps, blocks, num_ranks, link_gbps)
    return Prediction(op, num_ranks, tokens, blocks, f.fixed_us, staged / HBM_COPY_GBPS / 1e3, main / rate / 1e3,
                      bound)


def table(ranks: List[int], tokens: List[int], blocks: List[int], zero_copy: bool = False) -> List[Prediction]:
    ops = ("dispatch", "dispatch_zc", "combine", "combine_zc") if zero_copy else ("dispatch", "combine")
    return [predict(op, r, t, b) for op in ops for r in ranks for t in tokens for b in blocks]


def print_model(preds: List[Prediction]) -> None:
    print("fit from EP 2 (20 blocks): " + "; ".join(
        f"{op}: fixed {fit(op).fixed_us:.0f} us, {fit(op).per_block_gbps:.1f} GB/s per block" for op in
        ("dispatch", "combine")))
    print("fit points, exact by construction (model of the measured code / measured at EP 2): " + ", ".join(
        f"{op} {t}: {predict(op, 2, t, EP2_BLOCKS, own_rows_staged=True).total_us:.0f} / {m:.0f} us"
        for (op, t), m in EP2_MEASURED.items()))
    head = ["op", "EP", "tokens", "blocks", "fixed_us", "stage_us", "main_us", "total_us", "GB/s", "dominant"]
    rows = [head]
    for p in preds:
        main_bytes = op_bytes(p.op, p.ranks, p.tokens)[1]
        rows.append([p.op, str(p.ranks), str(p.tokens), str(p.blocks), f"{p.fixed_us:.0f}", f"{p.stage_us:.0f}",
                     f"{p.main_us:.0f}", f"{p.total_us:.0f}", f"{main_bytes / p.total_us / 1e3:.0f}", p.dominant])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 24])
    p.add_argument("--zero-copy", action="store_true", help="also the zero-copy forms of the ops (no staging)")


def main(args: argparse.Namespace) -> int:
    print_model(table(args.ranks, args.tokens, args.blocks, args.zero_copy))
    return 0


def summary() -> Dict[str, float]:
    """EP 8, 4096 tokens, 24 blocks: predicted us per op (docs and tests quote it)."""
    return {op: predict(op, 8, 4096, 24).total_us for op in ("dispatch", "combine")}
