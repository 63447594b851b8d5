"""The ibgda window: my memory registered with the NIC, an RC queue to every (peer, channel), self included
(fetch_add goes through the NIC for every rank: device.cuh), and the tables csrc/backends/ibgda/device.cuh
reads. The NIC resources come from a provider (provider.py); everything here is the same for all of them.

Set-up, collective over the Buffer's group: the provider makes the window and my queues; every rank's public
half (window address, rkey, what the provider needs to reach it, and the QP number of its queue to each rank
per channel) is exchanged with one allgather; the provider connects each of my queues to the peer's queue to
me; the endpoint table [peer * channels + channel] goes to the device.

Past the `nbytes` the engines use, the window holds the transport's scratch words (READ and FETCH_ADD
results land there: a WQE's local side must be registered memory).

Load/store peers: none in transport_params() (every peer through the NIC, so the tests' NIC model carries
all traffic); node_transport_params() gives the internode kernels the node's ranks by load/store where the
provider can map them.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional

import torch

from ...contract import BufferContext
from ...device import device_index, device_uuid
from ...windows.base import ERROR_WORDS, MappedWords, Window
from .abi import IBGDA_BUILD, SCRATCH_WORDS, EndpointParams, IbgdaTransportParams
from .devx import DevxProvider
from .provider import NicProvider, PeerInfo, installed

DEFAULT_DEPTH = 256   # WQEBBs per send queue (a power of two, <= 16384: sq.cuh)
PAGE = 4096


def _make_provider(ctx: BufferContext) -> NicProvider:
    """The installed provider (the tests' NIC model), else the mlx5 DevX one."""
    factory = installed()
    return factory(ctx) if factory is not None else DevxProvider(ctx)


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
        self.base = None
        self.provider = provider if provider is not None else _make_provider(ctx)
        R, me = ctx.num_ranks, ctx.rank
        try:
            self.scratch_offset = (nbytes + PAGE - 1) // PAGE * PAGE
            self.mem = self.provider.alloc_window(self.scratch_offset + 8 * SCRATCH_WORDS)
            self.size = nbytes
            self.queues = [[self.provider.create_queue(p, ch, depth) for ch in range(self.channels)] for p in range(R)]
            mine = (self.mem.base, self.mem.rkey, self.mem.public, [[q.qpn for q in row] for row in self.queues])
            everyone = ctx.comm.allgather_object(mine)
            self.peers: List[PeerInfo] = [PeerInfo(r, b, k, pub, qpns[me]) for r, (b, k, pub, qpns) in
                                          enumerate(everyone)]
            self.provider.connect(self.mem, self.queues, self.peers)
            self.endpoint_structs = (EndpointParams * (R * self.channels))()
            for p in range(R):
                for ch in range(self.channels):
                    lkey, rkey = self.provider.endpoint_keys(self.mem, self.peers[p], ch)
                    self.endpoint_structs[p * self.channels + ch] = EndpointParams(
                        self.queues[p][ch].sq, self.peers[p].base, rkey, lkey)
            raw = bytes(self.endpoint_structs)
            self.endpoints = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(ctx.device)
            # The kernels reach every rank through the NIC (transport_params' peer table is all zero, and so is
            # `bases`, which says what that table holds); `mapped`: where this process could load/store each
            # window (the provider's mapping), offered to the internode kernels for their node (node_base).
            self.bases = [0] * R
            self.mapped = [self.mem.base if r == me else self.provider.peer_load_store_base(self.peers[r])
                           for r in range(R)]
            self.peer_bases = torch.zeros(R, dtype=torch.int64, device=ctx.device)
            self.scratch_ticket = torch.zeros(1, dtype=torch.int32, device=ctx.device)
            self.nic_error = torch.zeros(6, dtype=torch.int32, device=ctx.device)
            self._node_tables: list = []
            if self.cuda:
                me_uuid = device_uuid(self.dev)
                self._cap_blocks(me_uuid, ctx.comm.allgather_object(me_uuid))
                self.errors = MappedWords(self.dev, ERROR_WORDS)
            else:
                self.max_blocks, self.errors = 1, None
            self.base = self.mem.base
            ctx.comm.barrier()   # every rank's queues are connected before anyone posts
        except BaseException:
            self.provider.close()
            raise

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
        """Load/store addresses for `node_ranks` (the internode kernels' NVLink part), the NIC for every other."""
        keep = set(node_ranks)
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
