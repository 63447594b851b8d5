"""The mlx5 DevX provider (deepep_portable/transports/ibgda/devx.py) on the CPU, against a fake of its C glue that
plays two NICs' firmware: it hands out handles and object numbers, records every DevX command, and checks that
everything is released in the right order. Two ranks' providers in one process: their windows, queues and
connections, then every field the provider sets in the PRM commands (decoded with prm.py's own layouts, which
tests/test_ibgda_prm.py checks against rdma-core), the send queue the GPU would post to, and the teardown.
Nothing here touches a NIC (none is lent): docs/IBGDA.md lists what a first real run must check."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from deepep_portable.transports.ibgda import prm, roce
from deepep_portable.transports.ibgda.devx import ALIGN, DevxProvider
from deepep_portable.transports.ibgda.devx_glue import DevxError
from deepep_portable.transports.ibgda.provider import PeerInfo

ETH, IB = 1, 0
CONSTANTS = {"IBV_LINK_LAYER_ETHERNET": ETH, "IBV_LINK_LAYER_INFINIBAND": IB, "IBV_ACCESS_LOCAL_WRITE": 1,
             "IBV_ACCESS_REMOTE_WRITE": 2, "IBV_ACCESS_REMOTE_READ": 4, "IBV_ACCESS_REMOTE_ATOMIC": 8,
             "IBV_ACCESS_RELAXED_ORDERING": 1 << 20}
GIDS = {0: "fe80:0000:0000:0000:0a00:00ff:fe00:0001", 3: "0000:0000:0000:0000:0000:ffff:0a00:{:04x}"}


def _caps(**over) -> bytes:
    out = bytearray(prm.QUERY_HCA_CAP_OUT)
    values = dict(log_max_qp_sz=15, log_max_cq_sz=22, log_max_ra_req_qp=9, log_max_ra_res_qp=4, cqe_version=1,
                  log_max_msg=30, num_ports=2, port_type=1)
    values.update(over)
    for name, v in values.items():
        prm._put(out, 128 + prm.CMD_HCA_CAP[name][0], prm.CMD_HCA_CAP[name][1], v, name)
    return bytes(out)


class FakeGlue:
    """devx_glue.DevxGlue's methods, over a fake firmware for rank `rank` (handles are ("kind", n) tuples)."""

    def __init__(self, rank: int, link_layer: int = ETH, caps: bytes = None, fail: str = "",
                 atomic_modes: dict = None) -> None:
        self.rank, self.link_layer, self.caps, self.fail = rank, link_layer, caps or _caps(), fail
        self.atomic_modes = atomic_modes or {}   # device -> (supported mode 1, mode); default (1, 1)
        self.live, self.calls, self.commands, self.n = [], [], [], 0x40 + 0x100 * rank
        self.names, self.uar_calls, self.owner = {}, 0, {}

    def _new(self, kind: str, ctx=None):
        self.n += 1
        h = (kind, self.n)
        self.live.append(h)
        self.owner[h] = ctx
        return h

    def _free(self, h, kind: str) -> None:
        assert h in self.live and h[0] == kind, (h, kind)
        self.live.remove(h)
        self.calls.append(("free", h))

    def constant(self, name):
        return CONSTANTS[name]

    def open(self, name):
        h = self._new("ctx")
        self.names[h] = name
        return h

    def close(self, ctx):
        assert not [h for h in self.live if self.owner.get(h) == ctx], f"context closed before {self.live}"
        self._free(ctx, "ctx")

    def general_cmd(self, ctx, cmd, outlen):
        self.commands.append(("general", cmd))
        if _get(cmd, prm.QUERY_HCA_CAP_IN, "op_mod") == prm.HCA_CAP_ATOMIC_CUR:
            out = bytearray(outlen)
            supported, mode = self.atomic_modes.get(self.names[ctx], (1, 1))
            prm._put(out, 128 + 0x46, 1, supported, "supported")
            prm._put(out, 128 + 0x40, 2, mode, "mode")
            return bytes(out)
        return self.caps[:outlen]

    def query_port(self, ctx, port):
        # (state, link_layer, active_mtu_bytes, lid, gid_tbl_len, max_qp_rd_atom), as DevxGlue.query_port
        return (4, self.link_layer, 4096 if port == 1 else 1024, 0x10 + self.rank, 16, 16)

    def query_gid(self, ctx, port, index):
        import ipaddress
        return ipaddress.IPv6Address(GIDS[index].format(self.rank + 1) if index == 3 else GIDS[index]).packed

    def alloc_pd(self, ctx):
        return self._new("pd", ctx), 0x900 + self.rank

    def dealloc_pd(self, pd):
        assert not [h for h in self.live if self.owner.get(h) == pd], f"PD freed before {self.live}"
        self._free(pd, "pd")

    def alloc_uar(self, ctx):   # two dedicated registers per page, as BlueFlame UARs can share one
        i, self.uar_calls = self.uar_calls, self.uar_calls + 1
        return self._new("uar", ctx), 0x70 + i // 2, 0x7F0000000000 + (i // 2) * 4096 + 0x800 + (i % 2) * 0x100

    def free_uar(self, uar):
        assert not [h for h in self.live if h[0] == "proxy"], "a UAR freed while the proxy may still ring it"
        self._free(uar, "uar")

    def cuda_map_io(self, host, size):
        if self.fail == "map_io":
            raise DevxError("cuda_map_io(size 4096)", 1, "cuMemHostRegister: CUDA_ERROR_NOT_PERMITTED")
        assert host % 4096 == 0 and size == 4096 and ("io", host) not in self.live, "a page mapped twice"
        self.live.append(("io", host))
        return 0x5000000000 + (host - 0x7F0000000000)

    def cuda_unmap_io(self, host):
        self._free(("io", host), "io")

    def query_eqn(self, ctx, vector):
        return 0x1234

    def cuda_dmabuf_fd(self, addr, size):
        if self.fail == "dmabuf":
            raise DevxError("cuda_dmabuf_fd", 95, "cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED")
        assert addr % ALIGN == 0 and size % ALIGN == 0
        return os.open(os.devnull, os.O_RDONLY)

    def reg_mr(self, pd, addr, length, fd, offset, access):
        self.calls.append(("reg_mr", addr, length, access, fd))
        return self._new("mr", pd), 0x1000 + self.rank, 0x2000 + self.rank

    def dereg_mr(self, mr):
        self._free(mr, "mr")

    def umem_reg(self, ctx, addr, size, fd, access):
        assert (addr == 0 if fd >= 0 else addr % ALIGN == 0 and addr > 0) and size % ALIGN == 0
        self.calls.append(("umem_reg", addr, fd))
        h = self._new("umem", ctx)
        return h, h[1]

    def umem_dereg(self, umem):
        self._free(umem, "umem")

    def obj_create(self, ctx, cmd, outlen):
        self.commands.append(("create", cmd))
        h = self._new("obj", ctx)
        out = bytearray(outlen)
        if self.fail == "create_qp" and _get(cmd, prm.CREATE_QP_IN, "opcode") == prm.CMD_CREATE_QP:
            prm._put(out, 0, 8, 3, "status")
            prm._put(out, 0x20, 32, 0xBAD, "syndrome")
        prm._put(out, *prm.CREATE_OBJ_OUT["obj"], h[1], "obj")
        return h, bytes(out)

    def obj_modify(self, obj, cmd, outlen):
        self.commands.append(("modify", cmd))
        return bytes(outlen)

    def obj_destroy(self, obj):
        self._free(obj, "obj")

    def proxy_start(self, mailboxes, registers):
        self.calls.append(("proxy_start", list(mailboxes), list(registers)))
        return self._new("proxy")

    def proxy_stop(self, proxy):
        self._free(proxy, "proxy")

    def resolve_rmac(self, pd, port, gid_index, dgid, hop_limit):
        return bytes([2, 0, 0, 0, 0, dgid[-1]])


def _get(buf: bytes, layout, *path) -> int:
    """A field of a PRM command by its path through prm.py's nested layouts."""
    bit = 0
    for name in path[:-1]:
        off, layout = layout[name]
        bit += off
    off, width = layout[path[-1]]
    return prm._get(buf, bit + off, width)


def _sysfs(port_states=("4: ACTIVE",), link_layer="Ethernet"):
    ports = [{"port": i + 1, "state": s, "link_layer": link_layer,
              "gids": [{"index": 0, "gid": GIDS[0], "type": "IB/RoCE v1"},
                       {"index": 3, "gid": GIDS[3].format(1), "type": "RoCE v2"}]}
             for i, s in enumerate(port_states)]
    return [{"name": "mlx5_0", "driver": "mlx5_core", "ports": ports}]


def _ctx(rank, **options):
    return SimpleNamespace(rank=rank, num_ranks=2, device=torch.device("cpu"),
                           options={"ibgda": roce.ibgda_options(options, environ={})})


def _pair(link_layer=ETH, ports=("4: ACTIVE",), channels=2, depth=64, **options):
    """Two ranks' providers, windows and queues, connected as ibgda/window.py would."""
    glues = [FakeGlue(r, link_layer) for r in range(2)]
    sysfs = _sysfs(ports, "Ethernet" if link_layer == ETH else "InfiniBand")
    provs = [DevxProvider(_ctx(r, **options), glue=glues[r], devices=sysfs) for r in range(2)]
    mems = [p.alloc_window(100_000) for p in provs]
    queues = [[[p.create_queue(peer, ch, depth) for ch in range(channels)] for peer in range(2)] for p in provs]
    for me, p in enumerate(provs):
        peers = [PeerInfo(r, mems[r].base, mems[r].rkey, mems[r].public, [q.qpn for q in queues[r][me]])
                 for r in range(2)]
        p.connect(mems[me], queues[me], peers)
    return glues, provs, mems, queues


