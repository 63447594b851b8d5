"""The Python side of the transport contract: what every backend implements for `Buffer`, and the
records that travel between them (the device side is csrc/common/kernels/transport.cuh).

`Buffer` validates arguments, picks streams, allocates nothing itself and then calls exactly one of
these methods. A backend allocates its outputs with the *current* torch stream (Buffer makes the
right stream current) and enqueues device work on `ctx.comm_stream` (None on the CPU). A backend that
does its work synchronously (the reference) must have finished all of it, on every stream, when it
returns, so the events Buffer records on `ctx.comm_stream` stay truthful. All inputs arrive validated
(dtypes, shapes, devices, expert ranges), so backends never re-check them.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .comm import Comm
from .handles import DispatchHandle, LowLatencyHandle


NETWORKS = ("none", "infiniband", "roce", "other")   # transport::Network in csrc/common/kernels/transport.cuh


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a transport can do: the host mirror of transport::Capabilities (transport.cuh; each
    backend's device.cuh returns its record, tests/test_transports.py checks they agree).

    peer_load_store: every peer's window is reachable by loads and stores (NVLink, same GPU);
    remote_atomics: fetch_add reaches peers behind a network (the LL dispatch reserves its rows with it;
    P2P peers always have it); ordered_delivery: writes on
    one (channel, peer) arrive in order (never relied on); max_channels: channels set up;
    graph_safe: every op may be captured in a CUDA graph; network: what carries non-P2P traffic.
    Built by keyword only: the fields mirror a C struct, and a positional list would hide a swap."""

    peer_load_store: bool
    remote_atomics: bool
    ordered_delivery: bool
    max_channels: int
    graph_safe: bool
    network: str

    def as_dict(self) -> dict:
        return dict(peer_load_store=self.peer_load_store, remote_atomics=self.remote_atomics,
                    ordered_delivery=self.ordered_delivery, max_channels=self.max_channels,
                    graph_safe=self.graph_safe, network=self.network)


@dataclass
class TransportStatus:
    """Whether a transport can run in this process (`available_transports()`), and why not."""

    name: str
    usable: bool
    reason: str                                   # why not usable, or what it will use
    details: Dict[str, str] = field(default_factory=dict)   # versions, library paths, devices
    capabilities: Dict[str, object] = field(default_factory=dict)   # Capabilities.as_dict() of its backend

    def __str__(self) -> str:
        return f"{self.name}: {'usable' if self.usable else 'unusable'} ({self.reason})"

    def capabilities_in_short(self) -> str:
        """The capability record in a few words: the properties it has, its channels, its network."""
        caps = self.capabilities
        if not caps:
            return "-"
        words = [word for key, word in (("peer_load_store", "load/store"), ("remote_atomics", "atomics"),
                                        ("ordered_delivery", "ordered"), ("graph_safe", "graphs")) if caps.get(key)]
        if caps.get("max_channels", 1) != 1:
            words.append(f"{caps['max_channels']} channels")
        words.append(f"network {caps.get('network', '?')}")
        return ", ".join(words)


class TransportTable(dict):
    """What `available_transports()` returns: a dict of transport name -> `TransportStatus`, in the
    registry's order, that prints as an aligned table (name, usable, reason, capabilities in short); a long
    reason wraps inside its column."""

    REASON_WIDTH = 64

    def __str__(self) -> str:
        import textwrap

        head = ("transport", "usable", "reason", "capabilities")
        rows = [(name, "yes" if st.usable else "no", textwrap.wrap(st.reason, self.REASON_WIDTH) or [""],
                 st.capabilities_in_short()) for name, st in self.items()]
        w_name = max([len(head[0])] + [len(r[0]) for r in rows])
        w_usable = len(head[1])
        w_reason = max([len(head[2])] + [len(line) for r in rows for line in r[2]])
        lines = [f"{head[0]:<{w_name}}  {head[1]:<{w_usable}}  {head[2]:<{w_reason}}  {head[3]}"]
        for name, usable, reason, caps in rows:
            lines.append(f"{name:<{w_name}}  {usable:<{w_usable}}  {reason[0]:<{w_reason}}  {caps}".rstrip())
            lines.extend(f"{'':<{w_name}}  {'':<{w_usable}}  {more}".rstrip() for more in reason[1:])
        return "\n".join(lines)

    __repr__ = __str__   # the interpreter shows the table too


@dataclass
class BufferContext:
    """What a backend knows about the Buffer it serves."""

    comm: Comm
    rank: int
    num_ranks: int
    device: torch.device                 # cuda:N, or cpu for the reference transport without GPU
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    uid: int                             # unique per Buffer; stamped into handles
    timeout_s: float
    comm_stream: Optional[torch.cuda.Stream] = None   # where device work is enqueued (None on CPU)
    ranks_per_node: int = 0              # topology.NodeLayout; 0 = every rank in one node
    options: dict = field(default_factory=dict)
    tag: int = 1000                      # message tag of this Buffer's agreements (the same on every rank)
    calls: int = 0                       # collective ops begun, counted alike on every rank (failures.py)
    describe_error: Optional[Callable] = None   # the backend's own kernel error texts (registry row error_text)

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node if self.ranks_per_node else 1


