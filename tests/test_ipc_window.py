"""IpcWindow's collective setup on the CPU, with a fake driver module and fake peers: handles are
exchanged, every peer but itself is opened, mixed hosts or sizes are refused (freeing the window),
grids are capped for ranks that share a GPU, and close() unmaps and frees."""
import ctypes

import pytest
import torch

from deepep_portable.windows import base as window_base
from deepep_portable.windows import ipc
from deepep_portable.topology import node_identity
from deepep_portable.contract import BufferContext


class FakeDriver:
    def __init__(self):
        self.allocs, self.freed, self.opened, self.closed, self._host = {}, [], [], [], []

    def mem_alloc(self, dev, n):
        ptr = 0x1000_0000 + 0x100_0000 * len(self.allocs)
        self.allocs[ptr] = n
        return ptr

    def memset_d8_async(self, dev, ptr, value, n, stream):
        assert ptr in self.allocs and n <= self.allocs[ptr]

    def stream_synchronize(self, dev, stream):
        pass

    def ipc_get_mem_handle(self, dev, ptr):
        return b"H" + ptr.to_bytes(8, "little") + bytes(55)

    def ipc_open_mem_handle(self, dev, handle):
        base = 0x9000_0000 + int.from_bytes(handle[1:9], "little")
        self.opened.append(base)
        return base

    def ipc_close_mem_handle(self, dev, base):
        self.closed.append(base)

    def mem_free(self, dev, ptr):
        self.freed.append(ptr)

    def host_alloc_mapped(self, dev, n):
        buf = (ctypes.c_char * n)()
        self._host.append(buf)
        addr = ctypes.addressof(buf)
        return addr, addr

    def host_free(self, dev, ptr):
        pass


class FakeComm:
    """`peers`: what each peer sends in the window's first exchange (a dict); `peer_problems`: what each sends in
    a later agreement (None: all went well there)."""

    def __init__(self, rank, peers, peer_problems=None):
        self.rank, self.peers, self.barriers = rank, peers, 0
        self.peer_problems = peer_problems or [None] * len(peers)

    def allgather_object(self, me):
        out = list(self.peers if isinstance(me, dict) else self.peer_problems)
        out[self.rank] = me
        return out

    def barrier(self):
        self.barriers += 1


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    import deepep_portable

    monkeypatch.setattr(deepep_portable, "_C", drv, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "deepep_portable._C", drv)
    monkeypatch.setattr(ipc, "device_uuid", lambda dev: "GPU-A")
    monkeypatch.setattr(ipc, "_synchronize", lambda dev: None)
    monkeypatch.setattr(window_base, "sm_count", lambda dev: 132)
    return drv


def peer(host, nbytes, uuid, ptr):
    return dict(host=host, pid=1, nonce="n", nbytes=nbytes, shareable=False, uuid=uuid,
                handle=b"H" + ptr.to_bytes(8, "little") + bytes(55))


def ctx_for(comm, rank, ranks):
    return BufferContext(comm=comm, rank=rank, num_ranks=ranks, device=torch.device("cpu", 0), num_nvl_bytes=0,
                         num_rdma_bytes=0, low_latency_mode=False, uid=1, timeout_s=5.0)


def test_maps_every_peer_but_itself_and_caps_the_grid(fake):
    host = node_identity()
    peers = [peer(host, 4096, "GPU-A", 0x2000), None, peer(host, 4096, "GPU-B", 0x3000), peer(host, 4096, "GPU-A", 0x4000)]
    comm = FakeComm(1, peers)
    w = ipc.IpcWindow(ctx_for(comm, 1, 4), 4096, 256, "num_nvl_bytes")
    assert w.bases[1] == w.base and len(w._opened) == 3
    assert w.bases[0] == 0x9000_0000 + 0x2000 and w.bases[3] == 0x9000_0000 + 0x4000
    assert w.peer_bases.tolist() == w.bases
    assert w.max_blocks == 132 // 3 and w.grid(64) == 44 and w.grid(8) == 8 and w.grid(0) == 1
    assert w.recorded_error() is None and comm.barriers == 0   # the last agreement was the barrier
    w.errors.words[0], w.errors.words[3] = 1, 2
    assert w.recorded_error()[0] == 1 and w.recorded_error()[3] == 2
    base, opened = w.base, list(w._opened)
    assert id(w) in window_base._live_windows[0]   # counted among the open windows (Window.grid) ...
    w.close()
    assert sorted(fake.closed) == sorted(opened) and fake.freed == [base] and comm.barriers == 1
    assert id(w) not in window_base._live_windows.get(0, {})   # ... until closed, not until collected
    w.close()   # idempotent
    assert fake.freed == [base]


