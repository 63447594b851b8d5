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
    num_recv: torch.Tensor              # [1] int32: rows received (the combine's row count)


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
    transport_state: Optional[IntranodeState] = None   # the kernels' extras (None: reference transport)


class LowLatencyHandle(NamedTuple):
    """Same five fields, in the same order, as DeepEP's low-latency handle."""

    src_info: torch.Tensor              # [local_experts, R * max_tokens] int32: source token index per slot
    layout_range: torch.Tensor          # [local_experts, R] int64: (begin << 32) | count per source rank
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
