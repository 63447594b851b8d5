"""Who owns the NIC resources behind an ibgda window: the interface window.py is written against.

A provider makes the window's memory (registered with the NIC: an address the kernels use and the keys
WQEs name), one RC queue per (peer, channel) whose send queue, doorbell record, doorbell and collapsed CQ
the GPU reaches (sq.cuh's SendQueue), and connects each queue to the peer's queue to me once every rank's
public half is known. A provider that says `maps_node_peers` also maps the windows of its node's ranks
(`peer_load_store_base`), so the kernels reach them by load/store (NVLink) and the window makes no queue to
them where it uses that mapping. Everything else (the exchange over the Buffer's group, which ranks get
queues, the endpoint table, the transport struct) is the window's, the same for every provider.

Providers:
  * the mlx5 DevX provider (devx.py: QPs and CQs as DevX objects with their rings in GPU memory, a UAR
    doorbell mapped into the GPU, the window an MR over dmabuf that the node's ranks map by CUDA IPC,
    node_memory.py; docs/IBGDA.md), the default: written and tested on CPU against a fake of its C glue,
    **never run on a real NIC**;
  * the NIC model (tests/ibgda_model.py, tests only): a host thread per process that plays the NIC for the
    queues, over windows in shared memory every rank maps. Tests install it with `install(factory)`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from .. import registry
from .abi import SendQueueParams


@dataclass
class WindowMemory:
    """My window as the NIC knows it. `base`: the address my kernels and my WQEs use for it; `lkey`: the key
    my WQEs name for it; `rkey`: the key peers' WQEs name; `public`: what peers need besides (base, rkey),
    e.g. how to map it (any picklable value)."""

    base: int
    nbytes: int
    lkey: int
    rkey: int
    public: Any = None


@dataclass
class QueueHandle:
    """One RC queue of mine: what the GPU posts to (`sq`, addresses it can reach) and its QP number."""

    sq: SendQueueParams
    qpn: int
    private: Any = None


@dataclass
class PeerInfo:
    """A peer's public half: its window (base, rkey, public) and, per channel, its queue to me."""

    rank: int
    base: int
    rkey: int
    public: Any
    qpns_to_me: List[int]


class NicProvider(abc.ABC):
    """The NIC resources of one window on one rank (docstring above)."""

    name = "?"
    atomic_result_be = True   # the HCA returns 8-byte atomic results big-endian (atomic_req_8B_endianness_mode)
    # Whether peer_load_store_base maps every rank of my node once connected: known before any queue is made,
    # and the same on every rank (the window checks), because the window makes no queue to a rank it reaches
    # by load/store.
    maps_node_peers = False

    @abc.abstractmethod
    def alloc_window(self, nbytes: int) -> WindowMemory:
        """Zeroed window memory of `nbytes`, registered (without relaxed ordering: device.cuh's argument)."""

    @abc.abstractmethod
    def create_queue(self, peer: int, channel: int, depth: int) -> QueueHandle:
        """My RC queue to (peer, channel) with `depth` WQEBBs (a power of two)."""

    @abc.abstractmethod
    def connect(self, window: WindowMemory, queues: List[List[QueueHandle]], peers: List[PeerInfo]) -> None:
        """Bring every queue up against its peer (RTR / RTS on a NIC; key tables for the model). queues[peer][ch]."""

    def peer_load_store_base(self, peer: PeerInfo) -> int:
        """Where this process's kernels reach `peer`'s window by load/store, or 0 (only through the NIC). Asked
        after connect(), once per other rank of my node; raises when a mapping it should make fails."""
        return 0

    def endpoint_keys(self, mem: WindowMemory, peer: PeerInfo, channel: int) -> Tuple[int, int]:
        """(lkey, rkey) the WQEs of my queue to (peer, channel) name: one key pair unless the provider registers
        the window once per NIC (then the channel's NIC decides)."""
        return mem.lkey, peer.rkey

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; every peer has stopped using my window (the caller made sure)."""


ProviderFactory = Callable[[Any], NicProvider]   # ctx (BufferContext) -> provider
_factory: Optional[ProviderFactory] = None


def install(factory: Optional[ProviderFactory]) -> None:
    """Make `factory` the provider of every ibgda window made after this call (None: back to none). Tests use
    it for the NIC model; the probe then reports the backend usable through it."""
    global _factory
    _factory = factory
    registry.changed()   # the probe asks again


def installed() -> Optional[ProviderFactory]:
    return _factory
