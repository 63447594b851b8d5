"""Node peers of the ibgda backend's real provider, on the CPU: the mlx5 DevX provider (devx.py) over the fake of
its C glue (tests/test_ibgda_devx.py) under the ibgda window (window.py), with several ranks per node.

Four ranks (two nodes of two) are threads of this process over a threaded group. The node-shared window memory
(node_memory.py's interface; CUDA IPC on a GPU) is played by a file each rank maps: a peer "opens" a window by
mapping the file again, at another address over the same bytes, so a store through a node peer's mapping really
lands in that peer's window. Checked: the node's windows mapped (non-zero load/store bases, stores landing), QPs
made only to the other node's ranks (to every rank, self included, with allow_nvlink_for_low_latency_mode=False),
the endpoint and peer tables the device gets, the internode engine's node check passing, ranks that disagree or
a mapping that fails raising on every rank, and everything released. The same set-up over real CUDA IPC between
processes, and the low-latency ops over the NIC model with WQEs counted per peer, are
tests/mpi/test_ibgda_node_peers_gpu_mpi.py (GPU)."""
from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
from types import SimpleNamespace

import pytest
import torch

import deepep_portable as deep_ep
from deepep_portable.contract import BufferContext
from deepep_portable.engines import internode
from deepep_portable.layout import align_up
from deepep_portable.transports.ibgda import prm, roce
from deepep_portable.transports.ibgda.devx import DevxProvider
from deepep_portable.transports.ibgda.window import IbgdaWindow
from test_ibgda_devx import FakeGlue, _get, _sysfs

R, P, C = 4, 2, 2   # ranks, ranks per node, channels
_files = itertools.count()


class FileNodeMemory:
    """CUDA IPC's stand-in (node_memory.CudaIpcMemory's interface): a window is a file in `directory`; opening a
    peer's maps the file again here. `fail_open`: open() raises (a refused IPC handle)."""

    name = "file mappings (tests)"

    def __init__(self, directory: str, fail_open: bool = False, fail_alloc: bool = False) -> None:
        self.dir, self.fail_open, self.fail_alloc = directory, fail_open, fail_alloc
        self.maps = {}     # address handed out -> mmap
        self.calls = []

    @staticmethod
    def _map(path: str, nbytes: int):
        fd = os.open(path, os.O_RDWR)
        try:
            m = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return m, ctypes.addressof(ctypes.c_char.from_buffer(m))

    def alloc(self, nbytes: int, align: int):
        if self.fail_alloc:
            raise RuntimeError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (played)")
        path = os.path.join(self.dir, f"window{next(_files)}")
        with open(path, "wb") as f:
            f.truncate(nbytes + align)
        m, start = self._map(path, nbytes + align)
        base = align_up(start, align)
        self.maps[base] = m
        self.calls.append(("alloc", base))
        return base, dict(path=path, size=nbytes + align, offset=base - start)

    def open(self, public) -> int:
        if self.fail_open:
            raise RuntimeError("cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE (played)")
        m, start = self._map(public["path"], public["size"])
        address = start + public["offset"]
        self.maps[address] = m
        self.calls.append(("open", address))
        return address

    def _unmap(self, address: int, what: str) -> None:
        self.calls.append((what, address))
        self.maps.pop(address).close()

    def close(self, address: int) -> None:
        self._unmap(address, "close")

    def free(self, base: int) -> None:
        self._unmap(base, "free")


class _Group:
    """The ranks' shared state: a barrier (with a timeout: a rank that fails alone breaks it) and the slots of an
    allgather."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots = [None] * n


class _ThreadComm:
    """comm.Comm's allgather_object / barrier for one rank of a _Group."""

    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank = group, rank

    def allgather_object(self, obj, timeout_s=None):
        self.group.slots[self.rank] = obj
        self.group.barrier.wait()
        out = list(self.group.slots)
        self.group.barrier.wait()   # nobody writes the next round's slot before everyone read this one
        return out

    def barrier(self) -> None:
        self.group.barrier.wait()


def _run(fn, n: int = R):
    """fn(rank, comm) on n threads; returns (results, exceptions) per rank."""
    group = _Group(n)
    results, raised = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r, _ThreadComm(group, r))
        except BaseException as e:   # noqa: BLE001 - returned to the test (a rank that fails alone leaves the
            raised[r] = e            # others to the barrier's timeout)
    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, raised