@dataclass
class DispatchArgs:
    x: torch.Tensor                       # [N, H] bf16 or fp8
    x_scales: Optional[torch.Tensor]      # [N, S] fp32/int32 with fp8 x, else None
    topk_idx: Optional[torch.Tensor]      # [N, K] int64 global expert ids, -1 = none
    topk_weights: Optional[torch.Tensor]  # [N, K] fp32
    num_tokens_per_rank: torch.Tensor     # [R] int32
    is_token_in_rank: torch.Tensor        # [N, R] bool
    num_tokens_per_expert: torch.Tensor   # [E] int32
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int
    num_sms: int
    config: Any


@dataclass
class CachedDispatchArgs:
    """A dispatch that repeats the layout of an earlier one (its handle): only x (and scales) move."""

    x: torch.Tensor                       # [N, H] bf16 or fp8, N == handle.num_tokens
    x_scales: Optional[torch.Tensor]
    handle: DispatchHandle
    num_sms: int


@dataclass
class CombineArgs:
    x: torch.Tensor                       # [handle.num_recv_rows, H] bf16
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor]  # [handle.num_recv_rows, K] fp32
    bias_0: Optional[torch.Tensor]        # [N, H] bf16
    bias_1: Optional[torch.Tensor]
    num_sms: int


@dataclass
class DispatchResult:
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]       # local expert ids, -1 elsewhere
    recv_topk_weights: Optional[torch.Tensor]   # 0 where recv_topk_idx is -1
    num_recv_tokens_per_expert_list: List[int]  # empty with num_worst_tokens
    handle: DispatchHandle


@dataclass
class LowLatencyDispatchArgs:
    x: torch.Tensor                       # [N, H] bf16, N <= num_max_dispatch_tokens_per_rank
    topk_idx: torch.Tensor                # [N, K] int64
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    cumulative_local_expert_recv_stats: Optional[torch.Tensor]
    dispatch_wait_recv_cost_stats: Optional[torch.Tensor]
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    return_recv_hook: bool
    num_sms: int                          # the caller's SM budget (Buffer.num_sms)


@dataclass
class LowLatencyDispatchResult:
    recv_x: torch.Tensor                  # [E_local, R*T, H] bf16 or fp8
    recv_x_scales: Optional[torch.Tensor]  # [E_local, R*T, H/128] fp32 or [.., H/512] int32 (column-major)
    recv_count: torch.Tensor              # [E_local] int32
    handle: LowLatencyHandle
    hook: Optional[Callable[[], None]]    # receive phase when return_recv_hook, else None


@dataclass
class LowLatencyCombineArgs:
    x: torch.Tensor                       # [E_local, R*T, H] bf16
    topk_idx: torch.Tensor                # [N, K] int64
    topk_weights: torch.Tensor            # [N, K] fp32
    handle: LowLatencyHandle
    zero_copy: bool
    return_recv_hook: bool
    out: Optional[torch.Tensor]
    combine_wait_recv_cost_stats: Optional[torch.Tensor]
    num_sms: int                          # the caller's SM budget (Buffer.num_sms)
    use_logfmt: bool = False              # rows travel as LogFMT-10 (logfmt.py)


def scale_shape(num_local: int, slots: int, hidden: int, use_ue8m0: bool) -> Tuple[int, int, int]:
    """Storage shape [E_local, S, R*T] of the column-major scales (transpose(1, 2) is the API view);
    S = hidden/128 fp32 scales, or hidden/512 int32 words of four packed UE8M0 exponents."""
    cols = hidden // 128 // 4 if use_ue8m0 else hidden // 128
    return num_local, cols, slots


def allocate_low_latency_outputs(num_local: int, num_ranks: int, num_max_tokens: int, hidden: int,
                                 use_fp8: bool, use_ue8m0: bool, device: torch.device, with_recv_x: bool = True):
    """DeepEP's low-latency dispatch outputs, on the current stream, for every backend alike:
    (recv_x [E_local, R*T, H] fp8 or bf16 (None without with_recv_x: the kernels' recv_x is a view of
    their buffer), scales (column-major view) or None, recv_count [E_local], src_info [E_local, R*T],
    layout_range [E_local, R])."""
    slots = num_ranks * num_max_tokens
    scales = None
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    recv_x = torch.empty(num_local, slots, hidden, dtype=dtype, device=device) if with_recv_x else None
    if use_fp8:
        scales = torch.empty(scale_shape(num_local, slots, hidden, use_ue8m0),
                             dtype=torch.int32 if use_ue8m0 else torch.float32, device=device).transpose(1, 2)
    recv_count = torch.empty(num_local, dtype=torch.int32, device=device)
    src_info = torch.empty(num_local, slots, dtype=torch.int32, device=device)
    layout_range = torch.empty(num_local, num_ranks, dtype=torch.int64, device=device)
    return recv_x, scales, recv_count, src_info, layout_range


