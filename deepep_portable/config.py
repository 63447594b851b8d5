"""Performance configuration, DeepEP-compatible (`deep_ep.Config`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


DEFAULT_NUM_SMS = 20   # SM budget of the communication kernels until Buffer.set_num_sms (DeepEP's default)


@dataclass
class Config:
    """Tuning knobs for the high-throughput (normal-mode) kernels.

    The positional order matches DeepEP's `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`.
    Our intranode kernels write every token straight into a fixed receive slot (one per source rank
    and source token), so the chunk sizes only bound how many tokens a block moves between two
    progress signals; they do not size the buffer.
    """

    num_sms: int = DEFAULT_NUM_SMS
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_sms <= 0:
            raise ValueError(f"Config.num_sms must be positive, got {self.num_sms}")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config needs 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens")
        if not 0 < self.num_max_rdma_chunked_send_tokens < self.num_max_rdma_chunked_recv_tokens:
            raise ValueError("Config needs 0 < num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int,
                                 num_max_tokens_per_rank: int = 4096) -> int:
        """Bytes of NVLink buffer needed to dispatch up to `num_max_tokens_per_rank` tokens per rank.

        DeepEP sizes this buffer by chunk counts; ours holds one receive slot per (source rank, token),
        so the size depends on the token count (third argument, ours; DeepEP callers get 4096).
        """
        from .layout import normal_buffer_bytes

        return normal_buffer_bytes(num_max_tokens_per_rank, int(hidden_bytes), num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_max_tokens_per_rank: int = 4096,
                                  ranks_per_node: Optional[int] = None) -> int:
        """Bytes of network buffer for normal mode over several nodes (docs/INTERNODE.md: one landing slot
        per (source node, token)) that run every call of up to `num_max_tokens_per_rank` tokens as one op; a
        smaller buffer runs larger calls in rounds. 0 when every rank is on one node. `ranks_per_node` (ours):
        default DEEPEP_PORTABLE_RANKS_PER_NODE, else DeepEP's assumption of 8 (min with num_ranks)."""
        from .internode_layout import internode_rdma_bytes
        from .topology import RANKS_PER_NODE_ENV

        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get(RANKS_PER_NODE_ENV) or min(8, num_ranks))
        return internode_rdma_bytes(int(hidden_bytes), num_ranks, num_max_tokens_per_rank, ranks_per_node)
