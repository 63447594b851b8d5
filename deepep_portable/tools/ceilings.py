"""The ceilings every benchmark row is printed beside (docs/PERFORMANCE.md conventions), and the peer
baseline:
  * copy: one plain copy of the op's bytes on the device, with the op's block budget (ranks sharing
    one GPU: every byte lands in its HBM either way);
  * pattern: the op's own rank-to-rank traffic copied in one launch straight into the peers' memory
    (CUDA IPC, so over NVLink between GPUs), when the ranks span GPUs;
  * all_to_all_single over NCCL for the same rows (what a user would pick without this library)."""
from __future__ import annotations

import argparse
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..windows.ipc import IpcWindow
from .kernels import SegmentCopy, copy_with_blocks
from .timing import graph_seconds, slowest, timer


def _ceiling_seconds(copy: Callable[[], None], device: torch.device, cfg: argparse.Namespace, group,
                     loop: int, graph: bool) -> float:
    """Seconds per call of a ceiling copy, timed as the op beside it is (graph-replayed or eager)."""
    if graph and device.type == "cuda":
        return graph_seconds(copy, device, cfg, group)
    dist.barrier(group=group)
    return slowest(timer(device, copy, cfg.warmup, cfg.iters, group, loop), group)


def copy_ceiling(num_bytes: int, device: torch.device, cfg: argparse.Namespace, group, blocks: int,
                 loop: int = 1, graph: bool = False) -> float:
    """Seconds for one plain copy of num_bytes on this device, every rank copying at once; on the
    GPU with the same block budget as the communication kernels (`graph`: replayed from a CUDA
    graph of LL_LOOP copies, like the graph-timed ops)."""
    num_bytes = max(16, (num_bytes + 15) // 16 * 16)
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        def copy():
            copy_with_blocks(dst, src, blocks, torch.cuda.current_stream())
    else:
        def copy():
            dst.copy_(src)
    return _ceiling_seconds(copy, device, cfg, group, loop, graph)


def nccl_all_to_all(rank: int, world: int, group, per_rank_rows: List[int], recv_rows: List[int],
                    row_bytes: int, device: torch.device, cfg: argparse.Namespace, loop: int = 1) -> Optional[float]:
    """Seconds for torch.distributed.all_to_all_single of the same rows over NCCL (what a user
    would pick without this library), or None when NCCL cannot serve this group (ranks sharing a GPU,
    or a non-NCCL group)."""
    if device.type != "cuda" or "nccl" not in str(dist.get_backend(group)):
        return None
    send_counts = [r * row_bytes for r in per_rank_rows]
    recv_counts = [r * row_bytes for r in recv_rows]
    send = torch.randint(0, 255, (max(1, sum(send_counts)),), dtype=torch.uint8, device=device)[:sum(send_counts)]
    recv = torch.empty(sum(recv_counts), dtype=torch.uint8, device=device)

    def a2a():
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)

    dist.barrier(group=group)
    return slowest(timer(device, a2a, cfg.warmup, cfg.iters, group, loop), group)


def pattern_segments(matrix: List[List[int]], rank: int, forward: bool, row_bytes: int):
    """The pattern ceiling's copy plan for `rank`: (window bytes every rank allocates, offset of my
    segment in each destination's window, bytes of each segment). matrix[s][d] = rows rank s sends
    rank d in the dispatch direction; combine (forward=False) sends them back. Rows are rounded up to
    16 bytes (the copy moves int4s); sources land in rank order in each window, as an op's receive
    layout would, so the segments of all ranks tile each window without overlap."""
    world = len(matrix)
    row = (row_bytes + 15) // 16 * 16

    def sent(a: int, b: int) -> int:   # bytes rank a writes to rank b
        return (matrix[a][b] if forward else matrix[b][a]) * row

    window_bytes = max(16, max(sum(sent(a, r) for a in range(world)) for r in range(world)))
    offsets = [sum(sent(a, d) for a in range(rank)) for d in range(world)]
    return window_bytes, offsets, [sent(rank, d) for d in range(world)]


def _pattern_ceiling(buf, matrix: List[List[int]], forward: bool, row_bytes: int,
                     device: torch.device, cfg: argparse.Namespace, group, blocks: int, loop: int = 1,
                     graph: bool = False) -> float:
    """Seconds for the ideal copy of an op's traffic between ranks on different GPUs: in one launch
    with the op's block budget, every rank writes exactly the bytes the op sends each rank straight
    into that rank's memory (mapped over CUDA IPC, so over NVLink between GPUs); see pattern_segments."""
    rank, world = buf.rank, len(matrix)
    window_bytes, offsets, nbytes = pattern_segments(matrix, rank, forward, row_bytes)
    window = IpcWindow(buf.backend.ctx, window_bytes, 0, "ceiling window")
    try:
        # Rank r writes to r+1, r+2, ... first (its own segment last): in step with the other ranks'
        # orders, every destination takes one writer at a time instead of all ranks writing into rank
        # 0 together, then into rank 1, and so on.
        order = [(rank + 1 + i) % world for i in range(world)]
        dst = [window.bases[d] + offsets[d] for d in order]
        nbytes = [nbytes[d] for d in order]
        src = torch.randint(0, 255, (max(16, sum(nbytes)),), dtype=torch.uint8, device=device)
        copy = SegmentCopy(src, dst, nbytes)

        return _ceiling_seconds(lambda: copy(blocks, torch.cuda.current_stream()), device, cfg, group, loop, graph)
    finally:
        torch.cuda.synchronize()
        window.close()   # collective: no peer writes into it any more


def ceiling(buf, matrix: List[List[int]], forward: bool, row_bytes: int, num_bytes: int, blocks: int,
            device: torch.device, cfg: argparse.Namespace, group, loop: int = 1, graph: bool = False) -> float:
    """The op's ceiling: its traffic pattern copied over the links when the ranks span GPUs, else one
    plain copy of the same bytes on the device (ranks sharing one GPU: every byte lands in its HBM
    either way)."""
    if getattr(cfg, "peer_ceiling", False):
        return _pattern_ceiling(buf, matrix, forward, row_bytes, device, cfg, group, blocks, loop, graph)
    return copy_ceiling(num_bytes, device, cfg, group, blocks, loop, graph)
