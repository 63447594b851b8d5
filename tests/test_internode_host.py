"""Host side of the internode normal mode, without a GPU: the window layout (internode_layout.py), the size
hint, and the set-up refusals. The kernels' structs and constants are checked against this layout in
tests/test_mirrors.py (which also compiles them for sm_90); they run in tests/mpi/test_internode_gpu_mpi.py."""
from __future__ import annotations

import pytest

import deepep_portable as deep_ep
from deepep_portable import internode_layout as IL
from deepep_portable.engines import internode
from deepep_portable.windows.base import Window

SHAPES = [(16, 8), (8, 4), (8, 2), (6, 1), (144, 72), (2, 1)]


def _no_overlap(regions):
    for (a, off_a, n_a), (b, off_b, _) in zip(regions, regions[1:]):
        assert off_a + n_a <= off_b, f"{a} overlaps {b}"


@pytest.mark.parametrize("ranks,per_node", SHAPES)
def test_fixed_regions(ranks, per_node):
    g = IL.InternodeRegions(ranks, per_node)
    m, chunks = ranks // per_node, IL.INTERNODE_MAX_CHUNKS
    regions = [("control", 0, IL.INTERNODE_CONTROL_BYTES), ("handshake", g.hs_offset, 8 * ranks),
               ("arrivals", g.arrive_offset, 8 * m * chunks), ("forward flags", g.forward_offset, 8 * m * chunks),
               ("ranges", g.range_offset, 8 * m * chunks),
               ("combine arrivals", g.combine_arrive_offset, 8 * m * chunks),
               ("staged", g.staged_offset, 8), ("counts", g.counts_offset, 4 * 2 * ranks * g.count_words),
               ("count out", g.count_out_offset, 4 * ranks * g.count_words), ("data", g.data_offset, 1)]
    _no_overlap(regions)
    assert all(off % 8 == 0 for _, off, _ in regions) and g.counts_offset % 16 == 0 and g.data_offset % 4096 == 0
    assert max(IL.CTRL_ROUND, IL.CTRL_CURRENT, IL.CTRL_ERROR) + 8 <= IL.INTERNODE_CONTROL_BYTES
    # a count message: per rank, per node, the token count, the sender's capacity, the call's tokens, the
    # receiver's experts; whole 16-byte words
    assert g.count_words >= ranks + m + 3 + IL.INTERNODE_MAX_LOCAL_EXPERTS and (4 * g.count_words) % 16 == 0


@pytest.mark.parametrize("ranks,per_node", SHAPES)
@pytest.mark.parametrize("hidden_bytes,scales,topk", [(7168, 56, 8), (7168 * 2, 0, 8), (256, 2, 0), (2560, 20, 9)])
def test_dispatch_layout(ranks, per_node, hidden_bytes, scales, topk):
    lay = IL.InternodeDispatchLayout(IL.InternodeRegions(ranks, per_node), hidden_bytes, scales, topk)
    assert lay.slot_bytes % 16 == 0 and lay.body_bytes % 16 == 0
    assert lay.body_bytes >= hidden_bytes + 4 * scales + 8 * topk and lay.meta_bytes >= 4 * (per_node + 1)
    for window in (lay.regions.data_offset + (1 << 20), 1 << 28, 3 << 30):
        n = lay.max_tokens(window)
        assert 0 <= n <= IL.INTERNODE_MAX_TOKENS
        if n:
            m = ranks // per_node
            _no_overlap([("landing", lay.landing_offset(n), m * n * lay.slot_bytes),
                         ("staging", lay.staging_offset(n), n * lay.body_bytes),
                         ("metas", lay.meta_staging_offset(n), n * m * lay.meta_bytes)])
            assert lay.end(n) <= window, "the dispatch areas overrun the window"
            assert lay.landing_offset(n) >= lay.regions.data_offset
        assert lay.max_tokens(window + 64 * lay.slot_bytes * (ranks // per_node + 2)) >= n


@pytest.mark.parametrize("ranks,per_node", SHAPES)
@pytest.mark.parametrize("hidden,topk", [(7168, 8), (4096, 0), (256, 3)])
def test_combine_layout(ranks, per_node, hidden, topk):
    lay = IL.InternodeCombineLayout(IL.InternodeRegions(ranks, per_node), hidden, topk)
    assert lay.row_bytes % 16 == 0 and lay.row_bytes >= 2 * hidden + 4 * topk
    for window in (1 << 26, 1 << 30):
        n = lay.max_tokens(window)
        if n:
            m = ranks // per_node
            _no_overlap([("landing", lay.landing_offset(n), m * n * lay.row_bytes),
                         ("partials", lay.partial_offset(n), m * n * lay.row_bytes),
                         ("staging", lay.staging_offset(n), lay.max_rows(n, window) * lay.row_bytes)])
            # the staged rows get at least the room of the landing and partial rows together
            assert lay.max_rows(n, window) >= min(ranks, 2 * m) * n and lay.staging_offset(n) <= window
            # never fewer tokens than a layout that reserves the worst case (R * N staged rows)
            worst = (window - lay.regions.data_offset - 2 * IL.PAGE) // ((2 * m + ranks) * lay.row_bytes)
            assert n >= min(worst, IL.INTERNODE_MAX_TOKENS)


@pytest.mark.parametrize("ranks,per_node,tokens", [(16, 8, 4096), (8, 4, 256), (8, 2, 1000), (16, 1, 1)])
def test_size_hint_holds_what_it_promises(ranks, per_node, tokens):
    hint = deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, ranks, tokens, ranks_per_node=per_node)
    regions = IL.InternodeRegions(ranks, per_node)
    for lay in (IL.InternodeDispatchLayout(regions, 7168 * 2, 0, 32), IL.InternodeDispatchLayout(regions, 7168, 56, 32),
                IL.InternodeCombineLayout(regions, 7168, 32)):
        assert lay.max_tokens(hint) >= tokens, f"{lay} holds {lay.max_tokens(hint)} < {tokens} tokens in the hint"
    assert deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, 8, tokens, ranks_per_node=8) == 0   # one node