def test_roce_pair_commands_and_send_queues():
    glues, provs, mems, queues = _pair(traffic_class=106, service_level=3, hop_limit=64)
    g0 = glues[0]
    creates = [c for kind, c in g0.commands if kind == "create"]
    modifies = [c for kind, c in g0.commands if kind == "modify"]
    assert len(creates) == 2 * 2 * 2 and len(modifies) == 3 * 2 * 2   # CQ + QP, 3 transitions, per (peer, ch)
    q = queues[0][1][1]                    # rank 0's queue to rank 1, channel 1
    cq_cmd, qp_cmd = creates[2 * 3], creates[2 * 3 + 1]
    assert _get(cq_cmd, prm.CREATE_CQ_IN, "opcode") == prm.CMD_CREATE_CQ
    cqc = ("cq_context",)
    assert _get(cq_cmd, prm.CREATE_CQ_IN, *cqc, "cc") == 1 and _get(cq_cmd, prm.CREATE_CQ_IN, *cqc, "oi") == 1
    assert _get(cq_cmd, prm.CREATE_CQ_IN, "cq_context", "log_cq_size") == 6            # depth 64
    assert _get(cq_cmd, prm.CREATE_CQ_IN, "cq_context", "c_eqn") == 0x1234
    assert _get(cq_cmd, prm.CREATE_CQ_IN, "cq_context", "uar_page") == 0x70 + 3 // 2   # the 4th queue's UAR
    umem_id = _get(cq_cmd, prm.CREATE_CQ_IN, "cq_umem_id")   # the fake numbers in order: UMEM, UAR, CQ, QP
    assert _get(qp_cmd, prm.CREATE_QP_IN, "wq_umem_id") == umem_id
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "dbr_umem_id") == umem_id
    cqn = umem_id + 2
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "cqn_snd") == cqn == _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "cqn_rcv")
    assert q.qpn == cqn + 1
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "pd") == 0x900
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "log_sq_size") == 6
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "rq_type") == prm.QPC_RQ_TYPE_ZERO_LEN
    assert _get(qp_cmd, prm.CREATE_QP_IN, "wq_umem_offset") == 0
    # The GPU's view of the queue: ring at the UMEM's start, CQ ring after it, the QP's send record (second
    # big-endian word) and the CQ's record on the page after; the doorbell inside the mapped UAR page.
    sq = q.sq
    ring = 64 * 64
    assert sq.ring % ALIGN == 0 and sq.cq == sq.ring + ring and sq.dbr == sq.ring + 2 * ring + 4
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "dbr_addr") == 2 * ring
    assert _get(cq_cmd, prm.CREATE_CQ_IN, "cq_umem_offset") == ring
    assert _get(cq_cmd, prm.CREATE_CQ_IN, "cq_context", "dbr_addr") == 2 * ring + 64
    assert _get(qp_cmd, prm.CREATE_QP_IN, "qpc", "uar_page") == 0x70 + 3 // 2
    assert sq.doorbell == 0x5000000000 + 4096 + 0x800 + 0x100 and sq.depth == 64 and sq.qpn == q.qpn
    doorbells = [h.sq.doorbell for row in queues[0] for h in row]
    assert len(set(doorbells)) == len(doorbells) == 4        # a register per queue: one warp rings several
    assert not provs[0].atomic_result_be                      # mode 1 supported and set: host order
    cq = q.private.memory.view(-1)
    start = sq.cq - q.private.memory.data_ptr()
    assert bool((cq[start:start + ring] == 0xFF).all()) and int(cq[start - ring:start].sum()) == 0
    # Connection: the peer's queue to me on the same channel, its GID, our GID index, the UDP port rule.
    rst, rtr, rts = modifies[3 * 3:3 * 3 + 3]
    assert _get(rst, prm.MODIFY_QP_IN, "opcode") == prm.CMD_RST2INIT_QP and _get(rst, prm.MODIFY_QP_IN, "qpn") == q.qpn
    assert (_get(rst, prm.MODIFY_QP_IN, "qpc", "rwe"), _get(rst, prm.MODIFY_QP_IN, "qpc", "rre"),
            _get(rst, prm.MODIFY_QP_IN, "qpc", "rae")) == (1, 1, 1)
    remote = queues[1][0][1].qpn
    ads = ("qpc", "primary_address_path")
    assert _get(rtr, prm.MODIFY_QP_IN, "qpc", "remote_qpn") == remote
    assert _get(rtr, prm.MODIFY_QP_IN, "qpc", "mtu") == prm.MTU[4096]
    assert _get(rtr, prm.MODIFY_QP_IN, *ads, "rgid_rip").to_bytes(16, "big")[-4:] == bytes([10, 0, 0, 2])
    assert _get(rtr, prm.MODIFY_QP_IN, *ads, "src_addr_index") == 3          # RoCE v2, IPv4-mapped
    assert _get(rtr, prm.MODIFY_QP_IN, *ads, "rmac") == int.from_bytes(bytes([2, 0, 0, 0, 0, 2]), "big")
    assert _get(rtr, prm.MODIFY_QP_IN, *ads, "udp_sport") == roce.udp_sport(q.qpn, remote, 1)
    assert (_get(rtr, prm.MODIFY_QP_IN, *ads, "tclass"), _get(rtr, prm.MODIFY_QP_IN, *ads, "dscp")) == (106, 26)
    assert (_get(rtr, prm.MODIFY_QP_IN, *ads, "hop_limit"), _get(rtr, prm.MODIFY_QP_IN, *ads, "eth_prio")) == (64, 3)
    assert _get(rtr, prm.MODIFY_QP_IN, "qpc", "log_rra_max") == 4
    assert _get(rts, prm.MODIFY_QP_IN, "qpc", "log_sra_max") == 7        # capped: a 3-bit field
    assert _get(rts, prm.MODIFY_QP_IN, "qpc", "retry_count") == 7 == _get(rts, prm.MODIFY_QP_IN, "qpc", "rnr_retry")
    # The window: one MR per NIC, remote write / read / atomic, never relaxed ordering; keys per channel.
    (reg,) = [c for c in g0.calls if c[0] == "reg_mr"]
    assert reg[1] == mems[0].base and reg[3] == 1 | 2 | 4 | 8 and reg[4] >= 0   # over dmabuf
    assert not [c for c in g0.calls if c[0] == "proxy_start"] and provs[0].doorbell_mode == "gpu"
    assert provs[0].endpoint_keys(mems[0], PeerInfo(1, mems[1].base, mems[1].rkey, mems[1].public, []), 1) == \
        (0x1000, 0x2001)
    for p, g in zip(provs, glues):
        p.close()
        assert g.live == [], g.live
        assert g.calls[-1] == ("free", ("ctx", 0x41 + 0x100 * g.rank))


