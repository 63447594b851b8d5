"""Node layouts (topology.py) and the internode handle's entries, without a GPU or a second process."""
import pytest
import torch

from deepep_portable.handles import DispatchHandle, InternodeHandle
from deepep_portable.topology import NodeLayout, layout_from_hosts


def test_nodes_from_hosts():
    assert layout_from_hosts(["a"] * 8) == NodeLayout(8, 8, True)
    assert layout_from_hosts(["a"] * 4 + ["b"] * 4) == NodeLayout(8, 4, False)
    lay = layout_from_hosts(["a", "a", "b", "b", "c", "c"])
    assert (lay.num_nodes, lay.node_of(3), lay.local_index(3)) == (3, 1, 1)
    with pytest.raises(ValueError, match="consecutive"):
        layout_from_hosts(["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="consecutive"):
        layout_from_hosts(["a", "a", "a", "b"])


def test_logical_nodes():
    assert layout_from_hosts(["a"] * 8, 4) == NodeLayout(8, 4, True)   # 2 logical nodes on one machine
    assert layout_from_hosts(["a"] * 8, 1).num_nodes == 8
    assert layout_from_hosts(["a"] * 4 + ["b"] * 4, 2).num_nodes == 4
    with pytest.raises(ValueError, match="span two machines"):
        layout_from_hosts(["a"] * 2 + ["b"] * 2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        layout_from_hosts(["a"] * 6, 4)
    with pytest.raises(ValueError, match="positive"):
        layout_from_hosts(["a"] * 4, 0)


def test_internode_handle_entries():
    """Rank 1 of 4 (2 nodes x 2): three tokens; every DeepEP position filled from the DispatchHandle."""
    in_rank = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 0, 0]], dtype=torch.bool)
    # rows rank 1 receives: 2 from rank 0, 1 from rank 1 (itself), 0 from rank 2, 3 from rank 3
    prefix = torch.zeros(4, 4, dtype=torch.int32)
    prefix[:, 1] = torch.tensor([2, 3, 3, 6], dtype=torch.int32)
    send_rows = torch.tensor([[5, -1, 0, 1], [-1, -1, -1, 2], [6, 2, -1, -1]], dtype=torch.int32)
    src_idx = torch.tensor([0, 4, 2, 1, 3, 7, -1, -1], dtype=torch.int32)
    inner = DispatchHandle(rank_prefix_matrix=prefix, recv_src_idx=src_idx,
                           is_token_in_rank=in_rank, send_rows=send_rows, num_recv_tokens=6, num_recv_rows=8,
                           num_tokens=3, hidden=16, buffer_uid=1)
    h = InternodeHandle(inner, 2, 1)
    assert len(h) == 10 and h.inner is inner and h[0] is in_rank
    assert h[1].flatten().tolist() == [2, 2]                  # my tokens per node: node 0 {t0, t2}, node 1 {t0, t1}
    assert h[2].flatten().tolist() == [2, 1, 1, 2]            # my tokens per rank
    assert h[3].flatten().tolist() == [3, 3] and h[4].tolist() == [3, 6]
    assert h[5].flatten().tolist() == [2, 1, 0, 3] and h[-4].tolist() == [2, 3, 3, 6]
    assert h[7].tolist() == [[0, 0], [0, 4], [1, 2], [3, 1], [3, 3], [3, 7], [-1, -1], [-1, -1]]
    assert h[8].tolist() == [[0, 0], [-1, 1], [1, -1]]        # index among my tokens to each node
    assert h[9] is send_rows
    unpacked = tuple(h)   # callers unpack it like DeepEP's tuple
    assert unpacked[6] is h.recv_gbl_rank_prefix_sum


def test_rdma_size_hint():
    import deepep_portable as deep_ep

    cfg = deep_ep.Config()
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0                       # one node of 8
    two = cfg.get_rdma_buffer_size_hint(7168 * 2, 16)                            # 2 x 8 (DeepEP's assumption)
    assert two > 2 * 4096 * 7168 * 2                                             # two nodes' landing rows at least
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16, ranks_per_node=4) > two   # 4 x 4: more landing slots
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16, 1024, ranks_per_node=8) < two


class _FakeComm:
    """allgather_object over pretend ranks: each call returns what every rank would contribute."""

    def __init__(self, per_rank):
        self.per_rank = per_rank

    def allgather_object(self, mine):
        return [tuple(p) for p in self.per_rank]


def test_node_layout_is_decided_after_gathering(monkeypatch):
    from deepep_portable import topology

    monkeypatch.delenv(topology.RANKS_PER_NODE_ENV, raising=False)
    same = _FakeComm([("a", None, "2")] * 4)
    assert topology.node_layout(same).ranks_per_node == 2
    with pytest.raises(ValueError, match="disagree"):
        topology.node_layout(_FakeComm([("a", None, "2")] * 3 + [("a", None, "4")]))
    with pytest.raises(ValueError, match="must be an integer"):
        topology.node_layout(_FakeComm([("a", None, "two")] * 4))


def test_internode_handle_copies_and_pickles():
    import copy
    import pickle

    in_rank = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    prefix = torch.zeros(4, 4, dtype=torch.int32)
    prefix[:, 1] = torch.tensor([1, 1, 1, 2], dtype=torch.int32)
    inner = DispatchHandle(prefix, torch.tensor([0, 0], dtype=torch.int32), in_rank,
                           torch.zeros(1, 4, dtype=torch.int32), 2, 2, 1, 8, 1)
    h = InternodeHandle(inner, 2, 1)
    for again in (copy.deepcopy(h), pickle.loads(pickle.dumps(h))):
        assert isinstance(again, InternodeHandle) and len(again) == 10
        assert torch.equal(again[-4], h[-4]) and again.inner.num_tokens == 1
