"""`ElasticBuffer`: DeepEP V2's expert-parallel API (`deep_ep.ElasticBuffer`) over our V1 `Buffer`.

Same constructor, methods, defaults and return tuples as V2. It holds one V1 `Buffer` (`runtime`) and
composes its public calls, so it runs on every transport that Buffer runs on: a V2 dispatch is V1's
get_dispatch_layout + dispatch, then V2's receive layout built from the result (elastic_handle.py); a V2
combine is V1's combine after folding V2's inputs back into V1's rows.

Where V2 differs from V1, V2's behaviour is implemented on top:
  - the layout is folded into `dispatch` (top-k in, no per-rank counts);
  - `num_max_tokens_per_rank` bounds every rank's tokens; without CPU sync (`do_cpu_sync=False`, and every
    cached dispatch) outputs have the worst case's rows (num_ranks * num_max_tokens_per_rank, or
    elastic_handle.worst_case_expanded_rows), real rows first, so shapes never depend on the routing
    (CUDA graphs); the count of real rows is `handle.psum_num_recv_tokens_per_scaleup_rank[-1]`;
  - the expanded layout (`do_expand`), V2's handle fields, `previous_event_before_epilogue`, TMA-aligned
    column-major scales, `cumulative_local_expert_recv_stats`;
  - `combine` takes the combined top-k weight of position k from the rank holding expert k only.
What differs from V2, and why:
  - rows arrive ordered by source rank then source token in every mode (V1's order), so every output is
    deterministic whatever `deterministic` says;
  - `recv_topk_weights` (plain layout) holds 0 at positions choosing another rank's expert (V2 copies every
    weight; its own test compares only this rank's positions): V1 moves only this rank's weights;
  - `num_sms=0` uses V1's SM budget (`Buffer.num_sms`, `Buffer.set_num_sms`) rather than
    `get_theoretical_num_sms`: ranks sharing a GPU need grids that fit side by side;
  - reductions follow V1's order (bias, then the ranks' rows in rank order; nodes first over several
    nodes), not V2's top-k order: equal within bf16 rounding, bit-exact against tests/oracle.py;
  - `num_qps`, `num_allocated_qps`, `sl_idx`, `allow_multiple_reduction` and `allow_hybrid_mode` do not
    change the route: the transport's own options set queue pairs and service levels
    (`transport_options`); `allow_hybrid_mode` sets the logical domain V2 reports;
  - `barrier` is a host barrier after the chosen stream's work (V2's is stream-ordered);
  - Engram, pipeline-parallel send/recv and all-gather/reduce-scatter sessions raise NotImplementedError.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional, Tuple, Union

import torch

from .. import _validate as check
from ..buffer import Buffer, topk_idx_t
from ..comm import Comm
from ..engines.handle_kernel import handle_fields
from ..elastic_handle import (EPHandle, build_handle, column_major_scales, expand_rows, expand_weights,
                              gather_expanded_weights, reduce_expanded, worst_case_expanded_rows)
from ..internode_layout import internode_rdma_bytes
from ..layout import HINT_TOPK, normal_buffer_bytes
from ..topology import NodeLayout, node_layout
from ..event import EventOverlap as BufferEventOverlap
from ..failures import refused_before
from ..utils.event import EventHandle, EventOverlap

BUFFER_ALIGNMENT = 2 << 20     # V2 sizes buffers in 2 MiB steps
NOMINAL_NVLINK_GBS = 450.0     # one direction of an H100/H200 NVLink domain, when the caller gives none
NOMINAL_RDMA_GBS = 50.0        # one 400 Gb/s NIC per GPU, when the caller gives none
QPS_DIRECT, QPS_HIERARCHICAL = 17, 129


def get_physical_domain_size(group) -> Tuple[int, int]:
    """Collective: (nodes, ranks per node) of `group` (V2's (RDMA ranks, NVLink ranks))."""
    nodes = node_layout(Comm(group))
    return nodes.num_nodes, nodes.ranks_per_node


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """Collective: V2's (scale-out ranks, scale-up ranks): the physical domain with hybrid mode, else one
    scale-up domain of every rank."""
    num_nodes, per_node = get_physical_domain_size(group)
    return (num_nodes, per_node) if allow_hybrid_mode else (1, num_nodes * per_node)


def _bytes_for(nodes: NodeLayout, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
    """Buffer bytes for calls of up to num_max_tokens_per_rank tokens (BF16 or FP8) of `hidden`, top-k up to
    num_topk (0: up to HINT_TOPK), rounded up to 2 MiB."""
    check.positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    check.positive_int("hidden", hidden)
    check.positive_int("num_topk", num_topk, minimum=0)
    topk = num_topk or HINT_TOPK
    if nodes.num_nodes > 1:
        size = internode_rdma_bytes(hidden * 2, nodes.num_ranks, num_max_tokens_per_rank, nodes.ranks_per_node, topk)
    else:
        size = normal_buffer_bytes(num_max_tokens_per_rank, hidden * 2, nodes.num_ranks, topk)
    return (size + BUFFER_ALIGNMENT - 1) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT


def _not_implemented(feature: str):
    raise NotImplementedError(f"{feature} is not implemented by deepep_portable's ElasticBuffer (dispatch and "
                              f"combine are)")


# V2's methods of the features this ElasticBuffer does not implement (any arguments: they raise).
UNSUPPORTED = {
    "Engram": ("engram_write", "engram_fetch", "get_engram_storage_size_hint"),
    "Pipeline-parallel send/recv (PP)": ("pp_set_config", "pp_send", "pp_recv", "get_pp_buffer_size_hint"),
    "All-gather/reduce-scatter (AGRS)": ("create_agrs_session", "destroy_agrs_session", "agrs_new_session",
                                         "agrs_set_config", "agrs_get_inplace_tensor", "all_gather",
                                         "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint"),
}


def _unsupported(feature: str, name: str):
    def method(*args, **kwargs):
        _not_implemented(f"{feature} ({name})")
    method.__name__ = method.__qualname__ = name
    return method


def cuda_event(event) -> Optional[torch.cuda.Event]:
    """The torch event inside an EventHandle / EventOverlap (None: complete already)."""
    while isinstance(event, (EventHandle, BufferEventOverlap)):
        event = event.event
    return event


class StreamOrder:
    """How one ElasticBuffer op is ordered against the caller's stream. `overlapped`: whether it is ordered
    by events on the comm stream; `buffer_args`: the ordering arguments of its next V1 call.

    V2's arguments (`previous_event`, `previous_event_before_epilogue`, `async_with_compute_stream`,
    `allocate_on_comm_stream`) map onto V1's (`previous_event`, `async_finish`, `allocate_on_comm_stream`) as
    follows. Without any of them, or without CUDA, an op is plain: V1's calls run as the caller would make
    them and the work of ours runs on the current stream. Otherwise the op is overlapped: the comm stream first
    waits for `previous_event` (else for the current stream as it is now), each V1 call is `async_finish` and
    waits for the previous one's event, the work of ours runs on the comm stream after them, and the op ends
    with an event on the comm stream, returned (async) or waited for by the caller's stream. V1 asks for
    `allocate_on_comm_stream` only with both of the others, V2 allows it alone: here it is always given both.
    """

    def __init__(self, comm_stream: Optional[torch.cuda.Stream], previous_event, previous_event_before_epilogue,
                 async_with_compute_stream: bool, allocate_on_comm_stream: bool) -> None:
        for name, event in (("previous_event", previous_event),
                            ("previous_event_before_epilogue", previous_event_before_epilogue)):
            if event is not None and not isinstance(event, (EventHandle, BufferEventOverlap)):
                raise TypeError(f"{name} must be an EventHandle (ElasticBuffer.capture()), got {type(event).__name__}")
        self.comm = comm_stream
        self.before_epilogue = previous_event_before_epilogue
        self.async_with_compute_stream = bool(async_with_compute_stream)
        self.allocate_on_comm_stream = bool(allocate_on_comm_stream)
        self.overlapped = comm_stream is not None and (
            previous_event is not None or previous_event_before_epilogue is not None
            or self.async_with_compute_stream or self.allocate_on_comm_stream)
        self.buffer_args: dict = {}
        if self.overlapped:
            self.compute = torch.cuda.current_stream()
            start = cuda_event(previous_event)
            if start is None:
                start = torch.cuda.Event()
                start.record(self.compute)
            self.buffer_args = dict(previous_event=BufferEventOverlap(start), async_finish=True,
                                    allocate_on_comm_stream=self.allocate_on_comm_stream)

    def after(self, event: BufferEventOverlap) -> None:
        """The next V1 call waits for `event` (the last V1 call's)."""
        if self.overlapped:
            self.buffer_args["previous_event"] = event

    def wait_before_epilogue(self) -> None:
        """On the comm stream: wait for previous_event_before_epilogue before the work that follows."""
        if self.overlapped and self.before_epilogue is not None:
            self.comm.wait_event(cuda_event(self.before_epilogue))

    @contextlib.contextmanager
    def on_comm_stream(self, produced: list, consumed: tuple = (), outputs_on_comm: Optional[bool] = None):
        """Run the body (our work) on the comm stream after what `buffer_args` waits for: the caller's tensors
        it reads (`consumed`) stay allocated until it ran; the tensors it appends to `produced` are protected
        for the caller's stream unless they are to be owned by the comm stream (`outputs_on_comm`, default
        allocate_on_comm_stream). Then the next V1 call waits for the body. Plain ops: the body runs as is."""
        if not self.overlapped:
            yield
            return
        self.comm.wait_event(self.buffer_args["previous_event"].event)
        for t in consumed:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.comm)
        with torch.cuda.stream(self.comm):
            yield
        if not (self.allocate_on_comm_stream if outputs_on_comm is None else outputs_on_comm):
            for t in produced:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.compute)
        done = torch.cuda.Event()
        done.record(self.comm)
        self.buffer_args["previous_event"] = BufferEventOverlap(done)

    def finish(self) -> EventOverlap:
        """V2's returned event: on the comm stream after everything (async), else the caller's stream has
        waited for it and the event is None."""
        if not self.overlapped:
            return EventOverlap(None)
        event = self.buffer_args["previous_event"].event
        if self.async_with_compute_stream:
            return EventOverlap(EventHandle.wrapping(event))
        self.compute.wait_event(event)
        return EventOverlap(None)


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer (expert-parallel dispatch and combine); see the module docstring.

    Ours, keyword-only: transport, ranks_per_node, transport_options (and its deprecated aliases
    nvshmem_options, ibgda_options, nccl_options), as V1's `Buffer`. `group` may also be an mpi4py communicator. `num_gpu_timeout_secs` bounds every wait
    (V1's timeout_s); `num_cpu_timeout_secs` is kept for V2 callers (no separate CPU wait here).
    """

    def __init__(self, group, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, transport: str = "auto", ranks_per_node: Optional[int] = None,
                 transport_options: Optional[dict] = None, nvshmem_options: Optional[dict] = None, ibgda_options: Optional[dict] = None,
                 nccl_options: Optional[dict] = None) -> None:
        if num_cpu_bytes:
            _not_implemented("Engram CPU storage (num_cpu_bytes)")
        check.positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0)
        check.positive_int("num_allocated_qps", num_allocated_qps, minimum=0)
        check.positive_int("num_gpu_timeout_secs", num_gpu_timeout_secs)
        check.positive_int("num_cpu_timeout_secs", num_cpu_timeout_secs)
        if num_bytes is None and (num_max_tokens_per_rank == 0 or hidden == 0):
            raise ValueError("ElasticBuffer needs num_bytes, or num_max_tokens_per_rank and hidden to size it")
        nodes = node_layout(Comm(group), ranks_per_node)   # collective, before the Buffer's own set-up
        if num_bytes is None:
            num_bytes = _bytes_for(nodes, num_max_tokens_per_rank, hidden, num_topk)
        check.positive_int("num_bytes", num_bytes)
        self.group = group
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = bool(deterministic)
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.sl_idx = sl_idx
        self.num_allocated_qps = num_allocated_qps or (QPS_HIERARCHICAL if self.allow_hybrid_mode else QPS_DIRECT)
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        # Over several nodes the internode engine's window (num_rdma_bytes) is the one allocated.
        self.runtime: Optional[Buffer] = Buffer(
            group, num_bytes, num_bytes if nodes.num_nodes > 1 else 0, explicitly_destroy=explicitly_destroy,
            transport=transport, timeout_s=float(num_gpu_timeout_secs), ranks_per_node=ranks_per_node,
            transport_options=transport_options, nvshmem_options=nvshmem_options, ibgda_options=ibgda_options,
            nccl_options=nccl_options)
        self.rank_idx, self.num_ranks = self.runtime.rank, self.runtime.group_size
        self.num_rdma_ranks, self.num_nvlink_ranks = self.runtime.nodes.num_nodes, self.runtime.nodes.ranks_per_node
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self._num_sms_estimates: dict = {}

    # ---- lifetime, domains, streams ------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffer (needs explicitly_destroy=True)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs the ElasticBuffer to be created with explicitly_destroy=True")
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    def _live(self) -> Buffer:
        if self.runtime is None:
            raise RuntimeError("this ElasticBuffer was destroyed")
        return self.runtime

    def get_physical_domain_size(self) -> Tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        if self.allow_hybrid_mode:
            return self.num_rdma_ranks, self.num_nvlink_ranks
        return 1, self.num_ranks

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (for `previous_event=`)."""
        return EventHandle()

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The stream the ops run on (None without CUDA)."""
        return self._live().get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank waits until every rank's work so far on the communication stream (or, with
        use_comm_stream=False, the current stream) is done: a host barrier (V2's is stream-ordered; ours
        blocks the CPU, which is stronger). with_cpu_sync: the whole device is synchronized before and after.
        `sequential` is accepted for V2 callers (one barrier either way)."""
        runtime = self._live()
        if torch.cuda.is_available():
            if with_cpu_sync:
                torch.cuda.synchronize()
            stream = runtime.get_comm_stream() if use_comm_stream else torch.cuda.current_stream()
            if stream is not None:
                stream.synchronize()
        Comm(runtime.group).barrier()
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    # ---- sizing ------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Collective over `group`: num_bytes for calls of up to num_max_tokens_per_rank tokens of `hidden`
        (BF16 or FP8; the FP8 flag does not change it) with top-k up to num_topk (0: up to 32), in 2 MiB steps."""
        return _bytes_for(node_layout(Comm(group)), num_max_tokens_per_rank, hidden, num_topk)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """SMs that keep the links busy for a balanced gate (uniformly random, distinct top-k experts).

        The model: a token goes to D distinct ranks on average, D = R * (1 - C(E - E/R, k) / C(E, k)), so an
        op moves D rows per token over the links (the dispatch's payload, the combine's back). The links move
        T bytes/s: NVLink (nvlink_gbs, 450 when 0) to the ranks of this node, RDMA (rdma_gbs, 50 when 0) to
        other nodes, whichever is the bottleneck for the share of destinations each serves. Per byte on the
        links the SMs read 1/D byte of a token (read once, sent D times) at sm_read_gbs and write 1 byte at
        sm_write_gbs per SM. SMs = 1.25 * T * max((1/D) / sm_read_gbs, 1 / sm_write_gbs), even, at least 4 (at
        least 64 with prefer_overlap_with_compute=False), at most the device's. Cached per arguments.

        Our kernels against it (docs/INTRANODE.md): the dispatch stages each token once (1/D of the link bytes,
        read and written), then the receivers' SMs pull every row over the links into the output (1 byte read,
        1 written per link byte); the combine stages the received rows and each source pulls them back. So an
        SM's work per link byte is about (1 + 1/D) bytes each way, which the rates a caller passes should fold
        in: a per-SM rate measured as the op's payload bytes (its logical bytes, DeepEP's convention) per
        second per SM does, and is what `bench --num-sms` sweeps feed in as sm_write_gbs (the time one more
        block saves, so the fixed part of an op drops out), with the sweep's ceiling as nvlink_gbs (at EP 8,
        top-8 of 256, the read term is a twentieth of the write term at 50 GB/s per SM). The defaults are
        V2's nominal rates, not measurements of ours. With the rates measured between two H200s over NVLink
        (docs/PERFORMANCE.md: 390 GB/s a direction, 21.2 GB/s per block for the dispatch, 23.6 for the
        combine, an older form of the kernels) the model gives 24 and 22 SMs at EP 8, top-8 of 256; with the
        defaults, 12."""
        key = (num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)
        if key in self._num_sms_estimates:
            return self._num_sms_estimates[key]
        check.num_experts(num_experts, self.num_ranks)
        check.positive_int("num_topk", num_topk)
        if num_scaleout_topk != 0:
            raise ValueError("num_scaleout_topk must be 0 (the model assumes a balanced gate)")
        if num_topk > num_experts:
            raise ValueError(f"num_topk ({num_topk}) cannot exceed num_experts ({num_experts})")
        per_rank = num_experts // self.num_ranks
        distinct = self.num_ranks * (1 - math.comb(num_experts - per_rank, num_topk) / math.comb(num_experts, num_topk))
        nvlink = nvlink_gbs or NOMINAL_NVLINK_GBS
        rdma = rdma_gbs or NOMINAL_RDMA_GBS
        local_share = self.num_nvlink_ranks / self.num_ranks
        seconds_per_byte = max(local_share / nvlink, (1 - local_share) / rdma)
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
            if torch.cuda.is_available() else None
        if self.num_ranks == 1:
            num_sms = device_sms or 4
        else:
            link_bytes = 1 / seconds_per_byte
            num_sms = 1.25 * link_bytes * max((1 / distinct) / sm_read_gbs, 1 / sm_write_gbs)
            num_sms = max(4, math.ceil(num_sms))
            num_sms += num_sms % 2
            if not self.prefer_overlap_with_compute:
                num_sms = max(num_sms, 64)
        if device_sms is not None:
            num_sms = min(num_sms, device_sms)
        self._num_sms_estimates[key] = num_sms
        return num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs for a kernel of num_sms SMs: with hybrid mode one per channel (16 per SM) plus one for
        the count exchange, else one per SM up to 8 plus one (fewer doorbells); at most num_allocated_qps."""
        check.positive_int("num_sms", num_sms)
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8) + 1
        return min(num_qps, self.num_allocated_qps)

    def _config(self, num_sms: int, combine: bool):
        if num_sms == 0:
            return None   # V1's default: Buffer.num_sms
        make = Buffer.get_combine_config if combine else Buffer.get_dispatch_config
        return dataclasses.replace(make(self.num_ranks), num_sms=num_sms)

    # ---- dispatch / combine ------------------------------------------------------------------
    @refused_before("dispatch", lambda self: self.runtime)   # its first collective op: Buffer.dispatch
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token to the ranks holding its top-k experts (V2's semantics; see the module docstring).

        Returns (recv_x or (recv_x, recv_sf), recv_topk_idx (None when expanded), recv_topk_weights (None
        without topk_weights; [rows] when expanded), handle, event). With `handle` (cached): the same
        routing again for new x (and optionally topk_weights), the handle returned as it is.
        cumulative_local_expert_recv_stats counts a fresh dispatch's tokens (a cached one repeats a routing)."""
        runtime = self._live()
        data, scales = check.dispatch_x(x, runtime.device)
        num_tokens = data.size(0)
        device = runtime.device
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be the EPHandle of an ElasticBuffer dispatch, got "
                                f"{type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx: the handle's is used")
            if do_cpu_sync:
                raise ValueError("a cached dispatch cannot do a CPU sync (its sizes come from the handle)")
            for name, given, cached in (("num_experts", num_experts, handle.num_experts),
                                        ("expert_alignment", expert_alignment, handle.expert_alignment),
                                        ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                         handle.num_max_tokens_per_rank)):
                if given is not None and given != cached:
                    raise ValueError(f"{name}={given} differs from the handle's {cached}")
            if bool(do_expand) != handle.do_expand:
                raise ValueError(f"do_expand={bool(do_expand)} differs from the handle's dispatch ({handle.do_expand})")
            if num_tokens != handle.topk_idx.size(0):
                raise ValueError(f"x has {num_tokens} tokens, the handle's dispatch had {handle.topk_idx.size(0)}")
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank, do_cpu_sync = handle.num_max_tokens_per_rank, False
            num_topk = handle.topk_idx.size(1)
        else:
            if topk_idx is None:
                raise ValueError("dispatch needs topk_idx (or a cached handle)")
            if num_experts is None:
                raise ValueError("dispatch needs num_experts (or a cached handle)")
            check.num_experts(num_experts, self.num_ranks)
            check.tensor("topk_idx", topk_idx, topk_idx_t, (num_tokens, None), device)
            num_topk = check.topk_width(topk_idx)
            num_max_tokens_per_rank = num_max_tokens_per_rank if num_max_tokens_per_rank is not None \
                else self.num_max_tokens_per_rank
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        if topk_weights is not None:
            check.tensor("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk), device)
        check.positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
        if num_tokens > num_max_tokens_per_rank:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}")
        check.positive_int("expert_alignment", expert_alignment)
        num_local_experts = num_experts // self.num_ranks
        if cumulative_local_expert_recv_stats is not None:
            check.tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
                         (num_local_experts,), device)
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding needs do_expand=True (it zeroes the expanded layout's padding)")
        self._check_sms_qps(num_sms, num_qps)
        order = StreamOrder(runtime.get_comm_stream(), previous_event, previous_event_before_epilogue,
                            async_with_compute_stream, allocate_on_comm_stream)

        x_in = (data, scales) if scales is not None else data
        config = self._config(num_sms, combine=False)
        sent_weights = None
        if handle is None:
            per_rank, per_node, per_expert, in_rank, event = runtime.get_dispatch_layout(topk_idx, num_experts,
                                                                                         **order.buffer_args)
            order.after(event)
            weights = topk_weights if topk_weights is not None else \
                torch.zeros(topk_idx.shape, dtype=torch.float32, device=device)
            num_worst = 0 if do_cpu_sync else num_max_tokens_per_rank * self.num_ranks
            recv_x, recv_topk_idx, recv_w, per_expert_list, buffer_handle, event = runtime.dispatch(
                x_in, None, per_rank, per_node, in_rank, per_expert, topk_idx, weights, expert_alignment, num_worst,
                config, **order.buffer_args)
            recv_w = recv_w if topk_weights is not None else None
        else:
            recv_x, _, _, _, _, event = runtime.dispatch(x_in, handle.buffer_handle, config=config, **order.buffer_args)
            if topk_weights is not None:   # V1's cached dispatch moves payload only: the weights go as bytes
                order.after(event)
                sent_weights, event = self._cached_weights(handle, topk_weights, config, order.buffer_args)
        order.after(event)
        recv_data, recv_sf = recv_x if scales is not None else (recv_x, None)
        produced: list = []
        with order.on_comm_stream(produced):
            order.wait_before_epilogue()
            if handle is None:
                num_expanded = sum(per_expert_list) if do_cpu_sync else worst_case_expanded_rows(
                    self.num_ranks, num_max_tokens_per_rank, num_topk, num_local_experts, expert_alignment)
                keep = topk_idx.clone() if do_handle_copy else topk_idx
                new_handle = build_handle(
                    buffer_handle, recv_topk_idx, topk_idx, rank=self.rank_idx,
                    num_scaleup_ranks=self.num_scaleup_ranks, num_experts=num_experts,
                    expert_alignment=expert_alignment, num_max_tokens_per_rank=num_max_tokens_per_rank,
                    num_sms=num_sms or Buffer.num_sms, do_expand=bool(do_expand), num_expanded_tokens=num_expanded,
                    num_recv_tokens_per_expert_list=list(per_expert_list), keep_topk_idx=keep, kernel=handle_fields)
                if cumulative_local_expert_recv_stats is not None:
                    cumulative_local_expert_recv_stats.add_(new_handle.num_unaligned_recv_tokens_per_expert)
            else:
                new_handle = handle
                recv_topk_idx = None if handle.do_expand else handle.recv_topk_idx.clone()
                recv_w = None if sent_weights is None else torch.where(
                    handle.row_slots >= 0, sent_weights, torch.zeros((), dtype=torch.float32, device=device))
            if do_expand:
                slots, rows = new_handle.row_slots, new_handle.num_expanded_tokens
                recv_data = expand_rows(recv_data, slots, rows, do_zero_padding)
                recv_sf = None if recv_sf is None else expand_rows(recv_sf, slots, rows, do_zero_padding)
                recv_w = None if recv_w is None else expand_weights(recv_w, slots, rows, do_zero_padding)
                recv_topk_idx = None
            if recv_sf is not None and use_tma_aligned_col_major_sf:
                recv_sf = column_major_scales(recv_sf)
            produced += [recv_data, recv_sf, recv_topk_idx, recv_w, new_handle.recv_src_metadata,
                         new_handle.psum_num_recv_tokens_per_scaleup_rank, new_handle.psum_num_recv_tokens_per_expert,
                         new_handle.num_unaligned_recv_tokens_per_expert, new_handle.dst_buffer_slot_idx,
                         new_handle.topk_idx]
        out_x = (recv_data, recv_sf) if recv_sf is not None else recv_data
        return out_x, recv_topk_idx, recv_w, new_handle, order.finish()

    def _cached_weights(self, handle: EPHandle, topk_weights: torch.Tensor, config, chain: dict):
        """topk_weights along a cached dispatch: float32 rows (padded to 16 bytes) travel as BF16 payload,
        which every transport moves bit for bit. Returns ([rows, num_topk] float32, event)."""
        num_tokens, num_topk = topk_weights.shape
        width = (num_topk + 3) // 4 * 4
        packed = torch.zeros((num_tokens, width), dtype=torch.float32, device=topk_weights.device)
        packed[:, :num_topk] = topk_weights
        recv, _, _, _, _, event = self._live().dispatch(packed.view(torch.bfloat16), handle.buffer_handle,
                                                        config=config, **chain)
        return recv.view(torch.float32)[:, :num_topk], event

    def _check_sms_qps(self, num_sms: int, num_qps: int) -> None:
        check.positive_int("num_sms", num_sms, minimum=0)
        check.positive_int("num_qps", num_qps, minimum=0)
        if num_qps > self.num_allocated_qps:
            raise ValueError(f"num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps}")

    @refused_before("combine", lambda self: self.runtime)   # its first collective op: Buffer.combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Sum each token's rows back on its source rank, plus bias (one tensor or two), no weights applied.

        x: [handle.num_recv_tokens, hidden] bf16 (expanded: [handle.num_expanded_tokens, hidden], summed per
        token first). topk_weights: [rows, num_topk] float32 (expanded: [rows]); position k of the combined
        weights comes from the rank holding expert k. Returns (combined_x [num_tokens, hidden] bf16,
        combined_topk_weights [num_tokens, num_topk] or None, event)."""
        runtime = self._live()
        device = runtime.device
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be the EPHandle of an ElasticBuffer dispatch, got {type(handle).__name__}")
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        check.tensor("x", x, torch.bfloat16, (rows, None), device)
        check.hidden(x.size(1), fp8=False)
        num_topk = handle.topk_idx.size(1)
        if topk_weights is not None:
            check.tensor("topk_weights", topk_weights, torch.float32, (rows,) if handle.do_expand else (rows, num_topk),
                         device)
        bias_0, bias_1 = check.unpack_bias(bias)
        for name, b in (("bias[0]", bias_0), ("bias[1]", bias_1)):
            if b is not None:
                check.tensor(name, b, torch.bfloat16, (handle.topk_idx.size(0), x.size(1)), device)
        self._check_sms_qps(num_sms, num_qps)
        order = StreamOrder(runtime.get_comm_stream(), previous_event, previous_event_before_epilogue,
                            async_with_compute_stream, allocate_on_comm_stream)
        # Fold V2's inputs into V1's rows on the comm stream; what it allocates stays there (V1 reads it there).
        with order.on_comm_stream([], consumed=(x, topk_weights), outputs_on_comm=True):
            slots = handle.row_slots
            if handle.do_expand:
                x = reduce_expanded(x, slots)
                weights = None if topk_weights is None else gather_expanded_weights(topk_weights, slots)
            else:
                weights = None if topk_weights is None else torch.where(
                    slots >= 0, topk_weights, torch.zeros((), dtype=torch.float32, device=device))
            order.wait_before_epilogue()   # V1's combine is one op: its reduction cannot start later than it
        combined_x, combined_w, event = runtime.combine(x, handle.buffer_handle, weights, bias,
                                                        self._config(num_sms or handle.num_sms, combine=True),
                                                        **order.buffer_args)
        order.after(event)
        return combined_x, combined_w, order.finish()


for _feature, _names in UNSUPPORTED.items():
    for _name in _names:
        setattr(ElasticBuffer, _name, staticmethod(_unsupported(_feature, _name)))