@pytest.mark.parametrize("bad,match", [("host", "one node"), ("size", "same num_nvl_bytes")])
def test_refuses_mixed_groups_and_frees_its_window(fake, bad, match):
    host = node_identity()
    other = peer("elsewhere" if bad == "host" else host, 4096 if bad == "host" else 8192, "GPU-B", 0x2000)
    comm = FakeComm(0, [None, other])
    with pytest.raises((RuntimeError, ValueError), match=match):
        ipc.IpcWindow(ctx_for(comm, 0, 2), 4096, 256, "num_nvl_bytes")
    assert len(fake.freed) == 1 and not fake.opened


@pytest.mark.parametrize("failing", ["me", "my handle", "peer"])
def test_a_failed_allocation_is_told_to_every_rank(fake, monkeypatch, failing):
    """A rank whose allocation fails (out of memory) still takes part in the first exchange and says why; every
    rank then raises naming it, and frees what it allocated (no rank waits in an exchange the other left)."""
    host = node_identity()
    other = peer(host, 4096, "GPU-A", 0x2000)
    if failing == "me":
        def no_memory(dev, n):
            raise RuntimeError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")
        monkeypatch.setattr(fake, "mem_alloc", no_memory)
    elif failing == "my handle":   # allocated, then a later step fails: the allocation is freed
        def no_handle(dev, ptr):
            raise RuntimeError("cuIpcGetMemHandle failed: CUDA_ERROR_OUT_OF_MEMORY (played)")
        monkeypatch.setattr(fake, "ipc_get_mem_handle", no_handle)
    else:
        other = dict(other, handle=None, problem="rank 1: RuntimeError: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY")
    comm = FakeComm(0, [None, other])
    sent = []
    gather = comm.allgather_object
    comm.allgather_object = lambda me: sent.append(me) or gather(me)
    with pytest.raises(RuntimeError, match=r"rank [01]: RuntimeError: cu\w+ failed: CUDA_ERROR_OUT_OF_MEMORY") as info:
        ipc.IpcWindow(ctx_for(comm, 0, 2), 4096, 256, "num_nvl_bytes")
    assert "num_nvl_bytes" in str(info.value) and len(sent) == 1
    assert (sent[0]["problem"] is not None) == (failing != "peer")
    assert fake.freed == ([] if failing == "me" else list(fake.allocs)) and not fake.opened


@pytest.mark.parametrize("failing", ["me", "peer"])
def test_a_peer_handle_that_will_not_open_is_told_to_every_rank(fake, monkeypatch, failing):
    """Legacy CUDA IPC: opening a peer's handle fails on one rank after the first exchange. Every rank takes part
    in the window's last agreement (its barrier), closes what it opened, frees its window and raises naming that
    rank, instead of the others waiting at the barrier for a rank that left."""
    host = node_identity()
    peers = [None, peer(host, 4096, "GPU-A", 0x2000), peer(host, 4096, "GPU-A", 0x3000)]
    problems = [None, None, None]
    if failing == "me":
        opened = fake.ipc_open_mem_handle

        def refuse_the_last(dev, handle):
            if handle == peers[2]["handle"]:
                raise RuntimeError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (played)")
            return opened(dev, handle)
        monkeypatch.setattr(fake, "ipc_open_mem_handle", refuse_the_last)
    else:
        problems[2] = "rank 2: RuntimeError: cuIpcOpenMemHandle failed: CUDA_ERROR_MAP_FAILED (played)"
    comm = FakeComm(0, peers, problems)
    sent = []
    gather = comm.allgather_object
    comm.allgather_object = lambda me: sent.append(me) or gather(me)
    open_before = set(window_base._live_windows.get(0, {}))
    with pytest.raises(RuntimeError, match=r"mapping the peers' windows failed: rank [02]: RuntimeError: "
                                           r"cuIpcOpenMemHandle failed") as info:
        ipc.IpcWindow(ctx_for(comm, 0, 3), 4096, 256, "num_nvl_bytes")
    assert set(window_base._live_windows.get(0, {})) == open_before   # the failed window counts for no Buffer
    assert ("rank 0:" in str(info.value)) == (failing == "me") and len(sent) == 2
    assert (sent[1] is not None) == (failing == "me")
    assert sorted(fake.closed) == sorted(fake.opened) and len(fake.opened) == (1 if failing == "me" else 2)
    assert fake.freed == list(fake.allocs) and comm.barriers == 0