def _ctx(rank, comm, nvlink=True, nbytes=1 << 17, nvl_bytes=0):
    return BufferContext(comm=comm, rank=rank, num_ranks=R, device=torch.device("cpu"), num_nvl_bytes=nvl_bytes,
                         num_rdma_bytes=nbytes, low_latency_mode=True, uid=4242, timeout_s=5.0, ranks_per_node=P,
                         options=dict(num_qps_per_rank=C, allow_nvlink_for_low_latency_mode=nvlink,
                                      ibgda=roce.ibgda_options({}, environ={})))


def _provider(ctx, memory):
    glue = FakeGlue(ctx.rank)
    return glue, DevxProvider(ctx, glue=glue, devices=_sysfs(), node_memory=memory)


def _qps(glue):
    """The QPs the fake firmware was asked to create: their numbers' count."""
    return sum(1 for kind, cmd in glue.commands
               if kind == "create" and _get(cmd, prm.CREATE_QP_IN, "opcode") == prm.CMD_CREATE_QP)


def _remote_qpns(glue):
    """The peer QP numbers the provider's INIT2RTR commands connected to."""
    return sorted(_get(cmd, prm.MODIFY_QP_IN, "qpc", "remote_qpn") for kind, cmd in glue.commands
                  if kind == "modify" and _get(cmd, prm.MODIFY_QP_IN, "opcode") == prm.CMD_INIT2RTR_QP)