def test_kernel_names_and_defines():
    """Only the kernel that hands the data to the caller carries the op's name (profiler tables)."""
    names = [k.split("internode")[1] for k in internode.DISPATCH_KERNELS + internode.COMBINE_KERNELS]
    assert sum("dispatch" in n.split("E")[0] for n in names[:4]) == 1
    assert sum("combine" in n.split("E")[0] for n in names[4:]) == 1
    # DeepEP's test_internode profiles an op and wants 'notify' in exactly one kernel name of each
    assert [sum("notify" in n.split("E")[0] for n in part) for part in (names[:4], names[4:])] == [1, 1]
    assert internode.kernel_defines(16, 8, HIDDEN=7168, NUM_TOPK=8) == dict(NUM_RANKS=16, RANKS_PER_NODE=8,
                                                                            HIDDEN=7168, NUM_TOPK=8)


def test_load_store_only_windows_cannot_keep_nodes_apart():
    """A window with no network path refuses the internode engine's node-limited transport (the engine then
    closes it and raises); the nvshmem window has one."""
    from deepep_portable.transports.nvlink.window import NvlinkWindow
    from deepep_portable.transports.nvshmem.window import NvshmemWindow

    with pytest.raises(NotImplementedError, match="load/store only"):
        Window().node_transport_params([0, 1])
    assert NvlinkWindow.node_transport_params is Window.node_transport_params
    assert NvshmemWindow.node_transport_params is not Window.node_transport_params


def test_which_transports_serve_internode_normal_mode():
    from deepep_portable.transports import backend_class, internode_normal_transports

    names = internode_normal_transports()
    assert "reference" in names and "nvshmem" in names and "nvlink" not in names
    assert all(backend_class(n).internode_normal for n in names)


# ---- the engine's host flow, with a window that records launches instead of running them ----------------
class _Words:
    def __init__(self, n):
        import ctypes

        self.words = (ctypes.c_int * n)()
        self.dev = 0x1000

    def free(self):
        pass


class _Kernel:
    device = 0

    def __init__(self, name, log, on_launch=None):
        self.name, self.log, self.on_launch = name, log, on_launch

    def launch(self, grid, block, shmem, stream, params, cluster, cooperative, programmatic=False):
        self.log.append((self.name, grid, block, bytes(params)))
        if self.on_launch is not None:
            self.on_launch(bytes(params))


class _FakeWindow(Window):
    """What InternodeEngine asks of a window, on the CPU: bases of every rank, a node-limited transport struct,
    kernels that record their launches (notify_counts also 'publishes' a receive count, as the GPU would)."""

    def __init__(self, ctx, nbytes, recv_rows):
        import torch

        self.mem = torch.zeros(nbytes, dtype=torch.uint8)
        self.base, self.size, self.dev = self.mem.data_ptr(), nbytes, 0
        self.bases = [self.base + (r + 1) * (1 << 40) for r in range(ctx.num_ranks)]
        self.errors, self.max_blocks, self.log, self.closed = _Words(8), 24, [], False
        self.recv_rows, self.engine, self.most_call_tokens = recv_rows, None, 0

    def node_transport_params(self, node_ranks):
        from deepep_portable.transports.nvshmem.abi import NvshmemTransportParams

        self.node_ranks = list(node_ranks)
        return NvshmemTransportParams(self.base, 0, len(self.bases), 0)

    def rows_per_source(self):   # every source sends each rank its share of recv_rows, the first ones one more
        R = self.engine.num_ranks
        return [self.recv_rows // R + (s < self.recv_rows % R) for s in range(R)]

    def kernel(self, source, name, defines):
        self.defines = dict(defines)

        def publish(params):   # [1] receive count, [2] the most call tokens, [3..] expert counts; the rank prefix
            import ctypes       # matrix and send rows as the kernels would write them (the host reads them in rounds)

            import torch

            p = self.engine.dispatch_t.from_buffer_copy(params)
            words = self.engine.notify.words
            words[1], words[2] = self.recv_rows, max(p.call_tokens, self.most_call_tokens)
            for e in range(8):
                words[3 + e] = 2 + e
            R = self.engine.num_ranks
            counts = torch.tensor(self.rows_per_source(), dtype=torch.int32).view(R, 1).expand(R, R)
            matrix = counts.cumsum(0, dtype=torch.int32).contiguous()
            ctypes.memmove(p.rank_prefix_matrix, matrix.data_ptr(), matrix.numel() * 4)
            rows = torch.full((p.num_tokens, R), -1, dtype=torch.int32)
            rows[: min(p.num_tokens, self.recv_rows // R), :] = torch.arange(min(p.num_tokens, self.recv_rows // R),
                                                                            dtype=torch.int32).view(-1, 1)
            ctypes.memmove(p.send_rows, rows.data_ptr(), rows.numel() * 4)
            words[0] = 1

        def receive(params):   # a fresh dispatch's source tokens: a source's rows are its tokens 0, 1, ... of the op
            import ctypes

            import torch

            p = self.engine.dispatch_t.from_buffer_copy(params)
            if p.recv_src_idx:
                src = torch.cat([torch.arange(c, dtype=torch.int32) for c in self.rows_per_source()])[:p.max_recv_rows]
                ctypes.memmove(p.recv_src_idx, src.data_ptr(), src.numel() * 4)
        op = name.split("internode")[1].split("E")[0]
        return _Kernel(name, self.log, publish if op == "13notify_counts" else receive if op == "8dispatch" else None)

    def close(self):
        self.closed = True


def _engine(monkeypatch, rank=3, ranks=8, per_node=4, recv_rows=37):
    import torch

    from deepep_portable.contract import BufferContext

    monkeypatch.setattr(internode, "MappedWords", lambda dev, n: _Words(n))
    monkeypatch.setattr(internode, "stream_handle", lambda s: 0)
    hint = deep_ep.Config().get_rdma_buffer_size_hint(1024 * 2, ranks, 64, ranks_per_node=per_node)
    ctx = BufferContext(comm=None, rank=rank, num_ranks=ranks, device=torch.device("cpu"), num_nvl_bytes=1,
                        num_rdma_bytes=hint, low_latency_mode=False, uid=7, timeout_s=1.0, ranks_per_node=per_node)
    holder = {}

    def make_window(c, nbytes):
        holder["w"] = _FakeWindow(c, nbytes, recv_rows)
        return holder["w"]
    engine = internode.InternodeEngine(ctx, make_window)
    holder["w"].engine = engine
    return engine, holder["w"]


def test_engine_dispatch_and_combine_host_flow(monkeypatch):
    """Fresh dispatch (the host learns the count), cached dispatch, num_worst_tokens, combine: which kernels,
    in which order, with which parameters and outputs (no GPU: the launches are recorded)."""
    import torch

    from deepep_portable.contract import CachedDispatchArgs, CombineArgs, DispatchArgs

    engine, w = _engine(monkeypatch)
    R, P, M, T, H = 8, 4, 2, 50, 1024
    assert w.node_ranks == [0, 1, 2, 3] and engine.node_bases.tolist() == w.bases[:4]
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    in_rank = torch.rand(T, R) < 0.3
    idx = torch.zeros(T, 4, dtype=torch.int64)
    args = DispatchArgs(x=x, x_scales=None, topk_idx=idx, topk_weights=torch.zeros(T, 4),
                        num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
                        num_tokens_per_expert=torch.zeros(16, dtype=torch.int32), num_experts=16, expert_alignment=2,
                        num_worst_tokens=0, num_sms=16, config=None)
    res = engine.dispatch(args)
    names = [n.split("internode")[1].split("E")[0] for n, *_ in w.log]
    assert names == ["13notify_counts", "11send_tokens", "16forward_arrivals", "8dispatch"]
    assert w.defines == dict(NUM_RANKS=R, RANKS_PER_NODE=P, HIDDEN_BYTES=2 * H, NUM_SCALES=0, NUM_TOPK=4)
    first = engine.dispatch_t.from_buffer_copy(w.log[0][3])
    last = engine.dispatch_t.from_buffer_copy(w.log[3][3])
    assert first.max_recv_rows == 0 and first.host_out == engine.notify.dev and last.host_out == 0
    assert last.max_recv_rows == 37 and last.recv_x == res.recv_x.data_ptr() and res.recv_x.shape == (37, H)
    assert res.num_recv_tokens_per_expert_list == [2, 3] and res.recv_topk_idx.shape == (37, 4)
    c = last.common
    g = engine.regions
    assert (c.rank, c.local_base, c.data_offset, c.hs_offset) == (3, w.base, g.data_offset, g.hs_offset)
    assert c.error_claim == w.base + 16 and c.node_bases == engine.node_bases.data_ptr() and c.num_channels == 1
    lay = internode.IL.InternodeDispatchLayout(g, 2 * H, 0, 4)
    N = lay.max_tokens(engine.ctx.num_rdma_bytes)
    assert c.max_tokens == N >= 64 and last.landing_offset == g.data_offset
    assert last.staging_offset == lay.staging_offset(N)
    h = res.handle
    assert h.num_recv_tokens == h.num_recv_rows == 37 and h.rank_prefix_matrix.shape == (R, R)
    assert h.send_rows.shape == (T, R) and h.recv_src_idx.shape == (37,)
    st = h.transport_state
    assert st.landed_meta.shape == (M, N, P + 1) and st.landed_range.shape == (M, internode.IL.INTERNODE_MAX_CHUNKS)
    assert last.landed_meta == st.landed_meta.data_ptr() and last.rank_prefix_matrix == h.rank_prefix_matrix.data_ptr()

    # cached: no count to learn, rows from the handle, no source indices written
    w.log.clear()
    recv, scales = engine.cached_dispatch(CachedDispatchArgs(x=x, x_scales=None, handle=h, num_sms=8))
    p0, p3 = (engine.dispatch_t.from_buffer_copy(w.log[i][3]) for i in (0, 3))
    assert len(w.log) == 4 and p0.max_recv_rows == 37 and p0.host_out == 0 and p3.recv_src_idx == 0
    assert w.defines["NUM_TOPK"] == 0 and recv.shape == (37, H) and scales is None

    # combine: three kernels, the handle's landed metas and matrix
    w.log.clear()
    y = torch.zeros(37, H, dtype=torch.bfloat16)
    out, out_w = engine.combine(CombineArgs(x=y, handle=h, topk_weights=torch.zeros(37, 4), bias_0=None, bias_1=None,
                                            num_sms=8))
    names = [n.split("internode")[1].split("E")[0] for n, *_ in w.log]
    assert names == ["18notify_staged_rows", "16reduce_node_rows", "7combine"]
    p = engine.combine_t.from_buffer_copy(w.log[0][3])
    assert p.meta_tokens == N and p.landed_meta == st.landed_meta.data_ptr() and p.num_tokens == T
    assert p.num_recv == st.num_recv.data_ptr() and out.shape == (T, H) and out_w.shape == (T, 4)
    # its N is the dispatch's round size, every rank's alike, and the staged rows hold any gate's (R x N)
    assert p.common.max_tokens == engine.tokens_per_round(x, None, 4) == st.tokens_per_round
    assert p.max_rows >= R * p.common.max_tokens

    # rows wider than the dispatch's (more weights per row) are refused before any launch, on every rank alike
    w.log.clear()
    with pytest.raises(ValueError, match="hidden 1024 and top-k 64 needs a larger buffer"):
        engine.combine(CombineArgs(x=y, handle=h, topk_weights=torch.zeros(37, 64), bias_0=None, bias_1=None,
                                   num_sms=8))
    assert w.log == []


def test_engine_num_worst_tokens_and_refusals(monkeypatch):
    import torch

    from deepep_portable.contract import DispatchArgs

    engine, w = _engine(monkeypatch, recv_rows=999)
    T, R = 10, 8
    in_rank = torch.ones(T, R, dtype=torch.bool)

    def args(tokens=T, worst=0, experts=16):
        x = torch.zeros(tokens, 512, dtype=torch.bfloat16)
        ir = torch.ones(tokens, R, dtype=torch.bool)
        return DispatchArgs(x=x, x_scales=None, topk_idx=None, topk_weights=None,
                            num_tokens_per_rank=ir.sum(0, dtype=torch.int32), is_token_in_rank=ir,
                            num_tokens_per_expert=torch.zeros(experts, dtype=torch.int32), num_experts=experts,
                            expert_alignment=1, num_worst_tokens=worst, num_sms=4, config=None)
    res = engine.dispatch(args(worst=123))
    first = engine.dispatch_t.from_buffer_copy(w.log[0][3])
    assert first.max_recv_rows == 123 and first.host_out == 0 and res.handle.num_recv_tokens == -1
    assert res.recv_x.shape == (123, 512) and res.handle.num_recv_rows == 123
    # no round size: its combine's N is what the window holds
    assert res.handle.transport_state.tokens_per_round == 0
    w.log.clear()
    with pytest.raises(ValueError, match="needs a larger buffer"):   # no rounds without a count to learn
        engine.dispatch(args(tokens=100000, worst=100))
    with pytest.raises(ValueError, match="experts per rank"):
        engine.dispatch(args(experts=8 * (internode.IL.INTERNODE_MAX_LOCAL_EXPERTS + 1)))
    assert w.log == []   # refused before anything was launched
    assert in_rank.shape == (T, R)


def test_engine_refuses_a_node_that_is_not_load_store(monkeypatch):
    """A rank of my node without a load/store address: the window is closed and the error names them."""
    original = _FakeWindow.__init__

    def holes(self, ctx, nbytes, recv_rows):
        original(self, ctx, nbytes, recv_rows)
        self.bases[1] = 0
    monkeypatch.setattr(_FakeWindow, "__init__", holes)
    made = {}
    monkeypatch.setattr(_FakeWindow, "close", lambda self: made.setdefault("closed", True))
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of node 0"):
        _engine(monkeypatch)
    assert made == {"closed": True}


@pytest.mark.parametrize("fp8", [False, True])
def test_round_variants_are_what_a_round_builds(monkeypatch, fp8):
    """round_variants (the fuzz's compile-ahead over nvshmem) names exactly the kernels a round of dispatch, cached
    dispatch and combine with weights asks its window for."""
    import torch

    from deepep_portable.contract import CachedDispatchArgs, CombineArgs, DispatchArgs

    engine, w = _engine(monkeypatch)
    asked, kernel = set(), w.kernel

    def recording_kernel(src, name, defines):
        asked.add((src, tuple(sorted(defines.items()))))
        return kernel(src, name, defines)
    monkeypatch.setattr(w, "kernel", recording_kernel)
    R, P, T, H, K = 8, 4, 50, 1024, 4
    x = torch.zeros(T, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scales = torch.ones(T, H // 128) if fp8 else None
    in_rank = torch.rand(T, R) < 0.3
    res = engine.dispatch(DispatchArgs(
        x=x, x_scales=scales, topk_idx=torch.zeros(T, K, dtype=torch.int64), topk_weights=torch.zeros(T, K),
        num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
        num_tokens_per_expert=torch.zeros(16, dtype=torch.int32), num_experts=16, expert_alignment=1,
        num_worst_tokens=0, num_sms=16, config=None))
    engine.cached_dispatch(CachedDispatchArgs(x=x, x_scales=scales, handle=res.handle, num_sms=8))
    engine.combine(CombineArgs(x=torch.zeros(37, H, dtype=torch.bfloat16), handle=res.handle,
                               topk_weights=torch.zeros(37, K), bias_0=None, bias_1=None, num_sms=8))
    want = internode.round_variants(R, P, H, 1 if fp8 else 2, H // 128 if fp8 else 0, K)
    assert asked == {(src, tuple(sorted(d.items()))) for src, d in want}


def test_precompile_covers_the_gpu_suites_shapes():
    """Every internode kernel shape the GPU suites and bench use is in `precompile --nvshmem`'s list."""
    variants = {(src, tuple(sorted(d.items()))) for src, d in internode.precompile_variants()}
    for ranks, per_node in ((8, 4), (8, 2), (16, 8)):
        bench_fp8 = internode.kernel_defines(ranks, per_node, HIDDEN_BYTES=7168, NUM_SCALES=56, NUM_TOPK=8)
        bench_combine = internode.kernel_defines(ranks, per_node, HIDDEN=7168, NUM_TOPK=0)
        assert (internode.DISPATCH_SOURCE, tuple(sorted(bench_fp8.items()))) in variants
        assert (internode.COMBINE_SOURCE, tuple(sorted(bench_combine.items()))) in variants
    for ranks, per_node in ((8, 4), (8, 2)):   # the elastic suite's logical nodes: hidden 256, top-4, BF16 and FP8
        for element_bytes, scales in ((2, 0), (1, 2)):
            for src, d in internode.round_variants(ranks, per_node, 256, element_bytes, scales, 4):
                assert (src, tuple(sorted(d.items()))) in variants, (src, d)


# ---- the bench's ceiling plan (tools/internode_ceiling.py) ----------------------------------------------------

def _routing(ranks: int, per_node: int, tokens: int, seed: int):
    """(matrix[s][d], node_counts[s][m]) of a random is_token_in_rank per source."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    matrix, node_counts = [], []
    for _ in range(ranks):
        in_rank = torch.rand(tokens, ranks, generator=gen) < 0.3
        matrix.append([int(v) for v in in_rank.sum(0)])
        node_counts.append([int(v) for v in in_rank.view(tokens, -1, per_node).any(2).sum(0)])
    return matrix, node_counts


@pytest.mark.parametrize("ranks,per_node", [(16, 8), (8, 4), (8, 2), (6, 1), (4, 4)])
def test_ceiling_traffic_is_the_ops(ranks, per_node):
    """Combine moves exactly the dispatch's rows back: per (source, node) on the network, per (source,
    destination) in the node; nothing crosses the network inside a node, nothing leaves it by load/store."""
    from deepep_portable.tools.internode_ceiling import internode_traffic

    matrix, node_counts = _routing(ranks, per_node, 50, ranks * 100 + per_node)
    row = 7392
    totals = {}
    for forward in (True, False):
        net_total = nvl_total = 0
        for r in range(ranks):
            net, nvl = internode_traffic(matrix, node_counts, r, per_node, forward, row)
            assert all(d // per_node != r // per_node and d % per_node == r % per_node for d, _ in net)
            assert all(0 <= j < per_node for j, _ in nvl) and all(n > 0 for _, n in net + nvl)
            net_total += sum(n for _, n in net)
            nvl_total += sum(n for _, n in nvl)
        totals[forward] = (net_total, nvl_total)
    off_node = sum(node_counts[s][m] for s in range(ranks) for m in range(ranks // per_node) if m != s // per_node)
    assert totals[True] == totals[False] == (off_node * row, sum(map(sum, matrix)) * row)


def test_ceiling_pieces_cover_the_traffic():
    """Every destination gets exactly its bytes in pieces of at most PIECE_BYTES, interleaved across
    destinations, 16-byte aligned, inside the data region; ranks start writing at different places."""
    from deepep_portable.tools.internode_ceiling import VIA_NODE, VIA_TRANSPORT, traffic_pieces

    net, nvl = [(4, 200_000), (12, 16)], [(0, 64 * 1024), (3, 130_000 // 16 * 16)]
    region = (8192, 8192 + 1_000_000)
    pieces = traffic_pieces(net, nvl, region, rank=5, num_ranks=16, piece_bytes=65536)
    got = {}
    for head, dst, src, n in pieces:
        key = (head & 0xffffffff, head >> 32)
        got[key] = got.get(key, 0) + n
        assert 0 < n <= 65536 and n % 16 == 0 and dst % 16 == 0 and src % 16 == 0
        assert region[0] <= dst and dst + n <= region[1] and region[0] <= src and src + n <= region[1]
    assert got == {**{(d, VIA_TRANSPORT): n for d, n in net}, **{(j, VIA_NODE): n for j, n in nvl}}
    assert [p[0] & 0xffffffff for p in pieces[:4]] == [4, 12, 0, 3]   # one piece of each before any second
    other = traffic_pieces(net, nvl, region, rank=6, num_ranks=16, piece_bytes=65536)
    assert other[0][1] != pieces[0][1]
    with pytest.raises(ValueError, match="holds no"):
        traffic_pieces(net, nvl, (0, 8), rank=0, num_ranks=2)


def test_kernel_transport_over_several_nodes_builds_its_engine(monkeypatch):
    """KernelTransport sizes the internode engine from runtime_capabilities(), which a backend may answer from
    its low-latency engine (nvshmem does): that attribute must exist before the engines are made (it did not,
    and every nvshmem Buffer over several logical nodes failed with an AttributeError)."""
    import torch

    from deepep_portable.contract import BufferContext
    from deepep_portable.transports import kernel
    from deepep_portable.transports.nvshmem.transport import NvshmemTransport

    made = {}
    monkeypatch.setattr(kernel, "InternodeEngine", lambda ctx, make_window, channels: made.setdefault("ch", channels))
    ctx = BufferContext(comm=None, rank=0, num_ranks=4, device=torch.device("cpu"), num_nvl_bytes=1,
                        num_rdma_bytes=0, low_latency_mode=False, uid=1, timeout_s=1.0, ranks_per_node=2)
    t = NvshmemTransport(ctx)
    assert made["ch"] == NvshmemTransport.capabilities.max_channels and t.ll_engine is None


def _round_args(T, R, H, experts=16, topk=4):
    import torch

    from deepep_portable.contract import DispatchArgs

    in_rank = torch.ones(T, R, dtype=torch.bool)
    return DispatchArgs(x=torch.zeros(T, H, dtype=torch.bfloat16), x_scales=None,
                        topk_idx=torch.zeros(T, topk, dtype=torch.int64), topk_weights=torch.zeros(T, topk),
                        num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
                        num_tokens_per_expert=torch.zeros(experts, dtype=torch.int32), num_experts=experts,
                        expert_alignment=1, num_worst_tokens=0, num_sms=4, config=None)


def test_engine_runs_a_call_larger_than_its_window_in_rounds(monkeypatch):
    """More tokens than a round holds: every rank runs the rounds the largest rank needs (the count says), each a
    whole op on its span of tokens with the call's token count in its message; the call's outputs, handle, cached
    dispatch and combine put the rounds together (launches recorded, no GPU)."""
    import torch

    from deepep_portable.contract import CachedDispatchArgs, CombineArgs
    from deepep_portable.handles import InternodeRounds

    engine, w = _engine(monkeypatch, recv_rows=40)
    R, H = 8, 1024
    n = engine.tokens_per_round(torch.zeros(1, H, dtype=torch.bfloat16), None, 4)
    T = 2 * n + 5
    args = _round_args(T, R, H)
    res = engine.dispatch(args)
    assert len(w.log) == 4 * 3
    ps = [engine.dispatch_t.from_buffer_copy(w.log[4 * k][3]) for k in range(3)]
    assert [p.num_tokens for p in ps] == [n, n, 5] and all(p.call_tokens == T for p in ps)
    assert [p.x for p in ps] == [args.x.data_ptr() + k * n * H * 2 for k in range(3)]
    assert [p.is_token_in_rank for p in ps] == [args.is_token_in_rank.data_ptr() + k * n * R for k in range(3)]
    # the call's expert counts ride in the first round only, aligned there once
    assert ps[0].num_tokens_per_expert == args.num_tokens_per_expert.data_ptr()
    assert ps[1].num_tokens_per_expert != args.num_tokens_per_expert.data_ptr() and ps[1].expert_alignment == 1
    h = res.handle
    st = h.transport_state
    assert isinstance(st, InternodeRounds) and st.tokens_per_round == n and len(st.rounds) == 3
    assert res.recv_x.shape == (120, H) and h.num_recv_rows == h.num_recv_tokens == 120 and h.num_tokens == T
    assert res.recv_topk_idx.shape == (120, 4) and h.send_rows.shape == (T, R) and h.recv_src_idx.shape == (120,)
    assert res.num_recv_tokens_per_expert_list == [2, 3]
    assert sorted(torch.cat(st.rows).tolist()) == list(range(120))   # every round's rows land once
    # the call's source tokens: each source's rows of round k (tokens 0..4 of the round) are its tokens k n + 0..4
    expected = torch.cat([torch.arange(5) + k * n for k in range(3)]).repeat(R)
    assert h.recv_src_idx.tolist() == expected.tolist()

    w.log.clear()
    recv, scales = engine.cached_dispatch(CachedDispatchArgs(x=args.x, x_scales=None, handle=h, num_sms=4))
    assert len(w.log) == 4 * 3 and recv.shape == (120, H) and scales is None
    ps = [engine.dispatch_t.from_buffer_copy(w.log[4 * k][3]) for k in range(3)]
    assert [p.num_tokens for p in ps] == [n, n, 5] and [p.max_recv_rows for p in ps] == [40, 40, 40]

    w.log.clear()
    out, out_w = engine.combine(CombineArgs(x=torch.zeros(120, H, dtype=torch.bfloat16), handle=h,
                                            topk_weights=torch.zeros(120, 4), bias_0=None, bias_1=None, num_sms=4))
    assert len(w.log) == 3 * 3 and out.shape == (T, H) and out_w.shape == (T, 4)
    cs = [engine.combine_t.from_buffer_copy(w.log[3 * k][3]) for k in range(3)]
    assert [c.num_tokens for c in cs] == [n, n, 5] and all(c.common.max_tokens == n for c in cs)
    assert [c.out for c in cs] == [out.data_ptr() + k * n * H * 2 for k in range(3)]
    assert [c.out_topk_weights for c in cs] == [out_w.data_ptr() + k * n * 4 * 4 for k in range(3)]


def test_a_rank_with_few_tokens_joins_every_round(monkeypatch):
    """This rank's tokens fit one round, another rank's need three: the count says so, and this rank runs two more
    rounds with no tokens. With every rank's tokens in one round, the call is one op as before (its own handle)."""
    import torch

    from deepep_portable.handles import InternodeRounds, InternodeState

    engine, w = _engine(monkeypatch, recv_rows=40)
    n = engine.tokens_per_round(torch.zeros(1, 1024, dtype=torch.bfloat16), None, 4)
    res = engine.dispatch(_round_args(7, 8, 1024))
    assert len(w.log) == 4 and isinstance(res.handle.transport_state, InternodeState)
    w.log.clear()
    w.most_call_tokens = 3 * n
    res = engine.dispatch(_round_args(7, 8, 1024))
    ps = [engine.dispatch_t.from_buffer_copy(w.log[4 * k][3]) for k in range(3)]
    assert len(w.log) == 12 and [p.num_tokens for p in ps] == [7, 0, 0]
    assert isinstance(res.handle.transport_state, InternodeRounds) and res.recv_x.shape[0] == 120


def test_outputs_that_cannot_be_allocated_after_the_launch_fail_this_rank_alone(monkeypatch):
    """The dispatch allocates its outputs once the receive count is known, after its first three kernels (the last of
    them ends the op; no peer waits for this rank's pull, which only reads). A failure there (out of memory) is raised
    as after the launch: failures.py does not refuse the call, the peers' dispatch completes, this Buffer works on.
    In rounds that holds only for the last round and the call's merge: before them, the peers wait for this rank's
    later rounds, so the failure is a refusal of the call (the peers hear of it)."""
    import torch

    from deepep_portable.contract import CachedDispatchArgs
    from deepep_portable.engines import internode_rounds

    engine, w = _engine(monkeypatch, recv_rows=40)
    allocate = engine._dispatch_outputs
    failing = {"at": None, "calls": 0}

    def outputs(*a):
        failing["calls"] += 1
        if failing["calls"] == failing["at"]:
            raise torch.cuda.OutOfMemoryError("forced: no memory for the dispatch's outputs")
        return allocate(*a)
    engine._dispatch_outputs = outputs

    def names():
        return [n.split("internode")[1].split("E")[0] for n, *_ in w.log]

    def dispatch_failing(at, tokens):
        w.log.clear()
        failing.update(at=at, calls=0)
        with pytest.raises(torch.cuda.OutOfMemoryError, match="forced") as info:
            engine.dispatch(_round_args(tokens, 8, 1024))
        return getattr(info.value, "after_launch", False)

    # one op: the first three kernels ran, the pull did not; then the next call works
    assert dispatch_failing(1, 7) is True
    assert names() == ["13notify_counts", "11send_tokens", "16forward_arrivals"]
    failing["at"] = None
    w.log.clear()
    res = engine.dispatch(_round_args(7, 8, 1024))
    assert len(w.log) == 4 and res.recv_x.shape[0] == 40

    # three rounds: the first or the second round's outputs fail -> a refusal; the last round's -> this rank's alone
    n = engine.tokens_per_round(torch.zeros(1, 1024, dtype=torch.bfloat16), None, 4)
    assert [dispatch_failing(k, 2 * n + 5) for k in (1, 2, 3)] == [False, False, True]
    assert len(w.log) == 4 * 3 - 1   # the last round's pull was not launched
    # this rank's 7 tokens fit one round, a peer's need three (the count says so): its first round is not the last
    w.most_call_tokens = 2 * n + 5
    assert [dispatch_failing(k, 7) for k in (1, 3)] == [False, True]
    w.most_call_tokens = 0
    # the call's merge fails after every round ran -> this rank's alone
    failing["at"] = None
    merged = internode_rounds._merged_dispatch

    def no_merge(*a):
        raise torch.cuda.OutOfMemoryError("forced: no memory for the call's outputs")
    monkeypatch.setattr(internode_rounds, "_merged_dispatch", no_merge)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="call's outputs") as info:
        engine.dispatch(_round_args(2 * n + 5, 8, 1024))
    assert info.value.after_launch is True
    monkeypatch.setattr(internode_rounds, "_merged_dispatch", merged)
    res = engine.dispatch(_round_args(2 * n + 5, 8, 1024))

    # a cached dispatch in rounds: the same rule
    for at, alone in ((1, False), (3, True)):
        failing.update(at=at, calls=0)
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            engine.cached_dispatch(CachedDispatchArgs(x=torch.zeros(2 * n + 5, 1024, dtype=torch.bfloat16),
                                                      x_scales=None, handle=res.handle, num_sms=4))
        assert getattr(info.value, "after_launch", False) is alone
