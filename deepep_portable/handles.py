"""Named handle objects returned by dispatch and consumed by combine / cached dispatch.

Both are tuples (so code that passes DeepEP handles around keeps working) with named fields
(so our code never indexes them by position).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class IntranodeState(NamedTuple):
    """What the intranode engine keeps of a dispatch for its cached dispatch and combine (device
    tensors on the comm stream; only the GPU knows the receive count without a host sync)."""

    send_pos: torch.Tensor              # [num_tokens, R] int32: slot of each of my tokens in my send list to R
    num_tokens_per_rank: torch.Tensor   # [R] int32: the dispatch's layout
    # [1] int32: rows received, clamped to the outputs' rows (for inspection: the combine takes its row bounds
    # from the handle's rank_prefix_matrix)
    num_recv: torch.Tensor


class InternodeState(NamedTuple):
    """What the internode engine keeps of a dispatch for its combine and cached dispatch (device tensors on
    the comm stream): the meta of the tokens that landed on this rank (csrc/common/kernels/internode)."""

    num_recv: torch.Tensor              # [1] int32: rows received (the combine's row count)
    landed_meta: torch.Tensor           # [M, N, P + 1] int32: per landed slot, positions at my node's ranks and token
    landed_range: torch.Tensor          # [M, max chunks] int64: (lo << 32) | hi slots of each landed chunk
    landed_chunks: torch.Tensor         # [M] int32: chunks of each source node's tokens that land here
    # the call's round size, the combine's tokens per rank (N) on every rank alike, so that the combine of any gate's
    # rows fits the window; 0 (num_worst_tokens: no round size): what the window holds
    tokens_per_round: int = 0


class InternodeRounds(NamedTuple):
    """An internode dispatch that ran in rounds because its window holds fewer tokens per rank than the call has
    (engines/internode_rounds.py): round k moved every rank's tokens [k * tokens_per_round, (k + 1) *
    tokens_per_round). The combine and a cached dispatch repeat the rounds with each round's own handle."""

    tokens_per_round: int
    rounds: tuple                       # one DispatchHandle per round (InternodeState), round-local rows and tokens
    rows: tuple                         # per round: int64 [round rows], where its rows are in the call's recv_x


class DispatchHandle(NamedTuple):
    """Layout of one normal-mode dispatch, enough to repeat it (cached dispatch) or reverse it (combine).

    Received rows are ordered by source rank, then source token index.
    """

    rank_prefix_matrix: torch.Tensor    # [R, R] int32: [i, j] = tokens ranks 0..i send to rank j
    recv_src_idx: torch.Tensor          # [num_recv_rows] int32: source token index of each row (-1: padding)
    is_token_in_rank: torch.Tensor      # [num_tokens, R] bool: what this rank sent where
    send_rows: torch.Tensor             # [num_tokens, R] int32: row at the destination, -1 if not sent
    num_recv_tokens: int                # rows that hold real tokens (-1 when only the GPU knows)
    num_recv_rows: int                  # rows of recv_x (== num_recv_tokens, or num_worst_tokens)
    num_tokens: int
    hidden: int
    buffer_uid: int
    transport_state: Optional[NamedTuple] = None   # the engine's extras (Intranode/InternodeState/Rounds; None: reference)


class LowLatencyHandle(NamedTuple):
    """Same five fields, in the same order, as DeepEP's low-latency handle."""

    src_info: torch.Tensor              # [local_experts, R * max_tokens] int32: source token index per slot
    layout_range: torch.Tensor          # [local_experts, R] int64: (begin << 32) | count per source rank
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class InternodeHandle(tuple):
    """The handle of a dispatch over several nodes: DeepEP V1's ten entries, in its order (callers read
    `handle[-4]`, the prefix sum of received rows per global source rank, and `handle[0]`), built from
    the dispatch's DispatchHandle (`inner`, what cached dispatch and combine use). With one channel:
      0 is_token_in_rank [N, R] bool          1 rdma_channel_prefix_matrix [M, 1]: my tokens per node
      2 gbl_channel_prefix_matrix [R, 1]: my tokens per rank
      3 recv_rdma_channel_prefix_matrix [M, 1]: rows received from each node
      4 recv_rdma_rank_prefix_sum [M]: the same, cumulative
      5 recv_gbl_channel_prefix_matrix [R, 1]: rows received from each rank
      6 recv_gbl_rank_prefix_sum [R]: the same, cumulative (rows are ordered by global source rank)
      7 recv_src_meta [rows, 2]: (source rank, source token) of each received row, -1 on padding
      8 send_rdma_head [N, M]: index of my token among my tokens to node m, -1 if none go there
      9 send_nvl_head [N, R]: row of my token at rank r, -1 if not sent
    (int32 throughout except entry 0.)"""

    inner: DispatchHandle

    def __new__(cls, inner: DispatchHandle, ranks_per_node: int, rank: int) -> "InternodeHandle":
        in_rank = inner.is_token_in_rank
        num_tokens, num_ranks = in_rank.shape
        num_nodes = num_ranks // ranks_per_node
        in_node = in_rank.view(num_tokens, num_nodes, ranks_per_node).any(dim=2)
        recv_prefix = inner.rank_prefix_matrix[:, rank].to(torch.int32).contiguous()
        recv_per_rank = torch.diff(recv_prefix, prepend=recv_prefix.new_zeros(1))
        recv_per_node = recv_per_rank.view(num_nodes, ranks_per_node).sum(dim=1, dtype=torch.int32)
        rows = inner.recv_src_idx.numel()
        row_ids = torch.arange(rows, device=recv_prefix.device, dtype=torch.int32)
        src_rank = torch.searchsorted(recv_prefix, row_ids, right=True).to(torch.int32)
        real = inner.recv_src_idx >= 0
        meta = torch.stack([torch.where(real, src_rank, torch.full_like(src_rank, -1)), inner.recv_src_idx], dim=1)
        node_head = torch.where(in_node, in_node.to(torch.int32).cumsum(dim=0, dtype=torch.int32) - 1,
                                torch.full((num_tokens, num_nodes), -1, dtype=torch.int32, device=in_rank.device))
        self = super().__new__(cls, (
            in_rank, in_node.sum(dim=0, dtype=torch.int32).view(num_nodes, 1),
            in_rank.sum(dim=0, dtype=torch.int32).view(num_ranks, 1), recv_per_node.view(num_nodes, 1),
            recv_per_node.cumsum(0, dtype=torch.int32), recv_per_rank.view(num_ranks, 1), recv_prefix, meta,
            node_head, inner.send_rows))
        self.inner = inner
        self._args = (inner, ranks_per_node, rank)
        return self

    def __getnewargs__(self):   # copy / pickle rebuild it from what built it
        return self._args

    @property
    def recv_gbl_rank_prefix_sum(self) -> torch.Tensor:
        return self[6]
