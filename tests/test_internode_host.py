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
    # a count message: per rank, per node, the token count, the receiver's experts; whole 16-byte words
    assert g.count_words >= ranks + m + 1 + IL.INTERNODE_MAX_LOCAL_EXPERTS and (4 * g.count_words) % 16 == 0


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
                         ("staging", lay.staging_offset(n), ranks * n * lay.row_bytes)])
            # every row a rank can receive from sources of n tokens each is staged
            assert lay.max_rows(n, window) >= ranks * n and lay.end(n) <= window


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
