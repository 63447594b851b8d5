"""Buffer layouts: the one place that decides where bytes live in the communication buffers.

Both the Python validation (is the buffer big enough?) and the kernels (which receive these
offsets as launch parameters) use these objects, so the arithmetic exists once.

Normal mode (intranode): every rank owns a receive area with one fixed slot per
(source rank, source token). A slot holds the token's payload and its metadata:

    [ payload (hidden bytes, 16-aligned) | scales (fp32, 16-aligned) | topk idx (int32) + weights (fp32) | src idx (16 B) ]

Low-latency mode: two identical halves (double buffering, so consecutive calls need no cleaning);
each half has a dispatch receive area with one slot per (local expert, source rank, token), a
combine send area shaped `[local_experts, ranks * max_tokens, hidden]` (the zero-copy buffer) and a
combine receive area with one slot per (global expert, token), plus a signal area. The dispatch
receive area and the combine send area share bytes: the receive phase copies tokens out into the
caller's `recv_x` before the caller can fill the combine buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 16
CONTROL_BYTES = 1 << 16          # signals / counters at the head of the normal buffer
MAX_TOPK = 128                   # the API bound (DeepEP's kNumMaxTopK)
HINT_TOPK = 32                   # top-k the default size hints reserve room for


def align_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def normal_slot_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """Bytes of one (source rank, token) receive slot in normal mode."""
    return (align_up(hidden_bytes) + align_up(num_scales * 4)
            + align_up(num_topk * 8) + ALIGN)


def normal_buffer_bytes(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                        num_scales: int = -1, num_topk: int = HINT_TOPK) -> int:
    """NVLink buffer bytes for dispatching up to `num_max_tokens_per_rank` tokens from each rank.

    With `num_scales=-1` room is reserved for FP8 scales of a hidden of `hidden_bytes` elements,
    so one hint covers a BF16 call and an FP8 call of the same hidden.
    """
    if num_scales < 0:
        num_scales = hidden_bytes // 128
    slot = normal_slot_bytes(hidden_bytes, num_scales, num_topk)
    return CONTROL_BYTES + num_ranks * num_max_tokens_per_rank * slot


@dataclass(frozen=True)
class NormalLayout:
    """Receive-slot geometry of one normal-mode call."""

    num_ranks: int
    hidden_bytes: int
    num_scales: int
    num_topk: int

    @property
    def slot_bytes(self) -> int:
        return normal_slot_bytes(self.hidden_bytes, self.num_scales, self.num_topk)

    def max_tokens_per_rank(self, buffer_bytes: int) -> int:
        """How many tokens per rank a buffer of `buffer_bytes` can take in one call."""
        usable = buffer_bytes - CONTROL_BYTES
        if usable <= 0:
            return 0
        return usable // (self.num_ranks * self.slot_bytes)


def low_latency_message_bytes(hidden: int) -> int:
    """Bytes of one dispatched token message (BF16 is the larger of BF16 / FP8+scales)."""
    bf16 = hidden * 2
    fp8 = hidden + (hidden // 128) * 4
    return ALIGN + align_up(max(bf16, fp8))


@dataclass(frozen=True)
class LowLatencyLayout:
    """Geometry of one half of the low-latency buffer."""

    num_max_tokens: int
    hidden: int
    num_ranks: int
    num_experts: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def dispatch_recv_bytes(self) -> int:
        return self.num_experts * self.num_max_tokens * low_latency_message_bytes(self.hidden)

    @property
    def combine_send_bytes(self) -> int:
        return self.num_experts * self.num_max_tokens * self.hidden * 2

    @property
    def combine_recv_bytes(self) -> int:
        return self.num_experts * self.num_max_tokens * self.hidden * 2

    @property
    def signal_bytes(self) -> int:
        return align_up(self.num_experts * 8 * 2, 128)

    @property
    def half_bytes(self) -> int:
        return align_up(max(self.dispatch_recv_bytes, self.combine_send_bytes)
                        + self.combine_recv_bytes + self.signal_bytes, 128)

    @property
    def total_bytes(self) -> int:
        return 2 * self.half_bytes


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                               num_ranks: int, num_experts: int) -> int:
    return LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes
