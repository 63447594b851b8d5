"""The ibgda window: my memory registered with the NIC, an RC queue to every (peer, channel) the NIC serves,
and the tables csrc/backends/ibgda/device.cuh reads. The NIC resources come from a provider (provider.py);
everything here is the same for all of them.

Set-up, collective over the Buffer's group: the provider makes the window and my queues; every rank's public
half (window address, rkey, what the provider needs to reach it, and the QP number of its queue to each rank
per channel) is exchanged with one allgather; the provider connects each of my queues to the peer's queue to
me and maps the windows of my node's ranks where it can; the endpoint table [peer * channels + channel] goes
to the device.

Load/store peers (docs/IBGDA.md "Node peers"): a node is `ctx.ranks_per_node` consecutive ranks (all of them
when 0). Where the provider maps its node's windows (`maps_node_peers`) and `allow_nvlink_for_low_latency_mode`
is on (the default, as in DeepEP), the ranks of my node, me included, are reached by load/store in
transport_params() and get no queue; every other rank goes through the NIC. Otherwise every rank, me included,
has queues and transport_params() has no load/store peer. node_transport_params() gives the internode kernels my
node's ranks by load/store whenever the provider mapped them (with the option off too).

Past the `nbytes` the engines use, the window holds the transport's scratch words (READ and FETCH_ADD
results land there: a WQE's local side must be registered memory).
"""
from __future__ import annotations

import ctypes
from typing import List, Optional

import torch

from ...contract import BufferContext
from ...device import device_index, device_uuid
from ...windows.base import ERROR_WORDS, MappedWords, Window, rank_problem
from .abi import IBGDA_BUILD, SCRATCH_WORDS, EndpointParams, IbgdaTransportParams
from .devx import DevxProvider
from .provider import NicProvider, PeerInfo, installed

DEFAULT_DEPTH = 256   # WQEBBs per send queue (a power of two, <= 16384: sq.cuh)
PAGE = 4096


def _make_provider(ctx: BufferContext) -> NicProvider:
    """The installed provider (the tests' NIC model), else the mlx5 DevX one."""
    factory = installed()
    return factory(ctx) if factory is not None else DevxProvider(ctx)


def _check_queue_pairs(everyone) -> None:
    """Every rank's allgathered half: a rank has queues to a peer exactly when the peer has queues to it (the
    same set of load/store peers on both ends). Raises the same error on every rank otherwise."""
    qpns = [e[3] for e in everyone]
    for a in range(len(qpns)):
        for b in range(a + 1, len(qpns)):
            if bool(qpns[a][b]) != bool(qpns[b][a]):
                (nv_a, maps_a), (nv_b, maps_b) = everyone[a][4], everyone[b][4]
                has, hasnt = (a, b) if qpns[a][b] else (b, a)
                raise ValueError(
                    f"ibgda: rank {has} reaches rank {hasnt} through the NIC, rank {hasnt} reaches rank {has} by "
                    f"load/store: allow_nvlink_for_low_latency_mode must be the same on every rank (rank {a}: "
                    f"{nv_a}, rank {b}: {nv_b}), and so must the provider's node mapping ({maps_a}, {maps_b})")


class IbgdaWindow(Window):
    build = IBGDA_BUILD
    cheap_fetch_add = False

    def __init__(self, ctx: BufferContext, nbytes: int, channels: int = 1, depth: int = DEFAULT_DEPTH,
                 provider: Optional[NicProvider] = None) -> None:
        if depth <= 0 or depth & (depth - 1) or depth > 16384:
            raise ValueError(f"ibgda queue depth must be a power of two <= 16384, got {depth}")
        self.ctx, self.channels, self.depth = ctx, max(1, int(channels)), depth
        self.cuda = ctx.device.type == "cuda"
        self.dev = device_index(ctx.device) if self.cuda else -1
        self.base, provider_error = None, None
        try:
            self.provider = provider if provider is not None else _make_provider(ctx)
        except Exception as e:   # noqa: BLE001 - told to the peers in the exchange below (e.g. one host's NIC down)
            self.provider, provider_error = None, e
        R, me = ctx.num_ranks, ctx.rank
        P = ctx.ranks_per_node or R
        self.node = [r for r in range(R) if r // P == me // P]   # my node's ranks, me included
        nvlink = bool(ctx.options.get("allow_nvlink_for_low_latency_mode", True))
        maps = self.provider is not None and bool(self.provider.maps_node_peers)
        # Ranks the kernels over transport_params() reach by load/store: no queue is made to them.
        self.load_store = set(self.node) if (maps and nvlink) else set()
        try:
            self.scratch_offset = (nbytes + PAGE - 1) // PAGE * PAGE
            self.size = nbytes
            # A failure here (no NIC, out of memory, a queue the NIC refused) is told to the peers in the exchange
            # below rather than raised at once: they would wait in it for this rank for good.
            problem = None
            try:
                if provider_error is not None:
                    raise provider_error
                self.mem = self.provider.alloc_window(self.scratch_offset + 8 * SCRATCH_WORDS)
                self.queues = [[] if p in self.load_store else
                               [self.provider.create_queue(p, ch, depth) for ch in range(self.channels)]
                               for p in range(R)]
                mine = (self.mem.base, self.mem.rkey, self.mem.public, [[q.qpn for q in row] for row in self.queues],
                        (nvlink, maps), None)
            except Exception as e:   # noqa: BLE001 - raised on every rank after the exchange
                problem = rank_problem(me, e)
                mine = (0, 0, None, [], (nvlink, maps), problem)
            everyone = ctx.comm.allgather_object(mine)
            problems = [e[5] for e in everyone if e[5]]
            if problems:
                if provider_error is not None and len(problems) == R:
                    raise provider_error   # every rank alike (no NIC here, a bad option): its own error
                raise RuntimeError(f"ibgda: making the window of {nbytes} bytes (num_rdma_bytes) and its queues "
                                   "failed: " + "; ".join(problems))
            _check_queue_pairs(everyone)   # the same verdict on every rank
            self.peers: List[PeerInfo] = [PeerInfo(r, b, k, pub, qpns[me]) for r, (b, k, pub, qpns, _, _) in
                                          enumerate(everyone)]
            self.provider.connect(self.mem, self.queues, self.peers)
            self.endpoint_structs = (EndpointParams * (R * self.channels))()
            for p in range(R):
                for ch in range(len(self.queues[p])):
                    lkey, rkey = self.provider.endpoint_keys(self.mem, self.peers[p], ch)
                    self.endpoint_structs[p * self.channels + ch] = EndpointParams(
                        self.queues[p][ch].sq, self.peers[p].base, rkey, lkey)
                if not self.queues[p]:   # a load/store peer: no queue (ring 0; device.cuh never posts to it)
                    for ch in range(self.channels):
                        self.endpoint_structs[p * self.channels + ch].raddr_base = self.peers[p].base
            raw = bytes(self.endpoint_structs)
            self.endpoints = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(ctx.device)
            # `mapped`: where this process loads from / stores to my node's windows (0 for every other rank, and
            # where the provider maps none), offered to the internode kernels (node_base); `bases`: what
            # transport_params' peer table holds (the load/store peers of the low-latency kernels and the
            # self-test, 0 = through the NIC).
            self.mapped, problem = self._map_node()
            me_uuid = device_uuid(self.dev) if self.cuda else None
            facts = ctx.comm.allgather_object((me_uuid, problem))
            problems = [p for _, p in facts if p]
            if problems and self.load_store:
                raise RuntimeError("ibgda: mapping the windows of a node's ranks failed (they are reached by "
                                   "load/store, with no queue to them): " + "; ".join(problems) +
                                   ". allow_nvlink_for_low_latency_mode=False sends low-latency traffic to them "
                                   "through the NIC instead; the normal mode over several nodes needs the mapping")
            if problems:   # every rank alike: nobody offers its node by load/store (the internode engine refuses)
                self.mapped = [self.mem.base if r == me else 0 for r in range(R)]
                self.node_problem = "; ".join(problems)
            self.bases = [self.mapped[r] if r in self.load_store else 0 for r in range(R)]
            self.peer_bases = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
            self.scratch_ticket = torch.zeros(1, dtype=torch.int32, device=ctx.device)
            self.nic_error = torch.zeros(6, dtype=torch.int32, device=ctx.device)
            self._node_tables: list = []
            if self.cuda:
                self._cap_blocks(me_uuid, [u for u, _ in facts])
                self.errors = MappedWords(self.dev, ERROR_WORDS)
            else:
                self.max_blocks, self.errors = 1, None
            self.base = self.mem.base
            ctx.comm.barrier()   # every rank's queues are connected before anyone posts
        except BaseException:
            if self.provider is not None:
                self.provider.close()
            raise

    node_problem = ""   # why the node's windows are not offered by load/store (a mapping failed somewhere)

    def _map_node(self):
        """(where this process reaches each rank's window by load/store: my node's ranks as the provider maps
        them, 0 for every other rank; this rank's problem or None). Local: the caller agrees on the problems."""
        me = self.ctx.rank
        mapped = [0] * self.ctx.num_ranks
        mapped[me] = self.mem.base
        try:
            for r in self.node:
                if r != me:
                    mapped[r] = int(self.provider.peer_load_store_base(self.peers[r]))
        except Exception as e:   # noqa: BLE001 - agreed on every rank by the caller
            return mapped, f"rank {me} (node ranks {self.node[0]}..{self.node[-1]}): {type(e).__name__}: {e}"
        missing = [r for r in self.load_store if mapped[r] == 0]
        if missing:
            return mapped, f"rank {me}: the {self.provider.name} provider gave no address for ranks {missing}"
        return mapped, None

    def _params(self, peer_bases: torch.Tensor) -> IbgdaTransportParams:
        return IbgdaTransportParams(
            endpoints=self.endpoints.data_ptr(), peer_bases=peer_bases.data_ptr(), base=self.base,
            scratch_offset=self.scratch_offset, scratch_ticket=self.scratch_ticket.data_ptr(),
            nic_error=self.nic_error.data_ptr(), rank=self.ctx.rank, num_ranks=self.ctx.num_ranks,
            channels=self.channels, atomic_result_be=int(self.provider.atomic_result_be),
            timeout_ns=int(self.ctx.timeout_s * 1e9))

    def transport_params(self) -> IbgdaTransportParams:
        return self._params(self.peer_bases)

    def node_transport_params(self, node_ranks) -> IbgdaTransportParams:
        """Load/store addresses for `node_ranks` (the internode kernels' NVLink part), the NIC for every other
        (0 where the provider mapped none: the internode engine refuses such a node)."""
        keep = set(node_ranks)
        if self.load_store - keep:
            raise ValueError(f"ibgda: ranks {sorted(self.load_store - keep)} have no queue (reached by load/store), "
                             f"so they must stay in the node table, not only {sorted(keep)}")
        table = torch.tensor([b if r in keep else 0 for r, b in enumerate(self.mapped)], dtype=torch.int64,
                             device=self.ctx.device)
        self._node_tables.append(table)   # the struct holds its address: keep it alive with the window
        return self._params(table)

    def node_base(self, rank: int) -> int:
        return self.mapped[rank]

    def endpoint(self, peer: int, channel: int = 0) -> EndpointParams:
        """My queue to (peer, channel) as the device code sees it (host copy)."""
        return self.endpoint_structs[peer * self.channels + channel]

    def endpoint_address(self, peer: int, channel: int = 0) -> int:
        index = peer * self.channels + channel
        return ctypes.addressof(self.endpoint_structs) + ctypes.sizeof(EndpointParams) * index

    def close(self) -> None:
        """Collective: nobody posts to or reads my window any more, then the provider releases it."""
        self._close_after_peers(self.provider.close)
