"""Where bytes live in the internode normal mode's window (docs/INTERNODE.md; kernels in
csrc/common/kernels/internode/, which receive these offsets as launch parameters).

One window per rank (the transport's: `num_rdma_bytes`, symmetric), in two parts:

    [ fixed regions (InternodeRegions: control, signals, count messages) | data region ]

The fixed regions depend only on the ranks and nodes, so their signals keep their places for the
Buffer's life (signals only grow). The data region is laid out per op: a dispatch's
(InternodeDispatchLayout) or a combine's (InternodeCombineLayout). They overlay each other: every op
starts with a handshake after which no rank still reads anything of the previous op.

    dispatch: [ landing slots [M][N] | staged bodies [N] | staged metas [N][M] ]
              slot = body (payload | scales | top-k ids int32 | top-k weights) | meta (int32 [P] | source token)
    combine:  [ landing rows [M][N] | partial rows [M][N] | staged input rows [rest of the window] ]
              (N leaves the staged rows at least the room of the other two; each op checks its own rows)
              row = bf16 [hidden] | float32 top-k weights

N (tokens per rank and call) is what the window holds for the op's shape, at most
INTERNODE_MAX_CHUNKS * INTERNODE_CHUNK_TOKENS.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layout import HINT_TOPK, align_up, combine_slot_bytes, dispatch_slot_bytes

INTERNODE_CHUNK_TOKENS = 64        # kChunkTokens (internode/protocol.cuh)
INTERNODE_MAX_CHUNKS = 512         # kMaxChunks
INTERNODE_MAX_TOKENS = INTERNODE_CHUNK_TOKENS * INTERNODE_MAX_CHUNKS
INTERNODE_MAX_LOCAL_EXPERTS = 256  # experts per rank a count message has room for
INTERNODE_CONTROL_BYTES = 256      # [round u64 | current u64 | error claim u32 | ...]
CTRL_ROUND, CTRL_CURRENT, CTRL_ERROR = 0, 8, 16
PAGE = 4096


@dataclass(frozen=True)
class InternodeRegions:
    """The fixed regions of the window (Common in internode/protocol.cuh)."""

    num_ranks: int
    ranks_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def hs_offset(self) -> int:
        return INTERNODE_CONTROL_BYTES

    @property
    def _chunk_array(self) -> int:
        return 8 * self.num_nodes * INTERNODE_MAX_CHUNKS

    @property
    def arrive_offset(self) -> int:
        return align_up(self.hs_offset + 8 * self.num_ranks, 128)

    @property
    def forward_offset(self) -> int:
        return self.arrive_offset + self._chunk_array

    @property
    def range_offset(self) -> int:
        return self.forward_offset + self._chunk_array

    @property
    def combine_arrive_offset(self) -> int:
        return self.range_offset + self._chunk_array

    @property
    def staged_offset(self) -> int:
        return self.combine_arrive_offset + self._chunk_array

    @property
    def count_words(self) -> int:
        """int32 words of a count message: per rank, per node, token count, the sender's receive capacity, its
        tokens in the whole call, per expert of the receiver."""
        return align_up(self.num_ranks + self.num_nodes + 3 + INTERNODE_MAX_LOCAL_EXPERTS, 4)

    @property
    def counts_offset(self) -> int:
        return align_up(self.staged_offset + 8, 128)

    @property
    def count_out_offset(self) -> int:
        return self.counts_offset + 4 * 2 * self.num_ranks * self.count_words

    @property
    def data_offset(self) -> int:
        return align_up(self.count_out_offset + 4 * self.num_ranks * self.count_words, PAGE)


def _tokens_that_fit(regions: InternodeRegions, window_bytes: int, bytes_per_token: int, pages: int) -> int:
    room = window_bytes - regions.data_offset - pages * PAGE   # page alignment of each area
    return max(0, min(INTERNODE_MAX_TOKENS, room // bytes_per_token))


@dataclass(frozen=True)
class InternodeDispatchLayout:
    regions: InternodeRegions
    hidden_bytes: int      # payload bytes of a row (hidden for FP8, 2 * hidden for BF16)
    num_scales: int
    num_topk: int

    @property
    def body_bytes(self) -> int:   # kBodyBytes
        return dispatch_slot_bytes(self.hidden_bytes, self.num_scales, self.num_topk)

    @property
    def meta_bytes(self) -> int:   # kMetaBytes: int32 positions [P] and the source token
        return align_up(4 * (self.regions.ranks_per_node + 1))

    @property
    def slot_bytes(self) -> int:   # kSlotBytes
        return self.body_bytes + self.meta_bytes

    def max_tokens(self, window_bytes: int) -> int:
        m = self.regions.num_nodes
        per_token = m * self.slot_bytes + self.body_bytes + m * self.meta_bytes
        return _tokens_that_fit(self.regions, window_bytes, per_token, 3)

    def landing_offset(self, n: int) -> int:
        return self.regions.data_offset

    def staging_offset(self, n: int) -> int:
        return self.landing_offset(n) + align_up(self.regions.num_nodes * n * self.slot_bytes, PAGE)

    def meta_staging_offset(self, n: int) -> int:
        return self.staging_offset(n) + align_up(n * self.body_bytes, PAGE)

    def end(self, n: int) -> int:
        return self.meta_staging_offset(n) + align_up(n * self.regions.num_nodes * self.meta_bytes, PAGE)


@dataclass(frozen=True)
class InternodeCombineLayout:
    regions: InternodeRegions
    hidden: int            # bf16 elements
    num_topk: int

    @property
    def row_bytes(self) -> int:   # kRowBytes
        return combine_slot_bytes(self.hidden, self.num_topk)

    def max_tokens(self, window_bytes: int) -> int:
        """N: the landing and partial rows of N tokens per node, leaving the staged rows (this rank's combine
        input, max_rows) room for S * N rows, S = min(R, 2M): at least as much as landing and partial rows
        take together. A rank receives at most R * N rows but on a balanced gate far fewer, so the staged
        rows are checked per op against the rows the handle holds, not reserved for the worst case. Only the
        combine of a num_worst_tokens dispatch (no round size) uses it; a fresh dispatch's combine takes its
        round size (tokens_for_any_gate), and the size hint reserves R * N (internode_rdma_bytes)."""
        r = self.regions
        staged = min(r.num_ranks, 2 * r.num_nodes)
        return _tokens_that_fit(r, window_bytes, (2 * r.num_nodes + staged) * self.row_bytes, 2)

    def tokens_for_any_gate(self, window_bytes: int) -> int:
        """N whose landing and partial rows leave room for R * N staged rows: a combine of N tokens per rank fits
        whatever the gate sent where (a call in rounds uses it as its round size and its combines' N)."""
        r = self.regions
        return _tokens_that_fit(r, window_bytes, (2 * r.num_nodes + r.num_ranks) * self.row_bytes, 2)

    def landing_offset(self, n: int) -> int:
        return self.regions.data_offset

    def partial_offset(self, n: int) -> int:
        return self.landing_offset(n) + align_up(self.regions.num_nodes * n * self.row_bytes, PAGE)

    def staging_offset(self, n: int) -> int:
        return self.partial_offset(n) + align_up(self.regions.num_nodes * n * self.row_bytes, PAGE)

    def max_rows(self, n: int, window_bytes: int) -> int:
        return (window_bytes - self.staging_offset(n)) // self.row_bytes

    def end(self, n: int) -> int:
        return self.staging_offset(n) + self.regions.num_ranks * n * self.row_bytes


def internode_rdma_bytes(hidden_bytes: int, num_ranks: int, num_max_tokens_per_rank: int, ranks_per_node: int,
                         num_topk: int = HINT_TOPK) -> int:
    """num_rdma_bytes for internode calls of up to `num_max_tokens_per_rank` tokens: BF16 and FP8 (with
    scales) dispatches of that hidden with top-k up to `num_topk`, and their combines; 0 when every rank
    is on one node."""
    if ranks_per_node >= num_ranks:
        return 0
    regions = InternodeRegions(num_ranks, ranks_per_node)
    hidden = max(8, align_up(max(1, hidden_bytes // 2), 8))
    n = min(num_max_tokens_per_rank, INTERNODE_MAX_TOKENS)
    ends = [InternodeDispatchLayout(regions, hidden * 2, 0, num_topk).end(n),
            InternodeDispatchLayout(regions, hidden, hidden // 128, num_topk).end(n),
            InternodeCombineLayout(regions, hidden, num_topk).end(n)]
    return align_up(max(ends), PAGE) + 3 * PAGE   # the page slack max_tokens() leaves
