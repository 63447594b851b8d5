"""Host side of the internode normal mode: ranks on several nodes (docs/INTERNODE.md; device protocol in
csrc/common/kernels/internode/protocol.cuh, byte layout in internode_layout.py).

`InternodeEngine` owns one window per rank made by the transport (`num_rdma_bytes`; the same kind of
window the low-latency engine stands on), the table of its node's window bases (the only load/store
addresses the kernels get), and the launch sequence of each op. The transport's struct is filled with a
peer table that has no rank of another node (Window.node_transport_params), so every byte between nodes
goes through the transport's put / signal, also between logical nodes of one machine.

Dispatch: notify_counts, send_tokens, forward_arrivals are launched at once; the host waits for the
receive count (published by notify_counts through mapped memory) unless the caller knows it
(num_worst_tokens, cached dispatch: then the op is capturable), allocates the outputs and launches the
pull (`dispatch`). Combine: notify_staged_rows, reduce_node_rows, combine. Everything runs on the
Buffer's comm stream; outputs are allocated on the current stream (Buffer._op orders the two).
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, List, Optional, Tuple

import torch

from .. import internode_layout as IL
from .. import jit
from ..contract import BufferContext, CachedDispatchArgs, CombineArgs, DispatchArgs, DispatchResult
from ..failures import after_launch
from ..handles import DispatchHandle, InternodeRounds, InternodeState
from ..windows.base import MappedWords, Window
from . import internode_rounds as rounds
from .base import Engine
from .launch import launch, params_struct, ptr, stream_handle

DISPATCH_SOURCE = "common/kernels/internode/dispatch.cu"
COMBINE_SOURCE = "common/kernels/internode/combine.cu"
CEILING_SOURCE = "common/kernels/internode/ceiling.cu"   # the bench's ceiling (tools/internode_ceiling.py)
CEILING_KERNEL = jit.kernel_symbol("deepep_portable::internode::traffic_ceiling", "TrafficCeilingParams")
THREADS = 512   # kThreads in internode/protocol.cuh
# Launch order of each op; only the kernel named after the op moves its data to the caller, and only the first
# (the handshake) says 'notify': DeepEP's test_internode times an op by finding each of those words in exactly
# one kernel name of a profile, as its own notify kernels are named.
DISPATCH_KERNELS = tuple(jit.kernel_symbol(f"deepep_portable::internode::{k}", "InternodeDispatchParams")
                         for k in ("notify_counts", "send_tokens", "forward_arrivals", "dispatch"))
COMBINE_KERNELS = tuple(jit.kernel_symbol(f"deepep_portable::internode::{k}", "InternodeCombineParams")
                        for k in ("notify_staged_rows", "reduce_node_rows", "combine"))

_COMMON = ["node_bases", "local_base", "rank", "ctrl_round", "ctrl_current", "hs_offset", "arrive_offset",
           "forward_offset", "range_offset", "combine_arrive_offset", "staged_offset", "counts_offset",
           "count_out_offset", "count_words", "data_offset", "max_tokens", "num_channels", "error_claim",
           "error_host", "timeout_ns"]
_DISPATCH = ["landing_offset", "staging_offset", "meta_staging_offset", "num_experts", "expert_alignment", "x",
             "x_scales", "scale_token_stride", "scale_hidden_stride", "topk_idx", "topk_weights", "is_token_in_rank",
             "num_tokens_per_expert", "num_tokens", "call_tokens", "send_pos", "node_pos", "chunk_end", "rank_prefix_matrix",
             "num_recv_out", "landed_meta", "landed_range", "landed_chunks", "send_rows", "host_out", "recv_x",
             "recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "max_recv_rows"]
_COMBINE = ["landing_offset", "partial_offset", "staging_offset", "max_rows", "x", "topk_weights", "num_recv",
            "rank_prefix_matrix", "landed_meta", "landed_range", "landed_chunks", "meta_tokens", "is_token_in_rank",
            "num_tokens", "bias_0", "bias_1", "out", "out_topk_weights"]


@functools.lru_cache(maxsize=None)
def params_types(transport_struct: type) -> Tuple[type, type, type, type]:
    """(Common, InternodeDispatchParams, InternodeCombineParams, TrafficCeilingParams) mirrors for kernels built
    for the backend whose Transport struct `transport_struct` mirrors."""
    common = params_struct("Common", [("transport", transport_struct), *_COMMON])
    return (common, params_struct("InternodeDispatchParams", [("common", common), *_DISPATCH]),
            params_struct("InternodeCombineParams", [("common", common), *_COMBINE]),
            params_struct("TrafficCeilingParams", [("common", common), "pieces", "num_pieces"]))


def kernel_defines(num_ranks: int, ranks_per_node: int, **shape) -> dict:
    return {"NUM_RANKS": num_ranks, "RANKS_PER_NODE": ranks_per_node, **shape}


class InternodeEngine(Engine):
    def __init__(self, ctx: BufferContext, make_window: Callable[[BufferContext, int], Window],
                 channels: int = 1) -> None:
        """make_window(ctx, nbytes): the transport's window (collective), all zero. `channels`: how many the
        transport has (Capabilities.max_channels): a (node, chunk) pair's traffic takes channel
        (node * max chunks + chunk) mod channels."""
        P, R = ctx.ranks_per_node, ctx.num_ranks
        self.ctx, self.rank, self.num_ranks, self.ranks_per_node = ctx, ctx.rank, R, P
        self.regions = IL.InternodeRegions(R, P)
        if ctx.num_rdma_bytes <= self.regions.data_offset:
            raise ValueError(f"normal mode over {R // P} nodes needs num_rdma_bytes > {self.regions.data_offset} "
                             f"(Config.get_rdma_buffer_size_hint), got {ctx.num_rdma_bytes}")
        self.base: Optional[int] = None
        self.window = make_window(ctx, ctx.num_rdma_bytes)
        try:
            node = self.rank // P
            node_ranks = list(range(node * P, node * P + P))
            missing = [r for r in node_ranks if self.window.node_base(r) == 0]
            if missing:
                raise RuntimeError(f"ranks {missing} of node {node} (ranks_per_node={P}) are not reachable by "
                                   f"load/store from rank {self.rank}: a node must be one NVLink domain")
            # Raises for a window whose transport has no path but load/store (it could not keep nodes apart).
            self.transport = self.window.node_transport_params(node_ranks)
            self.node_bases = torch.tensor([self.window.node_base(r) for r in node_ranks], dtype=torch.int64,
                                           device=ctx.device)
        except BaseException:
            self.window.close()
            raise
        self.base, self.dev, self.errors = self.window.base, self.window.dev, self.window.errors
        self.common_t, self.dispatch_t, self.combine_t, self.ceiling_t = params_types(type(self.transport))
        self.notify = MappedWords(self.dev, 3 + IL.INTERNODE_MAX_LOCAL_EXPERTS)
        self.channels = max(1, int(channels))
        self.most_call_tokens = 0   # the last learned count's: the most tokens any rank has in the call

    # ---- shared ----------------------------------------------------------------------------------
    def _common(self, max_tokens: int):
        g = self.regions
        c = self.common_t()
        c.transport = self.transport
        c.node_bases, c.local_base, c.rank = self.node_bases.data_ptr(), self.base, self.rank
        c.ctrl_round, c.ctrl_current = IL.CTRL_ROUND, IL.CTRL_CURRENT
        for name in ("hs_offset", "arrive_offset", "forward_offset", "range_offset", "combine_arrive_offset",
                     "staged_offset", "counts_offset", "count_out_offset", "count_words", "data_offset"):
            setattr(c, name, getattr(g, name))
        c.max_tokens, c.num_channels = max_tokens, self.channels
        c.error_claim, c.error_host = self.base + IL.CTRL_ERROR, self.errors.dev
        c.timeout_ns = int(self.ctx.timeout_s * 1e9)
        return c

    def _kernels(self, source: str, names, defines: dict) -> tuple:
        return tuple(self.window.kernel(source, name, defines) for name in names)

    def grid(self, num_sms: int) -> int:
        return self.window.grid(num_sms)

    def _need(self, what: str, tokens: int, room: int, hint: str) -> None:
        if tokens > room:
            raise ValueError(f"{what} of {tokens} tokens per rank needs a larger buffer: num_rdma_bytes="
                             f"{self.ctx.num_rdma_bytes} holds {room} for this shape over "
                             f"{self.regions.num_nodes} nodes; {hint}")

    # ---- dispatch ---------------------------------------------------------------------------------
    def tokens_per_round(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk: int) -> int:
        """The most tokens per rank a round of a call of this shape moves: its dispatch fits the window, and so does
        the combine of its rows (BF16 rows of the same hidden, weights of the same top-k) whatever the gate did.
        A window of the size hint's holds the call in one round."""
        hidden = x.size(1)
        num_scales = 0 if x_scales is None else x_scales.size(1)
        window = self.ctx.num_rdma_bytes
        dispatch = IL.InternodeDispatchLayout(self.regions, hidden * x.element_size(), num_scales, topk)
        return min(dispatch.max_tokens(window),
                   IL.InternodeCombineLayout(self.regions, hidden, topk).tokens_for_any_gate(window))

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        if args.num_worst_tokens > 0:   # the host learns no count, so no round count either: one op
            return self.dispatch_op(args.x, args.x_scales, args.num_sms, fresh=args)
        topk = 0 if args.topk_idx is None else args.topk_idx.size(1)
        n = self.tokens_per_round(args.x, args.x_scales, topk)
        if n < 1:   # the same on every rank: it depends on the shape alone
            raise ValueError(f"dispatch needs a larger buffer: num_rdma_bytes={self.ctx.num_rdma_bytes} holds no token "
                             f"of this shape over {self.regions.num_nodes} nodes once the combine's worst case "
                             f"({self.num_ranks} rows per token) is reserved; Config.get_rdma_buffer_size_hint("
                             f"hidden_bytes, num_ranks, tokens) says how much")
        return rounds.dispatch(self, args, n)

    def cached_dispatch(self, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        state = args.handle.transport_state
        if isinstance(state, InternodeRounds):
            return rounds.cached_dispatch(self, args)
        if not isinstance(state, InternodeState):
            raise ValueError("handle was not produced by this Buffer's internode dispatch")
        res = self.dispatch_op(args.x, args.x_scales, args.num_sms, handle=args.handle)
        return res.recv_x, res.recv_x_scales

    def dispatch_op(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], num_sms: int,
                  fresh: Optional[DispatchArgs] = None, handle: Optional[DispatchHandle] = None,
                  call_tokens: Optional[int] = None, tokens_per_round: int = 0) -> DispatchResult:
        """One op: `x` (a round's tokens when the call runs in rounds: `call_tokens` are the call's, `tokens_per_round`
        the round size its handle keeps for the combine). With a count to learn, self.most_call_tokens is then the
        most tokens any rank has in the call."""
        self.check()
        R, P, M = self.num_ranks, self.ranks_per_node, self.regions.num_nodes
        T, hidden = x.shape
        cached = handle is not None
        topk = 0 if cached or fresh.topk_idx is None else fresh.topk_idx.size(1)
        num_scales = 0 if x_scales is None else x_scales.size(1)
        num_experts = R if cached else fresh.num_experts
        if num_experts // R > IL.INTERNODE_MAX_LOCAL_EXPERTS:
            raise ValueError(f"internode dispatch supports up to {IL.INTERNODE_MAX_LOCAL_EXPERTS} experts per rank, "
                             f"got {num_experts // R}")
        lay = IL.InternodeDispatchLayout(self.regions, hidden * x.element_size(), num_scales, topk)
        N = lay.max_tokens(self.ctx.num_rdma_bytes)
        self._need("dispatch", T, N, "Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, tokens) says how much")
        kernels = self._kernels(DISPATCH_SOURCE, DISPATCH_KERNELS, kernel_defines(
            R, P, HIDDEN_BYTES=lay.hidden_bytes, NUM_SCALES=num_scales, NUM_TOPK=topk))

        in_rank = handle.is_token_in_rank if cached else fresh.is_token_in_rank
        dev, comm = self.ctx.device, self.ctx.comm_stream
        chunks = -(-T // IL.INTERNODE_CHUNK_TOKENS)
        with torch.cuda.stream(comm):   # only comm-stream kernels write these
            i32 = torch.empty(2 * T * R + T * M + chunks * M + R * R + 1 + M + M * N * (P + 1), dtype=torch.int32,
                              device=dev)
            landed_range = torch.empty(M, IL.INTERNODE_MAX_CHUNKS, dtype=torch.int64, device=dev)
        views, at = [], 0
        for n in (T * R, T * R, T * M, chunks * M, R * R, 1, M, M * N * (P + 1)):
            views.append(i32[at:at + n])
            at += n
        send_pos, send_rows, node_pos, chunk_end, rank_prefix, num_recv_dev, landed_chunks, landed_meta = views

        p = self.dispatch_t()
        p.common = self._common(N)
        p.landing_offset, p.staging_offset, p.meta_staging_offset = (
            lay.landing_offset(N), lay.staging_offset(N), lay.meta_staging_offset(N))
        p.num_experts, p.expert_alignment = num_experts, 1 if cached else fresh.expert_alignment
        p.x, p.x_scales = x.data_ptr(), ptr(x_scales)
        if x_scales is not None:   # any strides (column-major scales are read in place)
            p.scale_token_stride, p.scale_hidden_stride = x_scales.stride()
        p.topk_idx = 0 if cached else ptr(fresh.topk_idx)
        p.topk_weights = 0 if cached else ptr(fresh.topk_weights)
        p.is_token_in_rank = in_rank.data_ptr()
        p.num_tokens_per_expert = 0 if cached else fresh.num_tokens_per_expert.data_ptr()
        p.num_tokens, p.call_tokens = T, T if call_tokens is None else call_tokens
        p.send_pos, p.node_pos, p.chunk_end = send_pos.data_ptr(), node_pos.data_ptr(), chunk_end.data_ptr()
        p.rank_prefix_matrix, p.num_recv_out = rank_prefix.data_ptr(), num_recv_dev.data_ptr()
        p.landed_meta, p.landed_range, p.landed_chunks = (landed_meta.data_ptr(), landed_range.data_ptr(),
                                                          landed_chunks.data_ptr())
        p.send_rows = send_rows.data_ptr()
        num_worst = 0 if cached else fresh.num_worst_tokens
        learn_count = not cached and num_worst == 0
        if learn_count:
            self.notify.words[0] = 0
            p.host_out = self.notify.dev
        # Rows fixed up front (num_worst_tokens, a cached handle): notify_counts checks them on every rank.
        p.max_recv_rows = handle.num_recv_rows if cached else num_worst
        s, grid = stream_handle(comm), self.grid(num_sms)
        for k in kernels[:3]:
            launch(k, grid, THREADS, p, s)

        counts: List[int] = []
        if cached:
            rows, num_recv = handle.num_recv_rows, handle.num_recv_tokens
        elif num_worst > 0:
            rows, num_recv = num_worst, -1
        else:
            num_recv = rows = self.wait_for_count("dispatch", self.notify)
            self.most_call_tokens = int(self.notify.words[2])
            counts = list(self.notify.words[3:3 + num_experts // R])
        try:
            recv_x, recv_scales, recv_idx, recv_w, recv_src = self._dispatch_outputs(
                rows, hidden, x.dtype, x_scales, num_scales, topk, not cached, dev)
        except BaseException:
            # The op is this rank's already: forward_arrivals ended it (protocol.cuh), and no peer waits for the pull
            # below, which only reads. So the failure (out of memory, most often) is this rank's alone: raised here
            # at once, the Buffer usable, the peers' dispatch complete.
            raise after_launch(sys.exc_info()[1])
        p.recv_x, p.recv_scales, p.recv_topk_idx, p.recv_topk_weights, p.recv_src_idx = (
            recv_x.data_ptr(), ptr(recv_scales), ptr(recv_idx), ptr(recv_w), ptr(recv_src))
        p.max_recv_rows, p.host_out = rows, 0
        launch(kernels[3], grid, THREADS, p, s)
        if cached:
            return DispatchResult(recv_x, recv_scales, None, None, [], handle)
        state = InternodeState(num_recv=num_recv_dev, landed_meta=landed_meta.view(M, N, P + 1),
                               landed_range=landed_range, landed_chunks=landed_chunks,
                               tokens_per_round=tokens_per_round)
        new_handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix.view(R, R), recv_src_idx=recv_src, is_token_in_rank=in_rank,
            send_rows=send_rows.view(T, R), num_recv_tokens=num_recv, num_recv_rows=rows, num_tokens=T, hidden=hidden,
            buffer_uid=self.ctx.uid, transport_state=state)
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, counts, new_handle)

    @staticmethod
    def _dispatch_outputs(rows: int, hidden: int, dtype: torch.dtype, x_scales: Optional[torch.Tensor],
                          num_scales: int, topk: int, with_source: bool, dev: torch.device):
        """(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx) of `rows` rows, on the current stream.
        Allocated once the receive count is known, after the op's first kernels are launched."""
        recv_x = torch.empty(rows, hidden, dtype=dtype, device=dev)
        recv_scales = None if x_scales is None else torch.empty(rows, num_scales, dtype=x_scales.dtype, device=dev)
        recv_idx = recv_w = None
        if topk:
            recv_idx = torch.empty(rows, topk, dtype=torch.int64, device=dev)
            recv_w = torch.empty(rows, topk, dtype=torch.float32, device=dev)
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev) if with_source else None   # a handle field
        return recv_x, recv_scales, recv_idx, recv_w, recv_src

    # ---- combine ----------------------------------------------------------------------------------
    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        state = args.handle.transport_state
        if isinstance(state, InternodeRounds):
            return rounds.combine(self, args)
        if not isinstance(state, InternodeState):
            raise ValueError("handle was not produced by this Buffer's internode dispatch")
        return self.combine_op(args, layout_tokens=state.tokens_per_round or None)

    def check_combine(self, handle: DispatchHandle, hidden: int, topk: int,
                      layout_tokens: Optional[int] = None) -> Tuple[int, int]:
        """(N, staged rows) of the window for a combine of this one-op handle (N: `layout_tokens`, a call's round
        size that every rank knows, else what the window holds); raises before any launch when the handle's tokens
        or rows do not fit."""
        lay = IL.InternodeCombineLayout(self.regions, hidden, topk)
        window = self.ctx.num_rdma_bytes
        if layout_tokens and layout_tokens > lay.tokens_for_any_gate(window):
            # rows wider than the dispatch's (its round size reserved the worst case for BF16 rows of its hidden and
            # top-k): refused on every rank alike, since it depends on the shapes alone
            raise ValueError(f"combine of rows of hidden {hidden} and top-k {topk} needs a larger buffer: "
                             f"num_rdma_bytes={window} holds {lay.tokens_for_any_gate(window)} tokens per rank of "
                             f"this shape for any gate, and the dispatch ran {layout_tokens} per round")
        N = layout_tokens or lay.max_tokens(window)
        self._need("combine", handle.num_tokens, N, "Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, tokens)")
        max_rows = lay.max_rows(N, self.ctx.num_rdma_bytes)
        if handle.num_recv_rows > max_rows:
            raise ValueError(f"combine of {handle.num_recv_rows} rows needs a larger buffer: num_rdma_bytes="
                             f"{self.ctx.num_rdma_bytes} stages at most {max_rows} rows of this shape")
        return N, max_rows

    def combine_op(self, args: CombineArgs, out: Optional[torch.Tensor] = None, out_w: Optional[torch.Tensor] = None,
                   layout_tokens: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One op, into `out` / `out_w` when given (a round's rows of the call's outputs, `layout_tokens` its
        round size)."""
        x, handle, topk_weights = args.x, args.handle, args.topk_weights
        state = handle.transport_state
        self.check()
        R, P = self.num_ranks, self.ranks_per_node
        hidden = x.size(1)
        topk = 0 if topk_weights is None else topk_weights.size(1)
        lay = IL.InternodeCombineLayout(self.regions, hidden, topk)
        N, max_rows = self.check_combine(handle, hidden, topk, layout_tokens)
        kernels = self._kernels(COMBINE_SOURCE, COMBINE_KERNELS, kernel_defines(R, P, HIDDEN=hidden, NUM_TOPK=topk))
        p = self.combine_t()
        p.common = self._common(N)
        p.landing_offset, p.partial_offset, p.staging_offset = (lay.landing_offset(N), lay.partial_offset(N),
                                                                lay.staging_offset(N))
        p.max_rows = max_rows
        p.x, p.topk_weights, p.num_recv = x.data_ptr(), ptr(topk_weights), state.num_recv.data_ptr()
        p.rank_prefix_matrix = handle.rank_prefix_matrix.data_ptr()
        p.landed_meta, p.landed_range, p.landed_chunks = (state.landed_meta.data_ptr(), state.landed_range.data_ptr(),
                                                          state.landed_chunks.data_ptr())
        p.meta_tokens = state.landed_meta.size(1)
        p.is_token_in_rank, p.num_tokens = handle.is_token_in_rank.data_ptr(), handle.num_tokens
        p.bias_0, p.bias_1 = ptr(args.bias_0), ptr(args.bias_1)
        if out is None:
            out = torch.empty(handle.num_tokens, hidden, dtype=torch.bfloat16, device=x.device)
            out_w = None if topk == 0 else torch.empty(handle.num_tokens, topk, dtype=torch.float32, device=x.device)
        p.out, p.out_topk_weights = out.data_ptr(), ptr(out_w)
        s, grid = stream_handle(self.ctx.comm_stream), self.grid(args.num_sms)
        for k in kernels:
            launch(k, grid, THREADS, p, s)
        return out, out_w

    # ---- the bench's ceiling -------------------------------------------------------------------------
    @property
    def traffic_region(self) -> Tuple[int, int]:
        """[start, end) byte offsets of the window's data region: scratch for traffic_copy between ops."""
        return self.regions.data_offset, self.ctx.num_rdma_bytes

    def traffic_copy(self, pieces: torch.Tensor, num_sms: int, stream=None) -> None:
        """Launch the ceiling kernel over `pieces` (int64 [n, 4], tools/internode_ceiling.traffic_pieces) on
        `stream` (default: the current one). It writes the data region of this and peer windows: call it only
        with no op in flight on any rank (it has no handshake)."""
        self.check()
        kernel = self.window.kernel(CEILING_SOURCE, CEILING_KERNEL, kernel_defines(self.num_ranks, self.ranks_per_node))
        p = self.ceiling_t()
        p.common = self._common(0)
        p.pieces, p.num_pieces = pieces.data_ptr(), pieces.size(0)
        launch(kernel, self.grid(num_sms), THREADS, p, stream_handle(stream))


# The shapes the GPU tests and `bench --mode internode` compile (precompiled with the nvshmem backend by
# `python -m deepep_portable precompile --nvshmem`, so the tests do not spend their time in nvcc): dispatch
# (payload bytes, scale words, top-k; top-k 0 is also the cached dispatch) and combine (hidden, top-k).
# (512, 0, 4), (256, 2, 4) and (256, 4): the elastic suite's logical nodes (tests/mpi/test_elastic_mpi.py: hidden 256, top-4).
PRECOMPILE_DISPATCH = [(7168 * 2, 0, 8), (7168, 56, 8), (7168 * 2, 0, 0), (7168, 56, 0), (512, 0, 3), (512, 0, 0),
                       (256, 2, 3), (256, 2, 0), (4096, 0, 4), (4096, 0, 0), (512, 0, 4), (256, 2, 4)]
PRECOMPILE_COMBINE = [(7168, 8), (7168, 0), (256, 3), (256, 0), (2048, 4), (256, 4)]
PRECOMPILE_NODES = [(8, 4), (8, 2), (16, 8), (16, 4), (16, 2)]   # (ranks, ranks per node) of the GPU suites


def round_variants(num_ranks: int, ranks_per_node: int, hidden: int, element_bytes: int, num_scales: int,
                   topk: int) -> List[Tuple[str, dict]]:
    """(source, defines) of the kernels one normal round of this shape builds: the dispatch, the cached dispatch
    (top-k 0) and the combine (its top-k: the weights' width, 0 without weights). For compiling ahead of use."""
    def dispatch(k: int) -> Tuple[str, dict]:
        return DISPATCH_SOURCE, kernel_defines(num_ranks, ranks_per_node, HIDDEN_BYTES=hidden * element_bytes,
                                               NUM_SCALES=num_scales, NUM_TOPK=k)
    return [dispatch(topk), dispatch(0),
            (COMBINE_SOURCE, kernel_defines(num_ranks, ranks_per_node, HIDDEN=hidden, NUM_TOPK=topk))]


def precompile_variants() -> List[Tuple[str, dict]]:
    """(source, defines) of every internode kernel the GPU suites use."""
    out = []
    for ranks, per_node in PRECOMPILE_NODES:
        out += [(DISPATCH_SOURCE, kernel_defines(ranks, per_node, HIDDEN_BYTES=h, NUM_SCALES=sc, NUM_TOPK=k))
                for h, sc, k in PRECOMPILE_DISPATCH]
        out += [(COMBINE_SOURCE, kernel_defines(ranks, per_node, HIDDEN=h, NUM_TOPK=k)) for h, k in PRECOMPILE_COMBINE]
        out.append((CEILING_SOURCE, kernel_defines(ranks, per_node)))
    return out
