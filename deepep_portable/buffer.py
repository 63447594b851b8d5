"""`Buffer`: the DeepEP-compatible entry point.

Buffer owns what every op shares (the group, the transport backend, the communication stream) and
does the same three things for every op: validate the arguments (raising before anything is
launched), order the streams (`previous_event`, `async_finish`, `allocate_on_comm_stream`), and call
the backend. Backends (deepep_portable/transports/) never see an invalid argument.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import warnings
from typing import List, Optional, Tuple, Union

import torch

from . import _validate as check
from .comm import Comm
from .config import DEFAULT_NUM_SMS, Config
from .errors import CommError
from .event import EventOverlap as V1EventOverlap   # the base class: a previous_event of either kind is accepted
from .utils.event import EventOverlap               # what ops return: V2's (V1's with V2's additions), as DeepEP V2
from .failures import after_launch, collective_op
from .handles import DispatchHandle, InternodeHandle, LowLatencyHandle
from .contract import (BufferContext, CachedDispatchArgs, CombineArgs, DispatchArgs, LowLatencyCombineArgs,
                       LowLatencyDispatchArgs, Transport)
from .engines.dispatch_layout import dispatch_layout, dispatch_layout_current_stream
from .engines.launch import current_stream_handle, stream_wait_stream
from .layout import MAX_TOPK, low_latency_rdma_size_hint
from .logfmt import chunk_channels as logfmt_chunk
from .topology import NodeLayout, node_layout
from .transports import backend_class, choose, internode_normal_transports, registry

topk_idx_t = torch.int64
_uids = itertools.count(1)
_tags = itertools.count(0)

DEFAULT_TIMEOUT_S = 100.0


class Buffer:
    """Expert-parallel communication buffers for MoE dispatch and combine.

    Same constructor (DeepEP V1's positional order) and methods as `deep_ep.Buffer` (V1). Ours in
    addition, keyword-only:
      transport: "auto" | "nvlink" | "nvshmem" | "ibgda" | "nccl_gin" | "reference" ("auto": nvlink when
                 every rank is on one node and it is usable, else the first usable of available_transports();
                 normal mode over several nodes: the internode kernels' backend (nvshmem) if usable, else
                 reference)
      timeout_s: bound on every wait; a timeout raises an exception naming op, rank and peer.
      transport_options: a dict for the chosen transport, checked by its schema (the registry row's `options`)
                 before anything is set up; unknown keys raise ValueError (docs/CONFIGURATION.md lists each
                 backend's): "nvshmem": passed to NVSHMEM at its initialisation (the first such Buffer of the
                 process): ibgda, ib_gid_index, ib_traffic_class, ib_sl, hca_list, remote_transport,
                 symmetric_size; "ibgda": GID index / address family, traffic class, service level, hop limit, UDP
                 source ports, HCA list, ports, who rings the doorbells (also from DEEPEP_PORTABLE_IB_*
                 variables); "nccl_gin": gin (True / False), reuse_torch_comm (True / False) and NCCL's IB
                 settings (ib_gid_index, ib_traffic_class, ib_sl, hca_list, gin_type). "nvlink" and "reference"
                 take none. With transport="auto" they are checked by the backend it picks.
      nvshmem_options, ibgda_options, nccl_options: deprecated aliases of transport_options for one backend
                 each (a DeprecationWarning; checked and applied as before, whichever transport is chosen).
      ranks_per_node: ranks per node (default: DEEPEP_PORTABLE_RANKS_PER_NODE, else the machines); K
                 consecutive ranks of one machine make a logical node (topology.py, docs/INTERNODE.md).
    `group` may be a torch ProcessGroup or (as first argument or `comm=`) an mpi4py communicator.
    """

    num_sms: int = DEFAULT_NUM_SMS

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None,
                 *, transport: str = "auto", timeout_s: Optional[float] = None,
                 transport_options: Optional[dict] = None, ranks_per_node: Optional[int] = None,
                 nvshmem_options: Optional[dict] = None, ibgda_options: Optional[dict] = None,
                 nccl_options: Optional[dict] = None) -> None:
        if use_fabric:
            # DeepEP allocates its NVLink buffer with fabric handles (multi-node NVLink, IMEX). Our windows
            # share memory by CUDA IPC handles and POSIX file descriptors only: refuse before any set-up.
            raise ValueError("use_fabric=True (fabric memory handles for multi-node NVLink) is not supported by "
                             "deepep_portable yet; ranks of one node share memory without it")
        self._comm = Comm(group, comm)
        self.rank = self._comm.rank
        self.group_size = self._comm.size
        self.group = self._comm.raw
        check.positive_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        check.positive_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        check.positive_int("num_qps_per_rank", num_qps_per_rank)
        # Unknown names raise here, before anything is set up (the backend's schema: its registry row).
        backend_options = self._legacy_options(nvshmem_options=nvshmem_options, ibgda_options=ibgda_options,
                                               nccl_options=nccl_options)
        if transport_options is not None and transport != "auto":
            backend_options[transport] = self._transport_options(transport, transport_options, backend_options)
        # Collective, before anything is set up: the windows are symmetric, so these must match on every rank.
        # (ranks_per_node: topology.node_layout checks it with the environment's value.)
        tag = self._agree(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                          low_latency_mode=bool(low_latency_mode), num_qps_per_rank=num_qps_per_rank,
                          enable_shrink=bool(enable_shrink), transport=transport)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        self.use_fabric = False
        if timeout_s is None:
            timeout_s = float(os.environ.get("DEEPEP_PORTABLE_TIMEOUT_S", DEFAULT_TIMEOUT_S))

        self.nodes = self._node_layout(ranks_per_node, num_nvl_bytes)   # collective
        if self.nodes.num_nodes > 1 and num_nvl_bytes > 0:
            names = internode_normal_transports()
            if transport != "auto" and transport not in names:
                raise ValueError(f"normal mode over {self.nodes.num_nodes} nodes (num_nvl_bytes > 0) is implemented "
                                 f"by transport={' / '.join(repr(n) for n in names)}, not {transport!r}")
        self._transport_choice = choose(transport, self.nodes.on_one_machine,
                                        internode_normal=self.nodes.num_nodes > 1 and num_nvl_bytes > 0)
        self.transport = self._transport_choice.name
        if transport_options is not None and transport == "auto":   # checked by the backend "auto" picked
            backend_options[self.transport] = self._transport_options(self.transport, transport_options,
                                                                      backend_options)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        self._comm_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._comm_handle = self._comm_stream.cuda_stream if self._comm_stream is not None else 0
        self._device_index = device.index
        self._ctx = BufferContext(
            comm=self._comm, rank=self.rank, num_ranks=self.group_size, device=device,
            num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
            uid=next(_uids), timeout_s=timeout_s, comm_stream=self._comm_stream,
            ranks_per_node=self.nodes.ranks_per_node,
            options=dict(num_qps_per_rank=num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
                         allow_mnnvl=allow_mnnvl, enable_shrink=self.enable_shrink, **backend_options),
            tag=tag, describe_error=registry.error_text(self.transport))
        self._failed: Optional[str] = None   # why an earlier op left this Buffer unusable (failures.py)
        self._layout_eager_dev = None   # get_dispatch_layout's hot path: this GPU's index while it is open
        self._combine_eager = None
        self._backend = backend_class(self.transport)(self._ctx)
        if self.enable_shrink and self._backend.shrink_mask() is None:
            # Same arguments on every rank: all raise here together.
            self._backend.destroy()
            self._backend = None
            raise ValueError(f"enable_shrink=True needs the low-latency kernels (num_rdma_bytes > 0 and a transport "
                             f"that runs them: nvlink, nvshmem); transport {self.transport!r} has none here")
        if device.type == "cuda" and self.nodes.num_nodes == 1:
            self._layout_eager_dev = device.index
        self._combine_eager = self._backend.combine_eager   # combine's eager path (None: the backend has none)

    @staticmethod
    def _legacy_options(**given) -> dict:
        """{backend: what it reads} for the deprecated per-backend keywords given (each an alias of
        transport_options for one backend, the registry row's legacy_option), checked by its schema."""
        out = {}
        for keyword, name in registry.legacy_options().items():
            options = given.pop(keyword, None)
            if options is not None:
                warnings.warn(f"Buffer({keyword}=...) is deprecated: pass transport_options=... (with "
                              f"transport={name!r}, or transport='auto' choosing it)", DeprecationWarning,
                              stacklevel=3)
                out[name] = registry.validate_options(name, options, keyword)
        assert not given, f"deprecated keywords without a registry row: {sorted(given)}"
        return out

    @staticmethod
    def _transport_options(name: str, options: dict, backend_options: dict):
        """transport_options checked by backend `name`'s schema (ValueError also when a deprecated keyword gave
        the same backend's options)."""
        if backend_options.get(name) is not None:
            raise ValueError(f"transport_options and {registry.row(name).legacy_option} both give options for "
                             f"transport {name!r}: pass transport_options only")
        return registry.validate_options(name, options)

    def _agree(self, **settings) -> int:
        """Collective: every rank passed the same `settings`; if not, every rank raises the same ValueError.
        Returns the message tag of this Buffer's agreements (rank 0's pick, so the same on every rank; two
        Buffers on one group get different ones)."""
        everyone = self._comm.allgather_object((settings, next(_tags)))
        differ = [k for k in settings if len({repr(s[k]) for s, _ in everyone}) > 1]
        if differ:
            detail = "; ".join(f"{k}: " + ", ".join(f"rank {r} {s[k]!r}" for r, (s, _) in enumerate(everyone))
                               for k in differ)
            raise ValueError(f"ranks disagree on Buffer arguments that must be equal on every rank: {detail}")
        return 1000 + 2 * (everyone[0][1] % 15000)   # two tags each (failures.py), within MPI's smallest tag bound

    def _node_layout(self, ranks_per_node: Optional[int], num_nvl_bytes: int) -> NodeLayout:
        """Collective: the nodes of this group (topology.node_layout). A group whose machines hold unequal or
        non-consecutive ranks has no node layout; only the normal mode needs one."""
        try:
            return node_layout(self._comm, ranks_per_node)
        except ValueError:
            if num_nvl_bytes > 0 or ranks_per_node is not None:
                raise
            return NodeLayout(self.group_size, self.group_size, on_one_machine=False)

    # ---- lifetime / static helpers ------------------------------------------------------------
    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs the Buffer to be created with explicitly_destroy=True")
        self._live().destroy()
        self._backend = self._layout_eager_dev = self._combine_eager = None

    @property
    def capabilities(self) -> dict:
        """What this Buffer's transport can do (contract.Capabilities as a dict; e.g. for nvshmem,
        whether every peer turned out to be reachable by load/store), plus what the backend chose where it
        says (ibgda: its NIC provider's rails, doorbell and memory registration)."""
        backend = self._live()
        notes = getattr(backend, "runtime_notes", None)
        return {**backend.runtime_capabilities().as_dict(), **(notes() if notes else {})}

    @property
    def transport_info(self) -> dict:
        """Which transport this Buffer uses and why: name, requested ("auto" or the name given), why it was
        chosen, not_chosen (each other backend: why not), verified_hardware (where that backend has run for
        real), ran_on_hardware, and the warning "auto" gave when it picked one that has not (else None)."""
        return self._transport_choice.as_dict()

    @property
    def backend(self) -> Transport:
        """The transport backend serving this Buffer (contract.Transport), for the project's tools and
        tests (bench reads its engines' grid, profiles and traces); ops never need it."""
        return self._live()

    @property
    def usable(self) -> bool:
        """Whether ops may still be called: False once destroyed, or once a failure left it unusable on every rank
        (CommError.usable; docs/RELIABILITY.md). Ours, not DeepEP's."""
        return self._backend is not None and self._failed is None

    def _live(self) -> Transport:
        if self._backend is None:
            raise RuntimeError("this Buffer was destroyed")
        return self._backend

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True   # kernels are compiled on first use for the device's architecture

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        check.positive_int("new_num_sms", new_num_sms)
        if new_num_sms % 2 != 0:
            raise ValueError("The SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream (for `previous_event=`)."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A sound default for any rank count (no table of supported sizes)."""
        check.positive_int("num_ranks", num_ranks)
        return Config(Buffer.num_sms, 6 if num_ranks > 2 else 24, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        check.positive_int("num_ranks", num_ranks)
        return Config(Buffer.num_sms, 4 if num_ranks > 4 else (9 if num_ranks > 2 else 10), 256, 6, 128)

    def synchronize(self) -> None:
        """Wait for this Buffer's work on the device and raise what failed there (ours, not DeepEP's).

        Ops return before their kernels finish; a kernel that gave up waiting for a peer records why, and the
        Buffer raises it at the next op on this rank, or here. Outputs of an op are valid only once a later
        call (this one, or any op) returned without raising. Every rank's error names the peer that caused it
        (docs/RELIABILITY.md)."""
        if self._failed is not None:
            raise CommError(f"synchronize on rank {self.rank}: {self._failed}")
        try:
            self._live().synchronize()
        except CommError as e:
            err = self._live().failed("synchronize", self._ctx.calls, e)
            if not getattr(err, "usable", False):
                self._failed = f"an earlier op failed and left this Buffer unusable ({err})"
            if err is e:
                raise
            raise err from e

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's raw buffer (the RDMA / low-latency one with use_rdma_buffer, else the NVLink one) as
        a 1-D `dtype` tensor from byte `offset` (no copy), or its first size.numel() elements viewed as
        `size`. As in DeepEP it aliases memory the ops use. Unlike DeepEP's, the tensor ends at the
        buffer's end (DeepEP's runs `offset` bytes past it)."""
        buf = self._live().local_buffer(bool(use_rdma_buffer))
        check.positive_int("offset", offset, minimum=0)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset > buf.numel() or offset % itemsize:
            raise ValueError(f"offset {offset} must be a multiple of {itemsize} (the {dtype} size) and at most "
                             f"the buffer's {buf.numel()} bytes")
        count = (buf.numel() - offset) // itemsize
        tensor = buf[offset:offset + count * itemsize].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(f"size {list(size)} needs {size.numel()} elements; the buffer holds {tensor.numel()} "
                             f"{dtype} elements from offset {offset}")
        return tensor[:size.numel()].view(size)

    # ---- stream ordering ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _op(self, previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool,
            result: list):
        """Order the op against the caller's stream, then record `result[0]` = EventOverlap.

        The body allocates outputs on the current stream (the comm stream if allocate_on_comm_stream)
        and enqueues device work on the comm stream. Tensors in `result[1:]` are protected from the
        caching allocator across streams when the caller does not wait (async_finish)."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True")
        if previous_event is not None and not isinstance(previous_event, V1EventOverlap):
            raise TypeError("previous_event must be an EventOverlap (e.g. from Buffer.capture())")
        if self._comm_stream is None:
            yield
            result.insert(0, EventOverlap(None))
            return
        # Stream ordering by handle (stream_wait_stream), against the Buffer's GPU's current stream.
        dev, comm = self._device_index, self._comm_stream
        compute = current_stream_handle(dev)
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            stream_wait_stream(dev, self._comm_handle, compute)
        try:
            if allocate_on_comm_stream:
                with torch.cuda.stream(comm):
                    yield
            else:   # outputs on the current stream (a stream context costs ~10 us here)
                yield
        except BaseException:
            # What the op enqueued on the comm stream before it raised runs on (kernels that read the caller's
            # tensors, write outputs freed on the way out): the caller's stream waits for it, so the allocator gives
            # none of that memory to the caller's next work before the comm stream is done with it.
            stream_wait_stream(dev, compute, self._comm_handle)
            raise
        if async_finish:
            tensors = [t for t in _flatten(result) if isinstance(t, torch.Tensor) and t.is_cuda]
            event = torch.cuda.Event()
            event.record(comm)
            compute_stream = torch.cuda.current_stream(dev) if allocate_on_comm_stream else None
            for t in tensors:
                t.record_stream(comm)
                if compute_stream is not None:
                    t.record_stream(compute_stream)
            result.insert(0, EventOverlap(event, tuple(tensors)))
        else:
            stream_wait_stream(dev, compute, self._comm_handle)
            result.insert(0, EventOverlap(None))

    # ---- normal mode --------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Returns (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank ([num_nodes] int32: tokens with an
        expert on a rank of that node; None with one node), num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool, event)."""
        # The eager hot path: nothing to overlap, and arguments that pass every cheap check (a plain contiguous
        # int64 tensor on this Buffer's GPU, top-k in range, a whole number of experts per rank, the range check
        # already done on this unmodified tensor). Its host path is most of the op's time (docs/PERFORMANCE.md);
        # every other call takes the full path below, which checks properly and raises.
        if (self._layout_eager_dev is not None and previous_event is None and not async_finish
                and not allocate_on_comm_stream and type(topk_idx) is torch.Tensor and topk_idx.dtype is topk_idx_t
                and topk_idx.device == self.device and topk_idx.dim() == 2 and 0 < topk_idx.size(1) <= MAX_TOPK
                and topk_idx.is_contiguous() and type(num_experts) is int and 0 < num_experts < 1 << 31
                and num_experts % self.group_size == 0 and check.range_checked(topk_idx, num_experts)):
            per_rank, per_expert, in_rank = dispatch_layout_current_stream(topk_idx, num_experts, self.group_size,
                                                                           self._layout_eager_dev)
            return per_rank, None, per_expert, in_rank, EventOverlap(None)
        self._live()
        check.layout_args(topk_idx, topk_idx_t, num_experts, self.group_size, self.device)
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            # Nothing to overlap: one kernel on the caller's stream orders exactly as the comm stream
            # round trip would, without its two stream waits (the call is bound by its host path).
            if topk_idx.is_cuda:
                per_rank, per_expert, in_rank = dispatch_layout_current_stream(topk_idx, num_experts, self.group_size,
                                                                               topk_idx.device.index)
            else:
                per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size, None)
            return per_rank, self._per_node(in_rank), per_expert, in_rank, EventOverlap(None)
        result: list = [topk_idx]
        with self._op(previous_event, async_finish, allocate_on_comm_stream, result):
            per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size, self._comm_stream)
            per_node = self._per_node(in_rank)
            result += [per_rank, per_expert, in_rank, per_node]
        return per_rank, per_node, per_expert, in_rank, result[0]

    def _per_node(self, is_token_in_rank: torch.Tensor) -> Optional[torch.Tensor]:
        """num_tokens_per_rdma_rank: tokens with an expert on some rank of each node (None: one node)."""
        nodes = self.nodes
        if nodes.num_nodes == 1:
            return None
        per_node = is_token_in_rank.view(-1, nodes.num_nodes, nodes.ranks_per_node).any(dim=2)
        return per_node.sum(dim=0, dtype=torch.int32)

    @collective_op("dispatch")
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts.

        Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event),
        as DeepEP. With `handle` (cached dispatch) only recv_x is computed and the rest are None.
        """
        backend = self._live()
        x_data, x_scales = check.dispatch_x(x, self.device)
        num_tokens, hidden = x_data.shape
        config = check.config(config, lambda: self.get_dispatch_config(self.group_size))
        check.positive_int("expert_alignment", expert_alignment)
        check.positive_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if num_tokens_per_rdma_rank is not None:   # as DeepEP: given over several nodes, ignored within one
            check.tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, torch.int32, (self.nodes.num_nodes,),
                         self.device)

        if handle is not None:
            handle = self._inner(handle)
            check.dispatch_handle(handle, self._ctx.uid, num_tokens)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle given) takes no topk_idx / topk_weights")
            check.dispatch_capacity(self._ctx, x_data, x_scales, 0)
            cached = CachedDispatchArgs(x=x_data, x_scales=x_scales, handle=handle, num_sms=config.num_sms)
            result: list = [x_data, x_scales]
            with self._op(previous_event, async_finish, allocate_on_comm_stream, result):
                recv_x, recv_scales = backend.cached_dispatch(cached)
                result += [recv_x, recv_scales]
            out_x = (recv_x, recv_scales) if x_scales is not None else recv_x
            return out_x, None, None, None, None, result[0]

        R = self.group_size
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout)")
        check.tensor("num_tokens_per_rank", num_tokens_per_rank, torch.int32, (R,), self.device)
        check.tensor("is_token_in_rank", is_token_in_rank, torch.bool, (num_tokens, R), self.device)
        check.tensor("num_tokens_per_expert", num_tokens_per_expert, torch.int32, (None,), self.device)
        num_experts = check.num_experts(num_tokens_per_expert.size(0), R)
        num_topk = 0
        if topk_idx is not None:
            check.tensor("topk_idx", topk_idx, topk_idx_t, (num_tokens, None), self.device)
            num_topk = check.topk_width(topk_idx)
            check.expert_indices("topk_idx", topk_idx, num_experts)
            if topk_weights is None:
                raise ValueError("topk_weights must be given with topk_idx")
            check.tensor("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk), self.device)
        elif topk_weights is not None:
            raise ValueError("topk_weights given without topk_idx")
        check.dispatch_capacity(self._ctx, x_data, x_scales, num_topk)

        args = DispatchArgs(x=x_data, x_scales=x_scales, topk_idx=topk_idx, topk_weights=topk_weights,
                            num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                            num_tokens_per_expert=num_tokens_per_expert, num_experts=num_experts,
                            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                            num_sms=config.num_sms, config=config)
        result = [x_data, x_scales, topk_idx, topk_weights, is_token_in_rank]
        with self._op(previous_event, async_finish, allocate_on_comm_stream, result):
            res = backend.dispatch(args)
            result += [res.recv_x, res.recv_x_scales, res.recv_topk_idx, res.recv_topk_weights]
            handle = res.handle
            if self.nodes.num_nodes > 1:
                # DeepEP's internode handle (its positions), holding ours. Computed on the comm stream, after
                # the kernels that write what it reads (async_finish: nobody waits for them in between).
                on_comm = torch.cuda.stream(self._comm_stream) if self._comm_stream is not None else \
                    contextlib.nullcontext()
                with on_comm:
                    try:
                        handle = InternodeHandle(handle, self.nodes.ranks_per_node, self.rank)
                    except BaseException:   # the op ran in full on every rank: nobody waits for this one
                        raise after_launch(sys.exc_info()[1])
                result.append(handle)
        out_x = (res.recv_x, res.recv_x_scales) if x_scales is not None else res.recv_x
        return (out_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list,
                handle, result[0])

    @staticmethod
    def _inner(handle):
        """The DispatchHandle an internode handle holds (any other object is checked as it is)."""
        return handle.inner if isinstance(handle, InternodeHandle) else handle

    @collective_op("combine")
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Sum each token's expert outputs back on its source rank (no weights applied).

        Returns (combined_x [num_tokens, hidden] bf16, combined_topk_weights or None, event)."""
        # The eager path (IntranodeEngine.combine_eager): the common call, nothing to overlap, arguments that pass every
        # check below (_validate.combine_eager). Its host steps before the first kernel are part of the op's time.
        eager = self._combine_eager
        if (eager is not None and previous_event is None and not async_finish and not allocate_on_comm_stream
                and check.combine_eager(x, handle, topk_weights, bias, config, self._ctx.uid, self._device_index)):
            done = eager(x, handle, topk_weights, self.num_sms if config is None else config.num_sms)
            if done is not None:
                return done[0], done[1], EventOverlap(None)
        backend = self._live()
        handle = self._inner(handle)
        num_sms, bias_0, bias_1 = check.combine_args(x, handle, topk_weights, bias, config, self._ctx.uid, self.device,
                                                     self.num_sms)
        hidden = x.size(1)
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        check.combine_capacity(self._ctx, handle.num_tokens, hidden, num_topk)   # layout and room cached there
        args = CombineArgs(x=x, handle=handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1,
                           num_sms=num_sms)
        result: list = [x, topk_weights, bias_0, bias_1]
        with self._op(previous_event, async_finish, allocate_on_comm_stream, result):
            combined_x, combined_w = backend.combine(args)
            result += [combined_x, combined_w]
        return combined_x, combined_w, result[0]


    # ---- zero-copy inputs of the normal-mode ops (not DeepEP V1 APIs) --------------------------------
    # Where a caller writes an op's rows so that the op reads them in place instead of first copying them into
    # this Buffer. Over the intranode kernels (transports nvlink, nvshmem and nccl_gin on one node) each op
    # starts by copying its rows into the rank's own send area, where the peers pull them from; a caller that
    # writes the rows there itself (the producing kernel's output, e.g. an FP8 cast's `out=`) saves that pass.
    # Each call waits, on the GPU and ordered before the caller's later work, until every peer has finished
    # reading this Buffer's last op (every rank calls it before the op, as the op itself is collective). Any op
    # on this Buffer closes the rows, and the next op may overwrite them (e.g. a combine stages its rows there):
    # keep a copy of anything still needed after the op (the dispatch's tokens for a shared expert or a
    # residual). Call again before each op that is to read them in place (also to reuse the same contents).
    # Other engines (reference transport, several nodes) return a fresh tensor, which the op then copies as any
    # input.
    def get_next_dispatch_buffer(self, num_tokens: int, hidden: int,
                                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A [num_tokens, hidden] tensor of `dtype` (torch.bfloat16, or torch.float8_e4m3fn for an FP8
        dispatch) to write this rank's tokens into, then pass as `dispatch`'s x (FP8: as x[0], with scales
        from anywhere). Over the intranode kernels it is a view of this Buffer: the dispatch's peers read the
        rows there, and its stage copies only the scales and top-k (one pass over the payload instead of two).
        A fresh dispatch and a cached one (handle=...) both read it in place. Every rank calls it before the
        dispatch it is for."""
        backend = self._live()
        num_tokens = check.positive_int("num_tokens", num_tokens, minimum=0)
        hidden = check.positive_int("hidden", hidden)
        if dtype not in (torch.bfloat16, *check.FP8_DTYPES):
            raise TypeError(f"get_next_dispatch_buffer: dtype must be torch.bfloat16 or one of {check.FP8_DTYPES}, "
                            f"got {dtype}")
        check.hidden(hidden, fp8=dtype != torch.bfloat16)
        return backend.get_next_dispatch_buffer(num_tokens, hidden, dtype)

    def get_next_combine_buffer(self, handle: DispatchHandle, hidden: Optional[int] = None) -> torch.Tensor:
        """A [num_recv_rows, hidden] bf16 tensor (hidden: the dispatch's by default) to write the expert outputs
        of `handle`'s rows into, then pass as `combine`'s x (the normal-mode analogue of
        `get_next_low_latency_combine_buffer`). Over the intranode kernels it is a view of this Buffer: the
        combine reads the rows there instead of first copying them in (one pass over them instead of two).
        Every rank calls it after its dispatch and before its combine; it waits (on the GPU) until every peer
        has finished reading this Buffer's last op."""
        backend = self._live()
        handle = self._inner(handle)
        check.dispatch_handle(handle, self._ctx.uid)
        hidden = handle.hidden if hidden is None else check.positive_int("hidden", hidden)
        check.hidden(hidden, fp8=False)
        return backend.get_next_combine_buffer(handle, hidden)

    # ---- low-latency mode ---------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        check.low_latency(self._ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._live().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @collective_op("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send each (token, expert) pair to the expert's rank, packed per local expert.

        Returns (recv_x, recv_count, handle, event, hook) as DeepEP; recv_x is (fp8, scales) with use_fp8.
        Rows [0, recv_count[e]) of expert e hold one block per source rank, contiguous and in that rank's
        token order; handle.layout_range[e][s] = begin << 32 | count says where each block starts. The
        blocks' order is the order the sources reserved their rows (the LL kernels, as in DeepEP) or the
        source order (reference transport; nvlink with DEEPEP_PORTABLE_LL_VMM=0). With the LL kernels
        recv_x is a view of this Buffer's memory (the peers write it directly; not with
        DEEPEP_PORTABLE_LL_VMM=0): as DeepEP warns, at most two LL results are valid at a time; the
        next dispatch on the same buffer half (normally the next dispatch when dispatches and combines
        alternate) overwrites it. Copy it to keep it longer."""
        backend = self._live()
        check.tensor("x", x, torch.bfloat16, (None, None), self.device)
        num_tokens, hidden = x.shape
        check.low_latency(self._ctx, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank}")
        check.tensor("topk_idx", topk_idx, topk_idx_t, (num_tokens, None), self.device)
        check.topk_width(topk_idx)
        check.expert_indices("topk_idx", topk_idx, num_experts)
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0=True needs use_fp8=True and round_scale=True")
        if use_ue8m0 and (hidden // 128) % 4 != 0:
            raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden/128 ({hidden // 128}) must be divisible by 4")
        num_local_experts = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            check.tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
                         (num_local_experts,), self.device)
        if dispatch_wait_recv_cost_stats is not None:
            check.tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64,
                         (self.group_size,), self.device)
        args = LowLatencyDispatchArgs(x=x, topk_idx=topk_idx,
                                      num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                      num_experts=num_experts,
                                      cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                                      dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
                                      use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                      return_recv_hook=return_recv_hook, num_sms=type(self).num_sms)
        result: list = [x, topk_idx]
        with self._op(None, async_finish, False, result):
            res = backend.low_latency_dispatch(args)
            result += [res.recv_x, res.recv_x_scales, res.recv_count]
        out_x = (res.recv_x, res.recv_x_scales) if use_fp8 else res.recv_x
        return out_x, res.recv_count, res.handle, result[0], res.hook

    @collective_op("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Weighted sum of each token's expert outputs. Returns (combined_x, event, hook)."""
        backend = self._live()
        handle = check.low_latency_handle(handle)
        T, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        check.low_latency(self._ctx, T, hidden, num_experts)
        if use_logfmt:
            logfmt_chunk(hidden)   # hidden % 512 == 0, or a ValueError naming it
            if zero_copy:
                raise ValueError("use_logfmt=True cannot be combined with zero_copy=True (as in DeepEP): the "
                                 "rows are encoded on the way out")
        num_local_experts = num_experts // self.group_size
        check.tensor("x", x, torch.bfloat16, (num_local_experts, self.group_size * T, hidden), self.device)
        check.tensor("topk_idx", topk_idx, topk_idx_t, (None, None), self.device)
        num_tokens, num_topk = topk_idx.shape
        check.topk_width(topk_idx)
        if num_tokens > T:
            raise ValueError(f"topk_idx has {num_tokens} tokens, more than the handle's maximum {T}")
        check.expert_indices("topk_idx", topk_idx, num_experts)
        check.tensor("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk), self.device)
        if out is not None:
            check.tensor("out", out, torch.bfloat16, (num_tokens, hidden), self.device)
        if combine_wait_recv_cost_stats is not None:
            check.tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64,
                         (self.group_size,), self.device)
        args = LowLatencyCombineArgs(x=x, topk_idx=topk_idx, topk_weights=topk_weights, handle=handle,
                                     zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out,
                                     combine_wait_recv_cost_stats=combine_wait_recv_cost_stats,
                                     num_sms=type(self).num_sms, use_logfmt=bool(use_logfmt))
        result: list = [x, topk_idx, topk_weights]
        with self._op(None, async_finish, False, result):
            combined_x, hook = backend.low_latency_combine(args)
            result.append(combined_x)
        return combined_x, result[0], hook

    # ---- shrink mode (enable_shrink=True): ranks the low-latency ops leave out ------------------------
    def _mask(self) -> torch.Tensor:
        mask = self._live().shrink_mask()
        if mask is None:
            raise RuntimeError("the mask buffer needs a Buffer created with enable_shrink=True")
        # The kernels write it on the comm stream (a peer that timed out): order the caller's stream after.
        if self._comm_stream is not None:
            torch.cuda.current_stream().wait_stream(self._comm_stream)
        return mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask a rank for the low-latency ops of this Buffer: a masked rank is neither
        sent to nor waited for, and its rows count as absent. Unmasking takes a rank back only if it made
        the same low-latency calls as every other rank meanwhile (clean_low_latency_buffer on every rank,
        it included, resets the calls)."""
        check.positive_int("rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask must be < {self.group_size}, got {rank_to_mask}")
        self._mask()[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write every rank's mask status (1 = masked) into `mask_status` (int32 [num_ranks])."""
        check.tensor("mask_status", mask_status, torch.int32, (self.group_size,), self.device)
        mask_status.copy_(self._mask())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._mask().zero_()

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        handle = check.low_latency_handle(handle)
        check.low_latency(self._ctx, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        return self._live().get_next_low_latency_combine_buffer(handle)

def _flatten(items: List) -> List:
    out = []
    for t in items:
        if isinstance(t, (tuple, list)):
            out.extend(_flatten(list(t)))
        elif t is not None:
            out.append(t)
    return out
