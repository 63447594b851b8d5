"""Buffer layouts: the one place that decides where bytes live in the communication buffers.

Both the Python validation (is the buffer big enough?) and the kernels (which receive these
offsets as launch parameters) use these objects, so the arithmetic exists once.

Normal mode (intranode, pull-based): every rank owns one buffer its peers map (windows/ipc.py):

    [ control (signals, counts; CONTROL_BYTES) | send area ]

An op first copies what it sends into its *own* send area (once per token, whatever the fan-out),
then signals; receivers pull the rows they need from the peers' send areas straight into their
outputs. The dispatch's rows (one per source token) and the combine's rows (one per received row)
reuse the same bytes, because a rank only restages after every peer has finished pulling the previous
op. Each op's rows come first, contiguous and at the same offset whatever the call's top-k, so a
caller may write them in place (Buffer.get_next_dispatch_buffer / get_next_combine_buffer):

    dispatch: [ control | rows [cap, hidden] | meta [cap] | send lists [R][cap] int32 ]
              meta slot: [ scales (4 B each) | top-k ids (int32) | top-k weights (fp32) ]
    combine:  [ control | rows [R*cap, hidden] bf16 | weights [R*cap, top-k] fp32 ]

Low-latency mode: two identical halves (double buffering, so consecutive calls need no cleaning);
each half has a dispatch receive area with one slot per (local expert, source rank, token), a
combine send area shaped `[local_experts, ranks * max_tokens, hidden]` (the zero-copy buffer) and a
combine receive area with one slot per (global expert, token), plus a signal area. Peers write
only the receive areas and signals; the combine send area is written by its own rank alone (the
zero-copy expert outputs, or rows staged for a peer reached over a network), so no peer's later
call can land on it while a send still reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 16
CONTROL_BYTES = 1 << 16          # signals / counters at the head of the normal buffer
MAX_TOPK = 128                   # the API bound (DeepEP's kNumMaxTopK)
HINT_TOPK = 32                   # top-k the default size hints reserve room for
ROWS_OFFSET = CONTROL_BYTES      # each normal-mode op's rows, right after the control area (128-aligned)


def align_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def dispatch_slot_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    return align_up(hidden_bytes) + align_up(num_scales * 4) + 2 * align_up(num_topk * 4)


def combine_slot_bytes(hidden: int, num_topk: int) -> int:
    return align_up(hidden * 2) + align_up(num_topk * 4)


@dataclass(frozen=True)
class NormalLayout:
    """Where things live in a normal-mode buffer for one call shape (identical on every rank)."""

    num_ranks: int
    hidden: int
    elem_bytes: int          # 2 for BF16 dispatch, 1 for FP8
    num_scales: int
    num_topk: int

    @property
    def dispatch_slot(self) -> int:
        return dispatch_slot_bytes(self.hidden * self.elem_bytes, self.num_scales, self.num_topk)

    @property
    def combine_slot(self) -> int:
        return combine_slot_bytes(self.hidden, self.num_topk)

    # The dispatch's send area: payload rows, then a meta slot per token, then the send lists.
    @property
    def dispatch_row_bytes(self) -> int:
        return align_up(self.hidden * self.elem_bytes)

    @property
    def dispatch_meta_bytes(self) -> int:
        return align_up(self.num_scales * 4) + 2 * align_up(self.num_topk * 4)

    # byte offsets of a meta slot's parts (the kernels' scales_offset / topk_*_offset)
    @property
    def dispatch_scales_offset(self) -> int:
        return 0

    @property
    def dispatch_topk_idx_offset(self) -> int:
        return align_up(self.num_scales * 4)

    @property
    def dispatch_topk_weights_offset(self) -> int:
        return self.dispatch_topk_idx_offset + align_up(self.num_topk * 4)

    @staticmethod
    def dispatch_rows_offset() -> int:
        """The dispatch's payload rows [cap, hidden], contiguous, right after the control area: the same
        offset for every call shape, so Buffer.get_next_dispatch_buffer needs only the rows' shape."""
        return ROWS_OFFSET

    def dispatch_meta_offset(self, capacity: int) -> int:
        return self.dispatch_rows_offset() + capacity * self.dispatch_row_bytes

    def send_list_offset(self, capacity: int) -> int:
        return align_up(self.dispatch_meta_offset(capacity) + capacity * self.dispatch_meta_bytes, 128)

    def combine_rows(self, capacity: int) -> int:
        """Rows the combine's send area holds: every rank may send me `capacity` tokens."""
        return self.num_ranks * capacity

    @staticmethod
    def combine_rows_offset() -> int:
        """The combine's send area: [rows, hidden] bf16 expert outputs, contiguous (so a caller may write
        them there itself: Buffer.get_next_combine_buffer), right after the control area. It does not
        depend on the call's top-k (the caller asks for it before the combine), and it covers the
        dispatch's area: a round starts only once every peer has finished reading the last one."""
        return ROWS_OFFSET

    def combine_weights_area_offset(self, capacity: int) -> int:
        """Then their top-k weights, [rows, top-k] f32. Rows and weights fit where the rows' combine slots are
        counted (bytes_per_token, plus the 128 bytes of alignment buffer_bytes allows); hidden is a
        multiple of 8, so the weights start 16-byte aligned."""
        return self.combine_rows_offset() + self.combine_rows(capacity) * self.hidden * 2

    @property
    def bytes_per_token(self) -> int:
        """Buffer bytes one token per rank costs: its send-list entries and the larger of its
        dispatch slot or the combine slots of the rows it can cause on one receiver."""
        return self.num_ranks * 4 + max(self.dispatch_slot, self.num_ranks * self.combine_slot)

    def buffer_bytes(self, num_tokens_per_rank: int) -> int:
        """Buffer bytes for calls of up to `num_tokens_per_rank` tokens per rank (control area, send
        lists and send area, plus the 128 bytes the send area's alignment may take)."""
        return CONTROL_BYTES + 128 + num_tokens_per_rank * self.bytes_per_token

    def max_tokens_per_rank(self, buffer_bytes: int) -> int:
        """The inverse of buffer_bytes: the most tokens per rank a buffer of that size holds."""
        return max(0, (buffer_bytes - self.buffer_bytes(0)) // self.bytes_per_token)


def normal_buffer_bytes(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                        num_topk: int = HINT_TOPK) -> int:
    """Buffer bytes for normal-mode calls of up to `num_max_tokens_per_rank` tokens per rank.

    `hidden_bytes` is DeepEP's `hidden * max(element_size, 2)`: the hint covers a BF16 call and an
    FP8 call (with its scales) of that hidden, and their combines, with top-k up to `num_topk`.
    """
    hidden = max(1, hidden_bytes // 2)
    layout = NormalLayout(num_ranks, hidden, 2, hidden // 128, num_topk)
    return layout.buffer_bytes(num_max_tokens_per_rank)


# Control area of a normal-mode buffer (byte offsets; u64 signals are single-writer sequence numbers).
CTRL_ROUND = 0          # u64: last completed op of this rank (written by its last kernel)
CTRL_CURRENT = 8        # u64: op in progress (written by its first kernel)
CTRL_READY = 16         # u64: "my send area holds op n"  (written by me, read by peers)
CTRL_ERROR = 24         # u32: first error code of this buffer (device-side claim)
CTRL_NUM_TOKENS = 28    # i32: tokens staged by the current dispatch
CTRL_COUNTED = 32       # u64: "my count_to / expert_count hold op n's counts" (dispatch stage kernel)
CTRL_TOKEN_TICKET = 40  # u32: next token handed out (dispatch stage, combine pull; 0 between kernels)
CTRL_PULL_ARRIVE = 44   # u32: blocks of the running pull kernel past their reads (0 between kernels)
CTRL_DONE = 64          # u64[R]: DONE[p] = last op whose data peer p finished pulling from me (its pull's end)


def ctrl_count_to(num_ranks: int) -> int:
    """i32[R]: tokens I send to each rank in the current dispatch."""
    return align_up(CTRL_DONE + 8 * num_ranks, 16)


def ctrl_expert_count(num_ranks: int) -> int:
    """i32[E]: my num_tokens_per_expert for the current dispatch."""
    return align_up(ctrl_count_to(num_ranks) + 4 * num_ranks, 16)


def max_experts_in_control(num_ranks: int) -> int:
    return (CONTROL_BYTES - ctrl_expert_count(num_ranks)) // 4


def low_latency_message_bytes(hidden: int) -> int:
    """Bytes of one dispatched token message (BF16 is the larger of BF16 / FP8+scales)."""
    bf16 = hidden * 2
    fp8 = hidden + (hidden // 128) * 4
    return ALIGN + align_up(max(bf16, fp8))


LL_CONTROL_BYTES = 256           # head of the low-latency buffer: call counters, arrival words, error claim
LL_CTRL_SENT = 0                 # u64: calls whose send kernel finished (device-side call counter)
LL_CTRL_RECVD = 8                # u64: calls whose receive kernel finished
LL_CTRL_SEND_ARRIVE = 16         # u32: blocks of the running send kernel that finished
LL_CTRL_RECV_ARRIVE = 20         # u32: same for the receive kernel
LL_CTRL_ERROR = 24               # u32: first error code (device-side claim)
LL_CTRL_LAST = 32                # u64 [kind (dispatch, combine)][half]: last call of that kind that used that half
LL_CTRL_STAGE_ARRIVE = 64        # u32: blocks of the running kernel past a grid barrier (the combine's signal-last one)
LL_CTRL_STAGED = 72              # u64: the last ticket of that barrier every block passed
LL_MSG_HEADER = ALIGN            # head of a dispatch side message (int32 source token), before its scales
# After the control words: the dispatch's stage flags, u64 [LL_MAX_STAGE_BLOCKS] (flag b: the last call whose
# stage phase block b finished; at a fixed place, whatever the call's shape, and zeroed with the control words
# by clean_low_latency_buffer), so the LL grid is capped at LL_MAX_STAGE_BLOCKS blocks.
LL_STAGE_FLAGS_OFFSET = LL_CONTROL_BYTES
LL_MAX_STAGE_BLOCKS = 1024       # kMaxStageBlocks in protocol.cuh
LL_CLEANED_BYTES = LL_STAGE_FLAGS_OFFSET + 8 * LL_MAX_STAGE_BLOCKS   # [0, this): zeroed by clean_low_latency_buffer
# Then the barrier words, u64 [R] (slot q: how many device barriers rank q has entered, written by q; my own
# slot is my count). Never cleaned: clean_low_latency_buffer's barriers use them.
LL_BARRIER_OFFSET = LL_CLEANED_BYTES
LL_FP8_BLOCK = 128               # channels per scale (FP8) and per LogFMT amax/amin pair


@dataclass(frozen=True)
class LowLatencyLayout:
    """Geometry of the low-latency buffer for one call shape (identical on every rank):

        [ control | signals of half 0 | signals of half 1 | data of half 0 | data of half 1 | send stage ]

    signals of a half: dispatch u64 [E_local][R] (slot (e, s) written by source s), combine u64 [E]
    (slot g written by g's rank), dispatch ranges u64 [E_local][R] (the first recv_x row of s's block
    of e, written by s) and dispatch reservations u64 [E_local] (fetch_add by the sources, zeroed by
    this rank's receive). Data of a half: the dispatch output recv_x [E_local][R*T] rows (sized for
    bf16; FP8 rows are H bytes, packed from the start: the tensor the op returns is a view of it, which
    the peers write), the dispatch side messages [E_local][R][T] (source token + FP8 scales), the
    combine send area (the zero-copy buffer, bf16 [E_local][R*T][H], written only by this rank), then
    the combine receive slots bf16 [E][T][H]. The signal areas sit apart from the data so a signal slot
    is never overwritten by payload of the same shape. The send stage holds my tokens' dispatch
    messages (side message, then payload), each built once (FP8 cast included) before it is copied to
    every expert that selected it: [T] messages, rewritten by every dispatch.
    See csrc/common/kernels/low_latency/protocol.cuh for the protocol."""

    num_max_tokens: int
    hidden: int
    num_ranks: int
    num_experts: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def message_bytes(self) -> int:
        return low_latency_message_bytes(self.hidden)

    @property
    def side_bytes(self) -> int:
        """One dispatch side message: the int32 source token in a 16-byte head, then the float32 scales (FP8)."""
        return LL_MSG_HEADER + align_up(self.hidden // 128 * 4)

    @property
    def dispatch_recv_bytes(self) -> int:
        """recv_x of one half: [E_local][R*T] rows of up to 2H bytes (bf16)."""
        return self.num_experts * self.num_max_tokens * self.hidden * 2

    @property
    def dispatch_side_bytes(self) -> int:
        return self.num_experts * self.num_max_tokens * self.side_bytes

    @property
    def combine_send_bytes(self) -> int:
        """The zero-copy view [E_local][R*T][H] bf16 from its start; room for [E_local][R*T] LogFMT rows
        (logfmt_row_bytes apart: a row staged for a network put)."""
        return self.num_experts * self.num_max_tokens * self.logfmt_row_bytes

    @property
    def logfmt_row_bytes(self) -> int:
        """A combine receive row with use_logfmt: the amax/amin meta (bf16 pair per 128 channels), then
        at most the bf16 row (chunks that are not cast stay bf16)."""
        return align_up(self.hidden // LL_FP8_BLOCK * 4 + self.hidden * 2, 16)   # exact when hidden % 512 == 0

    @property
    def combine_recv_bytes(self) -> int:
        """[E][T] rows of 2H bytes (bf16), or of logfmt_row_bytes with use_logfmt (the larger)."""
        return self.num_experts * self.num_max_tokens * self.logfmt_row_bytes

    @property
    def signal_bytes(self) -> int:
        """Signals of one half: dispatch [E_local * R == E], combine [E], dispatch ranges [E] and
        dispatch reservations [E_local], u64 each."""
        return align_up(8 * (3 * self.num_experts + self.num_local_experts), 128)

    @property
    def data_half_bytes(self) -> int:
        return align_up(self.dispatch_recv_bytes, 128) + align_up(self.dispatch_side_bytes, 128) + \
            align_up(self.combine_send_bytes, 128) + align_up(self.combine_recv_bytes, 128)

    @property
    def half_bytes(self) -> int:
        return self.signal_bytes + self.data_half_bytes

    # byte offsets (half 0; add `signal_half_stride` / `data_half_stride` for half 1)
    @property
    def control_bytes(self) -> int:
        """Control words, the stage flags, then the barrier words u64 [R]."""
        return LL_BARRIER_OFFSET + align_up(8 * self.num_ranks, 128)

    def dispatch_signal_offset(self, half: int = 0) -> int:
        return self.control_bytes + half * self.signal_bytes

    def combine_signal_offset(self, half: int = 0) -> int:
        return self.dispatch_signal_offset(half) + self.num_experts * 8

    def dispatch_range_offset(self, half: int = 0) -> int:
        """protocol.cuh dispatch_range_off (the kernels derive it from the dispatch signals' offset)."""
        return self.dispatch_signal_offset(half) + 2 * self.num_experts * 8

    def dispatch_reserve_offset(self, half: int = 0) -> int:
        """protocol.cuh dispatch_reserve_off."""
        return self.dispatch_signal_offset(half) + 3 * self.num_experts * 8

    @property
    def signal_half_stride(self) -> int:
        return self.signal_bytes

    @property
    def data_offset(self) -> int:
        return align_up(self.control_bytes + 2 * self.signal_bytes, 4096)

    def dispatch_recv_offset(self, half: int = 0) -> int:
        return self.data_offset + half * self.data_half_bytes

    def dispatch_side_offset(self, half: int = 0) -> int:
        return self.dispatch_recv_offset(half) + align_up(self.dispatch_recv_bytes, 128)

    def combine_send_offset(self, half: int = 0) -> int:
        return self.dispatch_side_offset(half) + align_up(self.dispatch_side_bytes, 128)

    def combine_recv_offset(self, half: int = 0) -> int:
        return self.combine_send_offset(half) + align_up(self.combine_send_bytes, 128)

    @property
    def data_half_stride(self) -> int:
        return self.data_half_bytes

    @property
    def send_stage_offset(self) -> int:
        return self.data_offset + 2 * self.data_half_bytes

    @property
    def total_bytes(self) -> int:
        return self.send_stage_offset + align_up(self.num_max_tokens * self.message_bytes, 128)


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                               num_ranks: int, num_experts: int) -> int:
    return LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes


@dataclass(frozen=True)
class SelftestLayout:
    """The window of the transport conformance kernel (csrc/common/kernels/transport_selftest.cu):

        [ id word | counter | silent word | sigA [R] | sigB [R] | value [R] | A [R][B] | B [R][B] |
          C0 [R][B/2] | C1 [R][B/2] | stage [R][B] ]

    (B = bytes per put). Slot s of the signals, values and zones is written by rank s only."""

    num_ranks: int
    bytes: int                 # per put: a multiple of 32

    id_offset = 0
    counter_offset = 8
    silent_offset = 16

    @property
    def sig_a_offset(self) -> int:
        return 64

    @property
    def sig_b_offset(self) -> int:
        return self.sig_a_offset + 8 * self.num_ranks

    @property
    def value_offset(self) -> int:
        return self.sig_b_offset + 8 * self.num_ranks

    @property
    def zone_a_offset(self) -> int:
        return align_up(self.value_offset + 8 * self.num_ranks, 128)

    @property
    def zone_b_offset(self) -> int:
        return self.zone_a_offset + self.num_ranks * self.bytes

    @property
    def zone_c0_offset(self) -> int:
        return self.zone_b_offset + self.num_ranks * self.bytes

    @property
    def zone_c1_offset(self) -> int:
        return self.zone_c0_offset + self.num_ranks * self.bytes // 2

    @property
    def stage_offset(self) -> int:
        return self.zone_c1_offset + self.num_ranks * self.bytes // 2

    @property
    def total_bytes(self) -> int:
        return self.stage_offset + self.num_ranks * self.bytes