def test_infiniband_path_and_two_ports():
    glues, provs, mems, queues = _pair(link_layer=IB, ports=("4: ACTIVE", "4: ACTIVE"), service_level=5)
    assert provs[0].rails == [("mlx5_0", 1), ("mlx5_0", 2)]
    modifies = [c for kind, c in glues[0].commands if kind == "modify"]
    for i, rtr in enumerate(modifies[1::3]):
        ch = i % 2
        ads = ("qpc", "primary_address_path")
        assert _get(rtr, prm.MODIFY_QP_IN, *ads, "rlid") == 0x10 + (i // 2)   # peer i // 2's LID
        assert _get(rtr, prm.MODIFY_QP_IN, *ads, "sl") == 5 and _get(rtr, prm.MODIFY_QP_IN, *ads, "rmac") == 0
        assert _get(rtr, prm.MODIFY_QP_IN, *ads, "vhca_port_num") == ch + 1     # channel c on port c % 2 + 1
        assert _get(rtr, prm.MODIFY_QP_IN, "qpc", "mtu") == prm.MTU[4096 if ch == 0 else 1024]
    assert "rail 1 (channels 1 mod 2): mlx5_0:2, InfiniBand LID 16, MTU 1024" in provs[0].describe()
    for p in provs:
        p.close()


def test_failures_release_what_was_made():
    bad = FakeGlue(0, caps=_caps(cqe_version=0))
    with pytest.raises(RuntimeError, match="CQE version 0"):
        DevxProvider(_ctx(0), glue=bad, devices=_sysfs())
    assert bad.live == []
    glue = FakeGlue(0, fail="create_qp")
    p = DevxProvider(_ctx(0), glue=glue, devices=_sysfs())
    p.alloc_window(4096)
    with pytest.raises(RuntimeError, match=r"CREATE_QP on mlx5_0.*syndrome 0x00000bad"):
        p.create_queue(1, 0, 64)
    p.close()
    assert glue.live == []
    with pytest.raises(ValueError, match="no ACTIVE mlx5 port"):
        DevxProvider(_ctx(0), glue=FakeGlue(0), devices=_sysfs(("1: DOWN",)))
    with pytest.raises(ValueError, match="exceeds"):
        DevxProvider(_ctx(0), glue=FakeGlue(0, caps=_caps(log_max_qp_sz=5)), devices=_sysfs()).create_queue(1, 0, 64)


def test_choose_rails_rules():
    devs = _sysfs(("4: ACTIVE", "1: DOWN")) + [{"name": "mlx5_1", "driver": "mlx5_core",
                                                "ports": [{"port": 1, "state": "4: ACTIVE"},
                                                          {"port": 2, "state": "4: ACTIVE"}]}]
    assert roce.choose_rails(devs) == [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_1", 2)]
    assert roce.choose_rails(devs, roce.ibgda_options({"multi_port": False}, environ={})) == \
        [("mlx5_0", 1), ("mlx5_1", 1)]
    assert roce.choose_rails(devs, roce.ibgda_options({"hca_list": "mlx5_1:2,mlx5_0"}, environ={})) == \
        [("mlx5_1", 2), ("mlx5_0", 1)]
    with pytest.raises(ValueError, match="not ACTIVE"):
        roce.choose_rails(devs, roce.ibgda_options({"hca_list": "mlx5_0:2"}, environ={}))
    with pytest.raises(ValueError, match="not an RDMA device"):
        roce.choose_rails(devs, roce.ibgda_options({"hca_list": "mlx5_9"}, environ={}))


def test_atomic_result_order_comes_from_each_nic():
    devs = _sysfs() + [dict(_sysfs()[0], name="mlx5_1")]
    for modes, be in (({}, False), ({"mlx5_0": (0, 0), "mlx5_1": (0, 0)}, True),
                      ({"mlx5_0": (1, 0), "mlx5_1": (1, 0)}, True)):
        p = DevxProvider(_ctx(0), glue=FakeGlue(0, atomic_modes=modes), devices=devs)
        assert p.atomic_result_be is be and p.rails == [("mlx5_0", 1), ("mlx5_1", 1)]
        p.close()
    glue = FakeGlue(0, atomic_modes={"mlx5_1": (0, 0)})
    with pytest.raises(RuntimeError, match="mlx5_1 returns 8-byte atomic results big-endian, mlx5_0 the other way"):
        DevxProvider(_ctx(0), glue=glue, devices=devs)
    assert glue.live == []


def test_close_releases_everything_even_after_a_failure():
    glue = FakeGlue(0)
    p = DevxProvider(_ctx(0), glue=glue, devices=_sysfs())
    p.alloc_window(4096)
    p.create_queue(1, 0, 64)
    fails = {"n": 0}
    real = glue.umem_dereg

    def failing(h):
        fails["n"] += 1
        real(h)
        raise RuntimeError("umem busy")

    glue.umem_dereg = failing
    with pytest.raises(RuntimeError, match="umem busy"):
        p.close()
    assert fails["n"] == 1 and glue.live == []
    p.close()   # nothing left: no second release


def test_cpu_doorbell_where_the_gpu_cannot_map_the_uar():
    """doorbell='auto': the driver refusing the GPU mapping makes every queue's doorbell a mailbox in host memory
    that a host thread forwards to its own register; 'gpu' refuses with the way out; 'cpu' never asks."""
    glues, provs, mems, queues = _pair(channels=2)
    for p in provs:
        p.close()
    glue = FakeGlue(0, fail="map_io")
    p = DevxProvider(_ctx(0), glue=glue, devices=_sysfs())
    mem = p.alloc_window(4096)
    qs = [[p.create_queue(peer, ch, 64) for ch in range(2)] for peer in range(2)]
    peers = [PeerInfo(r, mem.base, mem.rkey, mem.public, [q.qpn for q in qs[r]]) for r in range(2)]
    p.connect(mem, qs, peers)
    (start,) = [c for c in glue.calls if c[0] == "proxy_start"]
    doorbells = [h.sq.doorbell for row in qs for h in row]
    assert start[1] == doorbells and len(set(doorbells)) == 4                   # the GPU stores to the mailboxes
    assert start[2] == [0x7F0000000000 + (i // 2) * 4096 + 0x800 + (i % 2) * 0x100 for i in range(4)]
    assert p.doorbell_mode == "cpu" and "a host thread rings it" in p.describe()[-2]
    assert "CUDA_ERROR_NOT_PERMITTED" in p.describe()[-2]
    p.close()
    assert glue.live == []
    with pytest.raises(RuntimeError, match="cannot map mlx5_0's doorbell.*'doorbell': 'auto'"):
        bad = DevxProvider(_ctx(0, doorbell="gpu"), glue=FakeGlue(0, fail="map_io"), devices=_sysfs())
        bad.alloc_window(4096)
        bad.create_queue(0, 0, 64)
    glue = FakeGlue(0)
    p = DevxProvider(_ctx(0, doorbell="cpu"), glue=glue, devices=_sysfs())
    p.alloc_window(4096)
    p.create_queue(0, 0, 64)
    assert p.doorbell_mode == "cpu" and not [h for h in glue.live if h[0] == "io"]
    p.close()


def test_peermem_registration_where_dmabuf_is_refused():
    glue = FakeGlue(0, fail="dmabuf")
    p = DevxProvider(_ctx(0), glue=glue, devices=_sysfs())
    mem = p.alloc_window(4096)
    q = p.create_queue(1, 0, 64)
    (reg,) = [c for c in glue.calls if c[0] == "reg_mr"]
    (umem,) = [c for c in glue.calls if c[0] == "umem_reg"]
    assert reg[1] == mem.base and reg[4] == -1 and umem == ("umem_reg", q.sq.ring, -1)
    assert p.registration == "peermem" and "CUDA_ERROR_NOT_SUPPORTED" in p.describe()[-1]
    p.close()
    assert glue.live == []


def test_buffer_capabilities_carry_the_providers_choices():
    from deepep_portable.transports.ibgda.transport import IbgdaTransport

    glues, provs, mems, queues = _pair(channels=1)
    t = IbgdaTransport.__new__(IbgdaTransport)
    t.normal_engine, t.ll_engine = None, SimpleNamespace(window=SimpleNamespace(provider=provs[0]))
    notes = t.runtime_notes()
    assert notes["nic_provider"] == "mlx5-devx" and notes["nic"][0].startswith("rail 0 (channels 0 mod 1): mlx5_0:1")
    assert notes["nic"][-2:] == ["doorbell: the GPU rings the UAR", "GPU memory registered over dmabuf"]
    t.ll_engine = None
    assert t.runtime_notes() == {}
    for p in provs:
        p.close()