class _ThreadComm:
    """Ranks as threads (each registers its rank): allgather_object over a shared list and a barrier."""

    def __init__(self, size: int) -> None:
        import threading

        self._barrier = threading.Barrier(size, timeout=20)
        self._slots: list = [None] * size
        self.rank_of: dict = {}

    def allgather_object(self, obj):
        import threading

        self._slots[self.rank_of[threading.get_ident()]] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out


@pytest.mark.parametrize("size", [1, 2, 5])
def test_exchange_fds_gives_every_rank_every_peers_descriptor(size):
    """Each rank's descriptor (a memfd holding its rank) reaches every peer over the Unix sockets."""
    import os

    results, errors = _exchange_as_threads(size, f"test.{os.getpid()}.{size}")
    assert not errors, errors
    for rank, got in enumerate(results):
        assert got == [None if r == rank else f"rank {r}" for r in range(size)]


def _exchange_as_threads(size: int, tag: str, delay_rank: int = -1, extra=()):
    """Run exchange_fds on `size` thread ranks, each offering a memfd that holds "rank N"; returns
    (what each rank read from the descriptors it received, errors). `delay_rank` starts 0.3 s late;
    `extra`: more threads to run beside them."""
    import os
    import threading

    comm, results, errors = _ThreadComm(size), [None] * size, []

    def rank_main(rank: int) -> None:
        comm.rank_of[threading.get_ident()] = rank
        fd = os.memfd_create(f"rank{rank}")
        try:
            os.write(fd, f"rank {rank}".encode())
            if rank == delay_rank:
                threading.Event().wait(0.3)
            got = ipc.exchange_fds(comm, rank, size, fd, tag, timeout_s=20.0)
            results[rank] = [None if g is None else os.pread(g, 16, 0).decode() for g in got]
            for g in got:
                if g is not None:
                    os.close(g)
        except Exception as e:   # noqa: BLE001 - asserted by the caller
            errors.append(f"rank {rank}: {e!r}")
        finally:
            os.close(fd)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    threads += [threading.Thread(target=f) for f in extra]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_exchange_fds_times_out_when_a_peer_never_answers():
    """Rank 1 listens but never accepts nor connects: rank 0 raises within the timeout, it does not hang."""
    import os
    import socket
    import time

    tag = f"silent.{os.getpid()}"

    class Pair:
        def allgather_object(self, obj):
            return [obj, None]

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(f"\0deepep_portable.fds.{tag}.1")
    silent.listen(4)
    fd = os.memfd_create("alone")
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError):   # socket.timeout (TimeoutError) in rank 0's accept
            ipc.exchange_fds(Pair(), 0, 2, fd, tag, timeout_s=1.0)
    finally:
        os.close(fd)
        silent.close()
    assert 0.5 < time.monotonic() - t0 < 10


def test_exchange_fds_answers_only_clients_that_know_the_tag():
    """A stranger that connects with the wrong tag gets no descriptor, and rank 0 still serves its peer."""
    import os
    import socket
    import threading

    tag = f"guard.{os.getpid()}"
    strangers: list = []

    def stranger() -> None:   # connects to rank 0 before rank 1 does, with a wrong tag
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        for _ in range(200):
            try:
                c.connect(f"\0deepep_portable.fds.{tag}.0")
                break
            except OSError:
                threading.Event().wait(0.01)
        c.sendall(b"wrong:1\n")
        _, fds, _, _ = socket.recv_fds(c, 1, 1)
        strangers.append(fds)
        c.close()

    results, errors = _exchange_as_threads(2, tag, delay_rank=1, extra=(stranger,))
    assert not errors, errors
    assert results == [[None, "rank 1"], ["rank 0", None]]
    assert strangers == [[]]


