"""The mlx5 DevX provider: the NIC resources of an ibgda window on a real NIC (provider.py's interface).

Per process (one Buffer window), following the recipe every GPU-initiated RDMA library uses
(../shared/research/IBGDA.md §1.1; docs/IBGDA.md "Host set-up"):

  * rails: the (device, port) pairs the channels use (roce.choose_rails: hca_list, else the closest mlx5 NICs
    by PCIe distance; every ACTIVE port unless multi_port is off); channel c uses rail c % rails;
  * per device: a DevX context, a PD (its pdn), the completion EQ number, the general HCA caps (CQE version 1,
    queue size, outstanding RDMA READ / atomic depth), the atomic caps (8-byte results in host order or
    big-endian: device.cuh's atomic_result_be), and the window registered as an MR over dmabuf;
  * per (peer, channel) queue: a UAR of its own (dedicated NC, else BlueFlame: never the context's shared NC
    register, since one warp instruction may ring several queues and needs one register per queue) whose page
    is mapped into the GPU (cuMemHostRegister with IOMEMORY); one GPU allocation [send ring | CQ ring |
    doorbell records], registered as one DevX UMEM over dmabuf (4 KiB pages); a collapsed CQ (the NIC writes
    entry 0 only, overrun ignored) filled with 0xff; an RC QP (SQ at the UMEM's start, zero-length RQ:
    nothing is ever received) on that CQ;
  * connect: RST2INIT (remote write / read / atomic allowed, 8-byte extended atomics), INIT2RTR (the peer's
    QPN for this channel, the path MTU both ends can do, an IB LID path or a RoCE GRH path with our GID
    choice, the next hop's MAC, DSCP / ECN from traffic_class, priority sl & 7, a UDP source port per QP),
    RTR2RTS (retry 7, RNR retry 7, ack timeout 20).

The GPU then posts with sq.cuh: `ring`, `dbr` (the QP's send doorbell record: its second big-endian word),
`doorbell` (the UAR register as the GPU sees it), `cq` (entry 0 of the collapsed CQ); the posters' own words
live in a separate GPU tensor. The window MR is registered without relaxed ordering (device.cuh's ordering
argument).

Node peers: on a GPU the window is node-shared memory (node_memory.CudaIpcMemory: cuMemAlloc, its CUDA IPC handle
in the public half), so `peer_load_store_base` maps the window of every other rank of my node (`maps_node_peers`):
the internode kernels reach the node over NVLink, and the window makes no queue to the node's ranks where the
low-latency kernels use the mapping too (window.py). Without a GPU (the tests' fake glue) there is no mapping
unless the caller passes a stand-in `node_memory`.

What talks to libibverbs / libmlx5 / libcuda is devx_glue.DevxGlue (C glue compiled against the system
headers); the PRM command layouts are prm.py. Tests drive this class with a fake glue (CPU): the sequence of
commands and every field it sets. **Never run on a real NIC** (none is lent): docs/IBGDA.md lists what a
first run must check.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...layout import align_up
from ...topology import node_identity
from . import prm, roce
from .abi import SendQueueParams
from .devx_glue import DevxError
from .provider import NicProvider, PeerInfo, QueueHandle, WindowMemory

ALIGN = 1 << 16        # GPU regions start 64 KiB aligned (dmabuf export and UMEM pages)
PAGE = 4096
QP_DBR, CQ_DBR = 0, 64   # offsets of the QP's and the CQ's doorbell records in a queue's record page


def _log2(n: int) -> int:
    return n.bit_length() - 1


@dataclass
class _Device:
    """One NIC's DevX objects (shared by the queues and the window of its rails)."""

    name: str
    ctx: Any
    pd: Any
    pdn: int
    eqn: int
    caps: prm.GeneralCaps
    ports: Dict[int, dict] = field(default_factory=dict)   # port -> query_port fields + gid choice
    mr: Any = None
    lkey: int = 0
    rkey: int = 0