class Transport(abc.ABC):
    """One backend serving one Buffer."""

    name: str = "?"
    internode_normal: bool = False   # serves normal-mode ops over several nodes (docs/INTERNODE.md)
    # combine_eager(x, handle, topk_weights, num_sms) -> (out, out_topk_weights) or None: the combine's eager path
    # (IntranodeEngine.combine_eager), for arguments that passed _validate.combine_eager with nothing to overlap; None
    # returned sends the call through combine(). A backend without one leaves it None.
    combine_eager: Optional[Callable] = None
    capabilities: Capabilities = Capabilities(peer_load_store=False, remote_atomics=False, ordered_delivery=False,
                                              max_channels=1, graph_safe=False, network="none")

    def runtime_capabilities(self) -> Capabilities:
        """The record for this Buffer (a backend may know more once set up, e.g. which peers are P2P)."""
        return self.capabilities

    def __init__(self, ctx: BufferContext) -> None:
        self.ctx = ctx

    # ---- normal (high-throughput) mode --------------------------------------------------------
    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult: ...

    @abc.abstractmethod
    def cached_dispatch(self, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(recv_x, recv_x_scales) laid out as the handle's dispatch."""

    @abc.abstractmethod
    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(combined_x, combined_topk_weights or None)."""

    def get_next_dispatch_buffer(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Where the caller may write its tokens, [num_tokens, hidden] of dtype, to pass them as dispatch's x. A
        backend that can read them there in place (the intranode kernels) gives a view of its window; this
        default gives a fresh tensor (dispatch then copies as for any x)."""
        return torch.empty(num_tokens, hidden, dtype=dtype, device=self.ctx.device)

    def get_next_combine_buffer(self, handle: DispatchHandle, hidden: int) -> torch.Tensor:
        """Where the caller may write the expert outputs of `handle`'s rows, [num_recv_rows, hidden] bf16, to
        pass them as combine's x. A backend that can read them there in place (the intranode kernels) gives
        a view of its window; this default gives a fresh tensor (combine then copies as for any x)."""
        return torch.empty(handle.num_recv_rows, hidden, dtype=torch.bfloat16, device=self.ctx.device)

    # ---- low-latency mode ---------------------------------------------------------------------
    @abc.abstractmethod
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs) -> LowLatencyDispatchResult: ...

    @abc.abstractmethod
    def low_latency_combine(self, args: LowLatencyCombineArgs) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]: ...

    @abc.abstractmethod
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor: ...

    @abc.abstractmethod
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None: ...

    def shrink_mask(self) -> Optional[torch.Tensor]:
        """Shrink mode (Buffer(enable_shrink=True)): int32 [R] on the device, 1 = a rank the low-latency
        ops neither send to nor wait for, written by the kernels on the comm stream; None when this
        backend has no shrink mode (or it is off)."""
        return None

    # ---- when an op fails on some rank (failures.py, docs/RELIABILITY.md) --------------------------------
    def refuse(self, op: str, call: int, reason: str) -> None:
        """This rank refused call `call` of `op` before launching any of it (Buffer's checks or the backend's
        own): tell the peers that may be waiting for it, so that they end the same call with a named error
        instead of hanging or pairing it with this rank's next call. Returns when the Buffer works for the
        next op; raises a CommError when it cannot be used again (a peer ran the call). Default: a backend
        whose peers never wait for this rank (one rank)."""

    def failed(self, op: str, call: int, error: Exception) -> Exception:
        """Call `call` of `op` ended on this rank with `error` (a CommError: a kernel's record, a peer that never
        came): the exception Buffer raises instead (e.g. naming the peer's own failure that caused it). Unless
        it is a CommError with `usable`, the Buffer refuses every later op."""
        return error

    def synchronize(self) -> None:
        """Wait for this Buffer's work on the device; raise what failed there (a CommError). Default: a backend
        that finishes its work before each op returns."""

    @abc.abstractmethod
    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """uint8 [num_rdma_bytes or num_nvl_bytes] over this rank's raw buffer of that kind (no copy):
        Buffer.get_local_buffer_tensor. Ops may overwrite it, as in DeepEP."""

    def destroy(self) -> None:
        pass

    # ---- for the project's tools (bench, tests) ------------------------------------------------------
    def engine(self, mode: str):
        """The kernel engine serving `mode` ("normal" or "low_latency"), or None (no kernels: the
        reference). Tools read its grid, phase profile and trace; ops never go through this."""
        return None