def _word(address: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(address)


@pytest.mark.parametrize("nvlink", [True, False])
def test_node_windows_are_mapped_and_only_the_network_gets_queues(tmp_path, nvlink):
    memories = [FileNodeMemory(str(tmp_path)) for _ in range(R)]

    def rank_body(r, comm):
        ctx = _ctx(r, comm, nvlink)
        glue, prov = _provider(ctx, memories[r])
        w = IbgdaWindow(ctx, 1 << 17, channels=C, depth=64, provider=prov)
        out = dict(node=w.node, node_base=[w.node_base(x) for x in range(R)], bases=list(w.bases),
                   own=w.base, peer_bases=[p.base for p in w.peers], qps=_qps(glue), queues=[len(q) for q in w.queues],
                   rings=[[w.endpoint(p, ch).q.ring for ch in range(C)] for p in range(R)],
                   raddr=[w.endpoint(p, 0).raddr_base for p in range(R)],
                   table=list((ctypes.c_int64 * R).from_address(w.transport_params().peer_bases)),
                   node_table=list((ctypes.c_int64 * R).from_address(w.node_transport_params(w.node).peer_bases)),
                   describe=prov.describe())
        # A store through each node peer's mapping lands in that peer's window: word 8 * me of it.
        for p in w.node:
            _word(w.node_base(p) + 8 * (r + 1)).value = 1000 * p + r
        comm.barrier()
        out["landed"] = {src: _word(w.base + 8 * (src + 1)).value for src in w.node}
        out["remote_qpns"] = _remote_qpns(glue)
        out["my_qpns"] = [q.qpn for row in w.queues for q in row]
        w.close()   # collective
        out["live"], out["left"] = list(glue.live), dict(memories[r].maps)
        return out

    res, raised = _run(rank_body)
    assert raised == [None] * R, raised
    for r, o in enumerate(res):
        node = [x for x in range(R) if x // P == r // P]
        assert o["node"] == node
        # The node's windows are mapped here (another mapping of the same bytes), every other rank's is not.
        assert all(o["node_base"][x] != 0 for x in node) and o["node_base"][r] == o["own"]
        assert all(o["node_base"][x] == 0 for x in range(R) if x not in node)
        assert all(o["node_base"][x] != o["peer_bases"][x] for x in node if x != r)
        assert o["landed"] == {src: 1000 * r + src for src in node}
        # The internode kernels get the node by load/store whatever the option says.
        assert o["node_table"] == o["node_base"]
        others = [x for x in range(R) if x not in node]
        if nvlink:   # the node by load/store, no queue to it (self included); the other node through the NIC
            assert o["bases"] == o["table"] == o["node_base"]
            assert o["queues"] == [0 if x in node else C for x in range(R)] and o["qps"] == len(others) * C
            assert all(ring == 0 for x in node for ring in o["rings"][x])
            assert all(o["raddr"][x] == o["peer_bases"][x] for x in range(R))
        else:        # today's low-latency behaviour: every rank, self included, through the NIC
            assert o["bases"] == o["table"] == [0] * R
            assert o["queues"] == [C] * R and o["qps"] == R * C
        assert all(ring != 0 for x in range(R) if o["queues"][x] for ring in o["rings"][x])
        assert o["describe"][-3].startswith("node peers: by load/store over file mappings")
        assert o["live"] == [] and o["left"] == {}, (o["live"], o["left"])
    # Every queue is connected to the peer's queue to it: the remote QP numbers are exactly the peers' queues to me.
    for r, o in enumerate(res):
        theirs = sorted(res[p]["my_qpns"][k] for p in range(R) for k in range(len(res[p]["my_qpns"]))
                        if _queue_owner(res[p], k) == r)
        assert o["remote_qpns"] == theirs


def _queue_owner(o, k):
    """The peer of the k-th queue in a rank's [peer][channel] order (peers without queues skipped)."""
    flat = [p for p in range(R) for _ in range(o["queues"][p])]
    return flat[k]


def test_internode_engine_finds_the_node_by_load_store(tmp_path, monkeypatch):
    """The engine's check that a node's ranks are reachable by load/store passes over the DevX provider; its
    node table and the transport's peer table hold the node's mappings and nothing of the other node."""
    from test_internode_host import _Words

    monkeypatch.setattr(internode, "MappedWords", lambda dev, n: _Words(n))
    hint = deep_ep.Config().get_rdma_buffer_size_hint(256 * 2, R, 8, ranks_per_node=P)
    memories = [FileNodeMemory(str(tmp_path)) for _ in range(R)]

    def rank_body(r, comm):
        ctx = _ctx(r, comm, nvlink=True, nbytes=hint, nvl_bytes=1)

        def make_window(c, nbytes):
            return IbgdaWindow(c, nbytes, channels=C, depth=64, provider=_provider(c, memories[r])[1])
        engine = internode.InternodeEngine(ctx, make_window, C)
        try:
            w = engine.window
            table = list((ctypes.c_int64 * R).from_address(engine.transport.peer_bases))
            return dict(node_bases=engine.node_bases.tolist(), mapped=[w.node_base(x) for x in range(R)],
                        table=table, queues=[len(q) for q in w.queues])
        finally:
            engine.window.close()

    res, raised = _run(rank_body)
    assert raised == [None] * R, raised
    for r, o in enumerate(res):
        node = [x for x in range(R) if x // P == r // P]
        assert o["node_bases"] == [o["mapped"][x] for x in node] and all(o["node_bases"])
        assert o["table"] == [o["mapped"][x] if x in node else 0 for x in range(R)]
        assert o["queues"] == [0 if x in node else C for x in range(R)]


def test_without_node_memory_the_node_goes_through_the_nic_and_the_engine_refuses(monkeypatch):
    """No node-shared memory (the provider on a machine without a GPU, as before it could map): every rank gets
    queues, and the internode engine refuses the node with its reason."""
    from test_internode_host import _Words

    monkeypatch.setattr(internode, "MappedWords", lambda dev, n: _Words(n))
    hint = deep_ep.Config().get_rdma_buffer_size_hint(256 * 2, R, 8, ranks_per_node=P)
    seen = [None] * R

    def rank_body(r, comm):
        ctx = _ctx(r, comm, nvlink=True, nbytes=hint, nvl_bytes=1)

        def make_window(c, nbytes):
            w = IbgdaWindow(c, nbytes, channels=1, depth=64, provider=_provider(c, None)[1])
            seen[r] = [len(q) for q in w.queues]
            return w
        internode.InternodeEngine(ctx, make_window, 1)

    _, raised = _run(rank_body)
    assert all(isinstance(e, RuntimeError) and "not reachable by load/store" in str(e) for e in raised), raised
    assert seen == [[1] * R] * R


def test_ranks_that_disagree_on_the_option_raise_together(tmp_path):
    memories = [FileNodeMemory(str(tmp_path)) for _ in range(R)]
    glues = [None] * R

    def rank_body(r, comm):
        ctx = _ctx(r, comm, nvlink=r != 1)
        glues[r], prov = _provider(ctx, memories[r])
        IbgdaWindow(ctx, 1 << 16, channels=1, depth=64, provider=prov)

    _, raised = _run(rank_body)
    for e in raised:
        assert isinstance(e, ValueError) and "allow_nvlink_for_low_latency_mode must be the same" in str(e), e
        assert "rank 0: True, rank 1: False" in str(e)
    assert all(g.live == [] for g in glues) and all(m.maps == {} for m in memories)


def test_a_window_that_one_rank_cannot_allocate(tmp_path):
    """Rank 2 runs out of memory making its window: it still takes part in the exchange, and every rank raises
    naming it (none waits for it), having released its own window and queues."""
    memories = [FileNodeMemory(str(tmp_path), fail_alloc=(r == 2)) for r in range(R)]
    glues = [None] * R

    def rank_body(r, comm):
        ctx = _ctx(r, comm)
        glues[r], prov = _provider(ctx, memories[r])
        IbgdaWindow(ctx, 1 << 16, channels=1, depth=64, provider=prov)

    _, raised = _run(rank_body)
    for e in raised:
        assert isinstance(e, RuntimeError) and "making the window of 65536 bytes (num_rdma_bytes)" in str(e), e
        assert "rank 2: RuntimeError: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY" in str(e)
    assert all(g.live == [] for g in glues) and all(m.maps == {} for m in memories)


@pytest.mark.parametrize("failing", [(2,), tuple(range(R))])
def test_a_provider_that_cannot_be_made(tmp_path, monkeypatch, failing):
    """The NIC cannot be opened on some ranks (a host's NIC down): they still take part in the exchange and every
    rank raises naming them; when no rank has one, each raises its own error, as the provider gave it."""
    from deepep_portable.transports.ibgda import window as ibgda_window

    def no_nic(ctx):
        raise ValueError("ibgda: no mlx5 device here (played)")
    monkeypatch.setattr(ibgda_window, "_make_provider", no_nic)
    memories = [FileNodeMemory(str(tmp_path)) for _ in range(R)]
    glues = [None] * R

    def rank_body(r, comm):
        ctx = _ctx(r, comm)
        prov = None
        if r not in failing:
            glues[r], prov = _provider(ctx, memories[r])
        IbgdaWindow(ctx, 1 << 16, channels=1, depth=64, provider=prov)

    _, raised = _run(rank_body)
    for e in raised:
        if len(failing) == R:
            assert isinstance(e, ValueError) and str(e) == "ibgda: no mlx5 device here (played)", e
        else:
            assert isinstance(e, RuntimeError) and "rank 2: ValueError: ibgda: no mlx5 device here" in str(e), e
    assert all(g is None or g.live == [] for g in glues) and all(m.maps == {} for m in memories)


def test_a_mapping_that_fails(tmp_path):
    """A node peer's window that cannot be mapped: with the option on (no queue to it) every rank raises with the
    reason; with it off, the low-latency window goes through the NIC and no rank offers its node by load/store, so
    the internode engine would refuse on every rank alike."""
    for nvlink in (True, False):
        memories = [FileNodeMemory(str(tmp_path), fail_open=(r == 2)) for r in range(R)]

        def rank_body(r, comm):
            ctx = _ctx(r, comm, nvlink)
            w = IbgdaWindow(ctx, 1 << 16, channels=1, depth=64, provider=_provider(ctx, memories[r])[1])
            out = (w.node_problem, [w.node_base(x) for x in range(R)], list(w.bases), w.base)
            w.close()
            return out

        res, raised = _run(rank_body)
        if nvlink:
            for e in raised:
                assert isinstance(e, RuntimeError) and "mapping the windows of a node's ranks failed" in str(e), e
                assert "rank 2 (node ranks 2..3)" in str(e) and "CUDA_ERROR_INVALID_VALUE" in str(e)
        else:
            assert raised == [None] * R, raised
            for r, (problem, node_base, bases, own) in enumerate(res):
                assert "rank 2" in problem and bases == [0] * R
                assert node_base == [own if x == r else 0 for x in range(R)]
        assert all(m.maps == {} for m in memories)


def test_capabilities_say_load_store_when_every_rank_is_mapped():
    from deepep_portable.transports.ibgda.transport import IbgdaTransport

    t = IbgdaTransport.__new__(IbgdaTransport)
    t.ctx = SimpleNamespace(options={"num_qps_per_rank": 2})
    t.ll_engine = SimpleNamespace(window=SimpleNamespace(base=1, bases=[5, 6]))
    caps = t.runtime_capabilities()
    assert caps.peer_load_store is True and caps.max_channels == 2
    t.ll_engine.window.bases = [5, 0]
    assert t.runtime_capabilities().peer_load_store is False
    t.ll_engine = None
    assert t.runtime_capabilities().peer_load_store is False