@dataclass
class _Queue:
    """One RC queue's objects, in the order they are released (reversed)."""

    device: _Device
    port: int
    channel: int
    memory: torch.Tensor
    words: torch.Tensor
    umem: Any
    cq: Any
    qp: Any
    qpn: int


class DevxProvider(NicProvider):
    """provider.py's interface over mlx5 DevX (module docstring). `glue`: devx_glue.DevxGlue or a test fake;
    `devices`: rdma.rdma_devices_sysfs records (default: this machine's); `gpu_device_dir`: the GPU's sysfs
    PCI directory (default: from the CUDA driver), for choosing the closest NICs; `node_memory`: how the window is
    shared with the node's ranks (node_memory.py; default CUDA IPC on a GPU, none on the CPU)."""

    name = "mlx5-devx"
    atomic_result_be = True   # set from every NIC's atomic caps (they must agree): device.cuh reads it

    def __init__(self, ctx, glue=None, devices: Optional[List[dict]] = None,
                 gpu_device_dir: Optional[str] = None, node_memory: Any = None) -> None:
        from .. import rdma

        if glue is None:
            from . import devx_glue
            glue = devx_glue.load()
        self.glue, self.ctx = glue, ctx
        self.options: roce.IbgdaOptions = ctx.options.get("ibgda") or roce.ibgda_options()
        devices = rdma.rdma_devices_sysfs() if devices is None else devices
        if gpu_device_dir is None and ctx.device.type == "cuda":
            gpu_device_dir = _gpu_sysfs_dir(ctx.device)
        self.rails = roce.choose_rails(devices, self.options, gpu_device_dir)   # channel c: rails[c % len]
        self.records = {d["name"]: d for d in devices}
        self.devices: Dict[str, _Device] = {}
        self.queues: List[_Queue] = []
        self.uars: List[Any] = []
        self.uar_pages: Dict[int, int] = {}   # host page -> its GPU address (mapped once)
        # Who rings the doorbells ("gpu", or "cpu": a host thread forwards mailboxes, doorbell_proxy.cc) and how
        # GPU memory is registered ("dmabuf", or "peermem": by virtual address): decided at the first need.
        self.doorbell_mode = "cpu" if self.options.doorbell == "cpu" else "gpu"
        self.doorbell_why = "ibgda option doorbell='cpu'" if self.doorbell_mode == "cpu" else ""
        self.registration, self.registration_why = "dmabuf", ""
        self.mailboxes: List[torch.Tensor] = []
        self.proxied: List[Tuple[int, int]] = []   # (mailbox host address, UAR register host address)
        self.proxy = None
        self.window: Optional[torch.Tensor] = None
        self._constants: Dict[str, int] = {}
        # Node-shared window memory (node_memory.py's interface): CUDA IPC on a GPU; tests pass a stand-in.
        if node_memory is None and ctx.device.type == "cuda":
            from .node_memory import CudaIpcMemory

            node_memory = CudaIpcMemory(ctx.device.index if ctx.device.index is not None else
                                        torch.cuda.current_device())
        self.node_memory = node_memory
        self.maps_node_peers = node_memory is not None
        self.shared_base = 0                  # my window when it is node-shared memory (freed last)
        self.opened: Dict[int, int] = {}      # peer rank -> where its window is mapped here
        try:
            for name, port in self.rails:
                self._port(self._device(name), port)
        except BaseException:
            self.close()
            raise

    # ---- per device / port -------------------------------------------------------------------------
    def _const(self, name: str) -> int:
        if name not in self._constants:
            self._constants[name] = self.glue.constant(name)
        return self._constants[name]

    def _device(self, name: str) -> _Device:
        if name in self.devices:
            return self.devices[name]
        g = self.glue
        ctx = g.open(name)
        dev = _Device(name, ctx, None, 0, 0, prm.GeneralCaps(0, 0, 0, 0, 0, 0))
        self.devices[name] = dev   # released by close() from here on, whatever fails next
        dev.caps = prm.general_caps(g.general_cmd(ctx, prm.query_hca_cap_in(1), prm.QUERY_HCA_CAP_OUT))
        if dev.caps.cqe_version != 1:
            raise RuntimeError(f"ibgda: {name} reports CQE version {dev.caps.cqe_version}; the GPU reads version-1 "
                               "CQEs (a firmware or driver too old for DevX queues)")
        # 8-byte atomic results: host order where the driver switched the HCA to it (mode 1), else big-endian.
        be = prm.atomic_results_big_endian(g.general_cmd(ctx, prm.query_hca_cap_in(prm.HCA_CAP_ATOMIC_CUR),
                                                         prm.QUERY_HCA_CAP_OUT))
        if len(self.devices) > 1 and be != self.atomic_result_be:
            raise RuntimeError(f"ibgda: {name} returns 8-byte atomic results {'big-endian' if be else 'in host order'}"
                               f", {', '.join(n for n in self.devices if n != name)} the other way: use NICs that "
                               "agree (hca_list)")
        self.atomic_result_be = be
        dev.pd, dev.pdn = g.alloc_pd(ctx)
        dev.eqn = g.query_eqn(ctx, 0)
        return dev

    def _doorbell(self, dev: _Device) -> Tuple[Any, int, int]:
        """A UAR of one queue's own (the GPU rings several queues from one warp instruction: each needs its own
        register) and its register as the GPU addresses it: (uar, page id, GPU address). Its page is mapped into
        the GPU once (dedicated registers may share a page)."""
        g = self.glue
        uar, page_id, reg_addr = g.alloc_uar(dev.ctx)
        self.uars.append(uar)   # released by close() from here on
        page = reg_addr & ~(PAGE - 1)   # the register sits inside a page: map the page
        if self.doorbell_mode == "gpu":
            try:
                if page not in self.uar_pages:
                    self.uar_pages[page] = g.cuda_map_io(page, PAGE)
                return uar, page_id, self.uar_pages[page] + (reg_addr - page)
            except DevxError as e:
                if self.options.doorbell == "gpu":
                    raise RuntimeError(f"ibgda: the GPU cannot map {dev.name}'s doorbell ({e}); pass "
                                       "ibgda_options={'doorbell': 'auto'} to let a host thread ring it") from e
                self.doorbell_mode, self.doorbell_why = "cpu", f"the driver refused the GPU mapping: {e}"
        # A mailbox word in pinned host memory (the GPU reaches it by its host address: UVA) that the proxy thread
        # started by connect() forwards to the register.
        mailbox = torch.zeros(1, dtype=torch.int64, pin_memory=self.ctx.device.type == "cuda")
        self.mailboxes.append(mailbox)
        self.proxied.append((mailbox.data_ptr(), reg_addr))
        return uar, page_id, mailbox.data_ptr()

    def _dmabuf(self, addr: int, size: int) -> int:
        """A dmabuf fd of GPU memory [addr, addr + size), or -1 once the driver has refused one: registrations then
        go by virtual address (needs nvidia-peermem)."""
        if self.registration == "dmabuf":
            try:
                return self.glue.cuda_dmabuf_fd(addr, size)
            except DevxError as e:
                self.registration, self.registration_why = "peermem", f"dmabuf export refused: {e}"
        return -1

    def _port(self, dev: _Device, port: int) -> dict:
        if port in dev.ports:
            return dev.ports[port]
        state, link_layer, mtu, lid, _, _ = self.glue.query_port(dev.ctx, port)
        roce_port = link_layer == self._const("IBV_LINK_LAYER_ETHERNET")
        record = next((p for p in self.records.get(dev.name, {}).get("ports", []) if int(p["port"]) == port), None)
        if record is None:
            raise RuntimeError(f"ibgda: {dev.name} port {port} is not in sysfs")
        record = dict(record, link_layer="Ethernet" if roce_port else "InfiniBand")
        gid_index, gid, why = roce.pick_gid(record, self.options)
        dev.ports[port] = dict(roce=roce_port, mtu=mtu, lid=lid, gid_index=gid_index,
                               gid=self.glue.query_gid(dev.ctx, port, gid_index), why=why)
        return dev.ports[port]

    # ---- NicProvider --------------------------------------------------------------------------------
    def alloc_window(self, nbytes: int) -> WindowMemory:
        nbytes = align_up(nbytes, ALIGN)
        share = None
        if self.node_memory is not None:   # zeroed, ALIGN-aligned, and mappable by the node's ranks
            base, share = self.node_memory.alloc(nbytes, ALIGN)
            self.shared_base = base
        else:
            self.window, base = _aligned_zeros(nbytes, self.ctx.device)
        access = 0
        for flag in ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ",
                     "IBV_ACCESS_REMOTE_ATOMIC"):   # no relaxed ordering: device.cuh's write-then-signal argument
            access |= self._const(flag)
        fd = self._dmabuf(base, nbytes)
        try:
            for dev in self._used_devices():   # by dmabuf (offset 0, iova = base), else by address
                dev.mr, dev.lkey, dev.rkey = self.glue.reg_mr(dev.pd, base, nbytes, fd, 0, access)
        finally:
            if fd >= 0:
                os.close(fd)   # each MR holds its own reference to the dma-buf
        rails = []
        for name, port in self.rails:
            dev = self.devices[name]
            p = dev.ports[port]
            rails.append(dict(lid=p["lid"], gid=bytes(p["gid"]), mtu=p["mtu"], roce=p["roce"], rkey=dev.rkey))
        first = self.devices[self.rails[0][0]]
        public = dict(rails=rails, share=share, host=node_identity())
        return WindowMemory(base=base, nbytes=nbytes, lkey=first.lkey, rkey=first.rkey, public=public)

    def create_queue(self, peer: int, channel: int, depth: int) -> QueueHandle:
        name, port = self.rail(channel)
        dev, g = self.devices[name], self.glue
        if depth > (1 << dev.caps.log_max_qp_sz):
            raise ValueError(f"ibgda: queue depth {depth} exceeds {name}'s limit {1 << dev.caps.log_max_qp_sz}")
        ring = align_up(depth * 64, PAGE)           # send ring: depth WQEBBs
        cq_at, dbr_at = ring, 2 * ring                # CQ ring: depth 64-byte CQEs; then the record page
        total = align_up(dbr_at + PAGE, ALIGN)
        memory, base = _aligned_zeros(total, self.ctx.device)
        memory.view(-1)[(base - memory.data_ptr()) + cq_at:(base - memory.data_ptr()) + cq_at + depth * 64] = 0xFF
        words = torch.zeros(3, dtype=torch.int64, device=self.ctx.device)   # reserve, turn, completed (sq.cuh)
        fd = self._dmabuf(base, total)
        try:   # by dmabuf: the UMEM's address is the offset in it; else the GPU virtual address
            umem, umem_id = g.umem_reg(dev.ctx, 0 if fd >= 0 else base, total, fd,
                                       self._const("IBV_ACCESS_LOCAL_WRITE"))
        finally:
            if fd >= 0:
                os.close(fd)
        q = _Queue(dev, port, channel, memory, words, umem, None, None, 0)
        self.queues.append(q)   # released by close() from here on
        _, uar_page, doorbell = self._doorbell(dev)
        cq_in = prm.create_cq_in(log_cq_size=_log2(depth), uar_page=uar_page, eqn=dev.eqn, cq_umem_id=umem_id,
                                 cq_umem_offset=cq_at, dbr_umem_id=umem_id, dbr_offset=dbr_at + CQ_DBR)
        q.cq, out = g.obj_create(dev.ctx, cq_in, prm.CREATE_CQ_OUT)
        prm.check_status(out, f"CREATE_CQ on {name}")
        cqn = prm.cqn_of(out)
        qp_in = prm.create_qp_in(pdn=dev.pdn, uar_page=uar_page, cqn_snd=cqn, cqn_rcv=cqn,
                                 log_sq_size=_log2(depth), wq_umem_id=umem_id, dbr_umem_id=umem_id,
                                 dbr_offset=dbr_at + QP_DBR)
        q.qp, out = g.obj_create(dev.ctx, qp_in, prm.CREATE_QP_OUT)
        prm.check_status(out, f"CREATE_QP on {name}")
        q.qpn = prm.qpn_of(out)
        w = words.data_ptr()
        sq = SendQueueParams(ring=base, depth=depth, qpn=q.qpn, reserve=w, turn=w + 8, completed=w + 16,
                             dbr=base + dbr_at + QP_DBR + 4,   # the send counter: the record's second be32
                             doorbell=doorbell, cq=base + cq_at)
        return QueueHandle(sq=sq, qpn=q.qpn, private=q)

    def connect(self, window: WindowMemory, queues, peers: List[PeerInfo]) -> None:
        o, g = self.options, self.glue
        if self.ctx.device.type == "cuda":   # the rings' zeroing and the CQs' 0xff fill land before any use
            torch.cuda.synchronize(self.ctx.device)
        for p in peers:
            for ch, handle in enumerate(queues[p.rank]):
                q: _Queue = handle.private
                mine = q.device.ports[q.port]
                theirs = _rail_of(p, ch)
                remote_qpn = p.qpns_to_me[ch]
                if theirs["roce"] != mine["roce"]:
                    raise RuntimeError(f"ibgda: channel {ch} joins a RoCE port and an InfiniBand port "
                                       f"(rank {self.ctx.rank} {q.device.name}:{q.port}, rank {p.rank})")
                if mine["roce"]:
                    rgid = bytes(theirs["gid"])
                    path = prm.AddressPath(
                        vhca_port_num=q.port, grh=True, rgid=rgid, src_addr_index=mine["gid_index"],
                        rmac=g.resolve_rmac(q.device.pd, q.port, mine["gid_index"], rgid, o.hop_limit),
                        hop_limit=o.hop_limit, tclass=o.traffic_class, eth_prio=o.service_level & 7,
                        udp_sport=roce.udp_sport(q.qpn, remote_qpn, ch, o.udp_sport_base))
                else:
                    path = prm.AddressPath(vhca_port_num=q.port, rlid=theirs["lid"], sl=o.service_level)
                caps = q.device.caps
                steps = [("RST2INIT", prm.rst2init_qp_in(qpn=q.qpn, vhca_port_num=q.port)),
                         ("INIT2RTR", prm.init2rtr_qp_in(qpn=q.qpn, mtu=min(mine["mtu"], theirs["mtu"]),
                                                         remote_qpn=remote_qpn, path=path,
                                                         log_rra_max=min(caps.log_max_ra_res_qp, 7))),
                         ("RTR2RTS", prm.rtr2rts_qp_in(qpn=q.qpn, log_sra_max=min(caps.log_max_ra_req_qp, 7)))]
                for what, cmd in steps:
                    out = g.obj_modify(q.qp, cmd, prm.MODIFY_QP_OUT)
                    prm.check_status(out, f"{what} of QP {q.qpn:#x} (rank {self.ctx.rank} -> rank {p.rank}, "
                                          f"channel {ch}, {q.device.name}:{q.port})")
        if self.proxied and self.proxy is None:   # the CPU doorbell: forward from here on
            self.proxy = g.proxy_start([m for m, _ in self.proxied], [r for _, r in self.proxied])

    def peer_load_store_base(self, peer: PeerInfo) -> int:
        """The window of `peer` (a rank of my node) mapped here, by its node-shared memory; 0 without one."""
        if self.node_memory is None or peer.public.get("share") is None:
            return 0
        if peer.rank in self.opened:
            return self.opened[peer.rank]
        here = node_identity()
        if peer.public.get("host") != here:
            raise RuntimeError(f"rank {peer.rank} runs on {peer.public.get('host')}, not on this machine ({here}): "
                               "a node's ranks must share one machine (check ranks_per_node)")
        self.opened[peer.rank] = self.node_memory.open(peer.public["share"])
        return self.opened[peer.rank]

    def endpoint_keys(self, mem: WindowMemory, peer: PeerInfo, channel: int) -> Tuple[int, int]:
        """(lkey, rkey) for my queue to (peer, channel): my key on that channel's NIC, the peer's on its."""
        return self.devices[self.rail(channel)[0]].lkey, _rail_of(peer, channel)["rkey"]

    def rail(self, channel: int) -> Tuple[str, int]:
        """The (device, port) of my channel `channel` (roce.spread_channels' rule)."""
        return self.rails[channel % len(self.rails)]

    def describe(self) -> List[str]:
        """One line per rail, then how doorbells are rung and GPU memory registered: what doctor, the Buffer's
        capabilities and error messages show."""
        lines = []
        for i, (name, port) in enumerate(self.rails):
            p = self.devices[name].ports[port]
            kind = f"RoCE GID {p['gid_index']} ({p['why']})" if p["roce"] else f"InfiniBand LID {p['lid']}"
            lines.append(f"rail {i} (channels {i} mod {len(self.rails)}): {name}:{port}, {kind}, MTU {p['mtu']}")
        if self.node_memory is not None:
            lines.append(f"node peers: by load/store over {self.node_memory.name}"
                         + (f" (ranks {sorted(self.opened)} mapped)" if self.opened else ""))
        lines.append("doorbell: " + ("the GPU rings the UAR" if self.doorbell_mode == "gpu" else
                                     f"a host thread rings it for the GPU (slower; {self.doorbell_why})"))
        lines.append("GPU memory registered " + ("over dmabuf" if self.registration == "dmabuf" else
                                                 f"by address, nvidia-peermem ({self.registration_why})"))
        return lines

    def close(self) -> None:
        """Queues (QP, CQ, UMEM), the UAR mappings and UARs, then per NIC the MR, PD and context: the reverse of
        their creation; the node peers' windows mapped here, and my node-shared window after its MRs. Every peer
        has stopped using my window and queues (the window made sure). Each release is tried whatever failed
        before it (the first failure is raised at the end), and none is tried twice."""
        g = self.glue
        steps = [(g.proxy_stop, self.proxy)]   # nobody rings any more: stop forwarding before the UARs go
        steps += [(self.node_memory.close, address) for address in self.opened.values()]
        for q in reversed(self.queues):
            steps += [(g.obj_destroy, q.qp), (g.obj_destroy, q.cq), (g.umem_dereg, q.umem)]
        steps += [(g.cuda_unmap_io, page) for page in self.uar_pages]
        steps += [(g.free_uar, uar) for uar in reversed(self.uars)]
        for dev in reversed(list(self.devices.values())):
            steps += [(g.dereg_mr, dev.mr), (g.dealloc_pd, dev.pd), (g.close, dev.ctx)]
        if self.shared_base:   # the memory goes once no MR registers it
            steps.append((self.node_memory.free, self.shared_base))
        self.queues, self.uars, self.uar_pages, self.devices, self.window = [], [], {}, {}, None
        self.opened, self.shared_base = {}, 0
        self.proxy, self.proxied, self.mailboxes = None, [], []
        first: Optional[BaseException] = None
        for release, handle in steps:
            if handle is None:
                continue
            try:
                release(handle)
            except Exception as e:   # go on releasing; report the first failure
                first = first or e
        if first is not None:
            raise first

    def _used_devices(self) -> List[_Device]:
        names = []
        for name, _ in self.rails:
            if name not in names:
                names.append(name)
        return [self.devices[n] for n in names]


def _rail_of(peer: PeerInfo, channel: int) -> dict:
    """The peer's rail for its queue to me on `channel` (its own rails, the same rule)."""
    rails = peer.public["rails"]
    return rails[channel % len(rails)]


def _aligned_zeros(nbytes: int, device: torch.device) -> Tuple[torch.Tensor, int]:
    """A zeroed allocation holding `nbytes` at an ALIGN-aligned address: (tensor to keep, that address)."""
    t = torch.zeros(nbytes + ALIGN, dtype=torch.uint8, device=device)
    return t, align_up(t.data_ptr(), ALIGN)


def _gpu_sysfs_dir(device: torch.device) -> Optional[str]:
    from .. import system

    return next((system.gpu_sysfs_dir(g) for g in system.gpu_info() or [] if g.get("index") == device.index), None)