def test_the_intranode_buffer_is_vmm_memory_unless_switched_off(monkeypatch):
    """The intranode engine's window kind: shareable VMM memory by default (measured faster on the H200),
    legacy CUDA IPC with DEEPEP_PORTABLE_INTRANODE_VMM=0."""
    from deepep_portable.engines import intranode

    monkeypatch.delenv(intranode.VMM_SWITCH, raising=False)
    assert intranode.vmm_buffer_wanted()
    monkeypatch.setenv(intranode.VMM_SWITCH, "0")
    assert not intranode.vmm_buffer_wanted()
    monkeypatch.setenv(intranode.VMM_SWITCH, "1")
    assert intranode.vmm_buffer_wanted()


def test_a_failed_descriptor_share_names_the_windows_legacy_switch(fake, monkeypatch):
    """Sharing VMM memory fails on a peer: every rank frees its window and the error names the switch of
    the engine that asked (the intranode engine's, not the low-latency one's)."""
    def vmm_alloc_shareable(dev, n):
        fake.allocs[0x5000_0000] = n
        return 0x5000_0000, n, -1

    monkeypatch.setattr(fake, "vmm_alloc_shareable", vmm_alloc_shareable, raising=False)
    monkeypatch.setattr(fake, "vmm_free", lambda dev, ptr, n: fake.freed.append(ptr), raising=False)
    monkeypatch.setattr(ipc, "exchange_fds", lambda *a, **k: (_ for _ in ()).throw(OSError("no sockets here")))

    class Comm(FakeComm):
        def allgather_object(self, me):
            if isinstance(me, dict):
                return [me, dict(me, pid=2)]
            return [me, None]

    with pytest.raises(RuntimeError, match="DEEPEP_PORTABLE_INTRANODE_VMM=0 on every rank"):
        ipc.IpcWindow(ctx_for(Comm(0, []), 0, 2), 4096, 256, "num_nvl_bytes", shareable=True,
                      legacy_switch="DEEPEP_PORTABLE_INTRANODE_VMM")
    assert fake.freed == [0x5000_0000]


def test_ranks_that_disagree_on_the_memory_kind_are_told_the_windows_switch(fake):
    """One peer made its window legacy IPC memory while this rank asked for VMM: refused (window freed), and the
    error names the switch of the engine that made the window."""
    def vmm_alloc_shareable(dev, n):
        fake.allocs[0x6000_0000] = n
        return 0x6000_0000, n, -1

    fake.vmm_alloc_shareable = vmm_alloc_shareable
    fake.vmm_free = lambda dev, ptr, n: fake.freed.append(ptr)
    other = dict(peer(node_identity(), 4096, "GPU-A", 0x2000), shareable=False)
    with pytest.raises(ValueError, match="DEEPEP_PORTABLE_INTRANODE_VMM must be the same on every rank"):
        ipc.IpcWindow(ctx_for(FakeComm(0, [None, other]), 0, 2), 4096, 256, "num_nvl_bytes", shareable=True,
                      legacy_switch="DEEPEP_PORTABLE_INTRANODE_VMM")
    assert fake.freed == [0x6000_0000]


@pytest.mark.parametrize("switch,shareable", [(None, True), ("0", False), ("1", True)])
def test_the_intranode_engine_asks_for_the_memory_kind_its_switch_says(monkeypatch, switch, shareable):
    """IntranodeEngine makes its buffer with shareable=<the switch> and names its own switch for the errors."""
    from deepep_portable.engines import intranode

    class Made(Exception):
        pass

    seen = {}

    def fake_window(ctx, nbytes, zero_bytes, size_name, shareable=False, legacy_switch=None):
        seen.update(nbytes=nbytes, shareable=shareable, legacy_switch=legacy_switch)
        raise Made()

    if switch is None:
        monkeypatch.delenv(intranode.VMM_SWITCH, raising=False)
    else:
        monkeypatch.setenv(intranode.VMM_SWITCH, switch)
    monkeypatch.setattr(intranode, "IpcWindow", fake_window)
    ctx = BufferContext(comm=None, rank=0, num_ranks=2, device=torch.device("cuda", 0), num_nvl_bytes=1 << 20,
                        num_rdma_bytes=0, low_latency_mode=False, uid=1, timeout_s=5.0)
    with pytest.raises(Made):
        intranode.IntranodeEngine(ctx)
    assert seen == dict(nbytes=1 << 20, shareable=shareable, legacy_switch="DEEPEP_PORTABLE_INTRANODE_VMM")
