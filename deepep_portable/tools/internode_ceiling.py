"""The ceiling of `bench --mode internode`: an op's own rank-to-rank traffic moved in one launch with the
op's blocks through the op's own paths (csrc/common/kernels/internode/ceiling.cu): rows that cross the
network through the transport's put to the rank the op sends them to, rows that stay in the node copied
into the node peer's window by load/store. The op adds staging, signals, waits and reductions to the
same bytes; this is what it would take without them.

Traffic of one rank (docs/INTERNODE.md), with matrix[s][d] the rows rank s sends rank d and
node_counts[s][m] the tokens of s that reach node m:
  dispatch  network: my tokens once per other node m, to the landing rank (m, my local index);
            node: as landing rank, what the sources (any node, my local index) send each rank j of my node;
  combine   node: my received rows to the landing rank of their source's local index in my node;
            network: as landing rank, one partial per token of source (m, my local index) that reached my node.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple

import torch

from .ceilings import _ceiling_seconds

PIECE_BYTES = 64 * 1024   # one warp's share of a destination's bytes at a time
VIA_TRANSPORT, VIA_NODE = 0, 1


def internode_traffic(matrix: Sequence[Sequence[int]], node_counts: Sequence[Sequence[int]], rank: int,
                      ranks_per_node: int, forward: bool, row_bytes: int
                      ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(network, node) traffic of `rank` in one op: [(global rank, bytes)] through the transport and
    [(local index, bytes)] by load/store; `forward`: dispatch, else combine. Rows are rounded up to 16 bytes;
    destinations with no bytes are left out."""
    P = ranks_per_node
    M = len(matrix) // P
    node, local = divmod(rank, P)
    row = (row_bytes + 15) // 16 * 16
    if forward:
        net = [(m * P + local, node_counts[rank][m]) for m in range(M) if m != node]
        nvl = [(j, sum(matrix[m * P + local][node * P + j] for m in range(M))) for j in range(P)]
    else:
        net = [(m * P + local, node_counts[m * P + local][node]) for m in range(M) if m != node]
        nvl = [(j, sum(matrix[m * P + j][rank] for m in range(M))) for j in range(P)]
    return [(d, n * row) for d, n in net if n], [(j, n * row) for j, n in nvl if n]


def traffic_pieces(net: Sequence[Tuple[int, int]], nvl: Sequence[Tuple[int, int]], region: Tuple[int, int],
                   rank: int, num_ranks: int, piece_bytes: int = PIECE_BYTES) -> List[Tuple[int, int, int, int]]:
    """The ceiling kernel's pieces (ceiling.cu): (destination | via << 32, destination offset, source offset,
    bytes), at most piece_bytes each, destinations interleaved (piece i of every destination before piece
    i + 1 of any) so the warps spread over the peers as the op's do. Offsets wrap around the windows' data
    `region` [start, end): the bytes are scratch, only their movement counts; each rank starts writing at its
    own place there so that writers of one window do not all hit the same lines."""
    start, end = region
    piece = max(16, min(piece_bytes, (end - start) // 16 * 16) // 16 * 16)
    span = (end - start) // piece * piece
    if span <= 0:
        raise ValueError(f"the data region [{start}, {end}) holds no {piece}-byte piece")
    queues = []
    for via, items in ((VIA_TRANSPORT, net), (VIA_NODE, nvl)):
        for dest, nbytes in items:
            queues.append([(dest | via << 32, nbytes_i) for nbytes_i in _split(nbytes, piece)])
    pieces: List[Tuple[int, int, int, int]] = []
    first = rank * span // max(1, num_ranks) // piece * piece
    dst_at = [first] * len(queues)
    src_at = 0
    for i in range(max((len(q) for q in queues), default=0)):
        for k, q in enumerate(queues):
            if i < len(q):
                head, nbytes = q[i]
                pieces.append((head, start + dst_at[k], start + src_at, nbytes))
                dst_at[k] = (dst_at[k] + piece) % span
                src_at = (src_at + piece) % span
    return pieces


def _split(nbytes: int, piece: int) -> List[int]:
    return [min(piece, nbytes - at) for at in range(0, nbytes, piece)]


def internode_ceiling(buf, matrix: Sequence[Sequence[int]], node_counts: Sequence[Sequence[int]], forward: bool,
                      row_bytes: int, blocks: int, device: torch.device, cfg: argparse.Namespace,
                      group) -> Optional[float]:
    """Seconds per call of the op's traffic through its own paths (every rank at once, timed as the op is),
    or None where the Buffer has no internode kernel engine (the reference transport, no GPU)."""
    engine = buf.backend.engine("normal")
    if device.type != "cuda" or not hasattr(engine, "traffic_copy"):
        return None
    net, nvl = internode_traffic(matrix, node_counts, buf.rank, engine.ranks_per_node, forward, row_bytes)
    plan = traffic_pieces(net, nvl, engine.traffic_region, buf.rank, engine.num_ranks)
    pieces = torch.tensor(plan or [(0, 0, 0, 0)], dtype=torch.int64, device=device)[:len(plan)]
    return _ceiling_seconds(lambda: engine.traffic_copy(pieces, blocks), device, cfg, group, 1, False)
