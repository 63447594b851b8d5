"""Host side of the low-latency (LL) kernels, the same for every transport that has a window.

`LowLatencyEngine` owns one LL buffer per rank (`num_rdma_bytes`; geometry in
layout.LowLatencyLayout, protocol in csrc/common/kernels/low_latency/protocol.cuh) on a window the
transport makes (windows.base.Window): it knows how to build the kernels for that transport (Window.kernel:
the backend's device header and Transport struct, see csrc/common/kernels/selected_transport.cuh) and fills
the struct the kernels take (Window.transport_params). The engine never asks which transport it serves: the
nvlink window (CUDA IPC / shareable VMM memory) and NVSHMEM's symmetric heap (kernels device-linked) look alike.

Every LL op is one *call*: a SEND phase, then a RECEIVE phase, both on `ctx.comm_stream` (Buffer
orders that stream against the caller's), run by one kernel name per op (`deepep_portable::low_latency::
dispatch` / `::combine`, the names a profiler shows). The dispatch is one kernel: without a hook one
launch runs both phases (its receive overlaps the peers' sends). The combine is compiled once per phase
(-DPHASE): without a hook its send and receive kernels launch back to back (combine.cu says why two
launches beat one there). The call counter that picks the buffer half and the signal values lives in
device memory, so CUDA-graph replays keep counting. With `return_recv_hook=True` the op launches the
send phase only and returns `hook`; calling it later does `comm_stream.wait_stream(current)`, launches
the receive phase on the comm stream, then `current.wait_stream(comm_stream)` (current = the torch
stream current when the hook is called). No kernel runs between the two phases.

Shrink mode (`enable_shrink`, DeepEP's): `mask` (int32 [R] on the device) names the ranks the kernels
neither send to nor wait for; a wait that times out masks its peer instead of failing
(csrc/common/kernels/low_latency/protocol.cuh). clean_low_latency_buffer runs on the device
(low_latency/clean.cu: barrier, zero, barrier over the live ranks), so a dead rank cannot hang it.

Receive kernels take their call number from a device counter (RECVD + 1), so they must run in call
order: hooks are called in call order, each exactly once, and an op without a hook is refused while
an earlier hook is pending (each raises a clear error here instead of pairing the wrong halves).
Double buffer precondition (DeepEP's too): every rank calls the hook of call n before its
next-but-one call of the same kind (dispatch / combine), e.g. dispatch, dispatch, hook, hook,
combine, combine is fine. Violations are detected on the device, never silent: the sender reports
kErrorOverwrite when its destination has not finished receiving the half's previous call, the
receiver kErrorOverrun when a signal already carries a later call; the Buffer is unusable after.

The dispatch's output recv_x is a view of the half's dispatch area that the peers write directly
(they reserve rows with fetch_add), when the window takes atomics at full speed: NVSHMEM's heap, and
the nvlink transport's window, which is shareable VMM memory by default (Window.cheap_fetch_add).
With DEEPEP_PORTABLE_LL_VMM=0 (the fallback for systems that refuse the file-descriptor exchange of VMM
memory) the nvlink window is legacy CUDA IPC memory, where atomics are slow, and the receive packs the
rows into a fresh tensor instead.

`get_next_low_latency_combine_buffer` hands out the combine send area of the half the next call
will use, by host-side parity of the calls made through this engine; that equals the device
counter's parity as long as every CUDA graph holds an even number of LL calls (dispatch + combine).
The combine kernel checks it and reports a mismatch instead of silently racing.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch

from .. import jit
from .. import layout as L
from ..contract import (BufferContext, LowLatencyCombineArgs, LowLatencyDispatchArgs, LowLatencyDispatchResult,
                        allocate_low_latency_outputs)
from ..handles import LowLatencyHandle
from ..profiling import PhaseProfile, kernel_call_spans, kernel_trace_report
from ..jit import forced_arch
from ..windows.base import Window
from .base import Engine
from .launch import check_aligned, launch, params_struct, programmatic_launches, ptr, stream_handle

DISPATCH_SOURCE = "common/kernels/low_latency/dispatch.cu"
COMBINE_SOURCE = "common/kernels/low_latency/combine.cu"
CLEAN_SOURCE = "common/kernels/low_latency/clean.cu"
# One kernel name per op. Common.phases says what a dispatch launch runs (kPhaseSend / kPhaseRecv in
# protocol.cuh); the combine is compiled once per phase (PHASE, kernel_defines) and phases just names it.
DISPATCH_KERNEL = jit.kernel_symbol("deepep_portable::low_latency::dispatch", "LLDispatchParams")
COMBINE_KERNEL = jit.kernel_symbol("deepep_portable::low_latency::combine", "LLCombineParams")
CLEAN_KERNEL = jit.kernel_symbol("deepep_portable::low_latency::clean_buffer", "LLCleanParams")
PHASE_SEND, PHASE_RECV = 1, 2
THREADS = 512                      # kThreads in protocol.cuh
MAX_SHRINK_RANKS = 4096            # kMaxShrinkRanks in protocol.cuh
TRACE_CALLS = 64                   # kTraceCalls in protocol.cuh
TRACE_KERNELS = ("dispatch_stage", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
                 "dispatch_blocks", "dispatch_staged")   # TraceKernel; the last two are spreads (not in gaps, call)
TRACE_PHASES = 5

# Common (protocol.cuh) after its first field, the backend's Transport struct (a window's transport_params()).
_COMMON = ["local_base", "rank", "num_ranks", "ctrl_sent", "ctrl_recvd", "ctrl_send_arrive", "ctrl_recv_arrive",
           "ctrl_last", "dispatch_signal_offset", "combine_signal_offset", "signal_half_stride",
           "dispatch_recv_offset", "dispatch_side_offset", "combine_send_offset", "combine_recv_offset",
           "data_half_stride", "num_experts", "num_max_tokens", "msg_bytes", "error_claim", "error_host",
           "timeout_ns", "trace", "phases", "ctrl_stage_arrive", "ctrl_staged", "mask", "barrier_offset"]
_DISPATCH = ["x", "topk_idx", "num_tokens", "use_fp8", "round_scale", "send_stage_offset", "stage_flags_offset",
             "recv_x", "expect_half", "recv_scales", "src_info", "layout_range", "recv_count", "cumulative_recv_stats",
             "wait_stats", "use_ue8m0"]
_COMBINE = ["x", "src_info", "layout_range", "expect_half", "x_in_dispatch_area", "topk_idx", "topk_weights", "out",
            "num_tokens", "wait_stats", "slot_table"]
_CLEAN = ["control_bytes", "signals_begin", "signals_end"]


@functools.lru_cache(maxsize=None)
def params_types(transport_struct: type) -> Tuple[type, type, type]:
    """(LLDispatchParams, LLCombineParams, LLCleanParams) mirrors for kernels built for the backend whose
    Transport struct `transport_struct` mirrors (one set of types per backend)."""
    common = [("transport", transport_struct), *_COMMON]
    return (params_struct("LLDispatchParams", [*common, *_DISPATCH]),
            params_struct("LLCombineParams", [*common, *_COMBINE]),
            params_struct("LLCleanParams", [*common, *_CLEAN]))


def kernel_defines(hidden: int, num_topk: int, logfmt: Optional[bool] = None, phase: Optional[int] = None) -> dict:
    """The shape a kernel is compiled for (the window's KernelBuild adds the backend's defines); the
    combine also takes `logfmt` (LogFMT-10 rows, use_logfmt=True) and its `phase` (PHASE_SEND / PHASE_RECV)."""
    defines = {"HIDDEN": hidden, "NUM_TOPK": num_topk}
    if logfmt is not None:
        defines["LOGFMT"] = int(logfmt)
    if phase is not None:
        defines["PHASE"] = phase
    return defines


def round_variants(hidden: int, num_topk: int) -> List[Tuple[str, dict]]:
    """(source, defines) of one low-latency round's kernels (BF16 combine), for compiling ahead of use."""
    return [(DISPATCH_SOURCE, kernel_defines(hidden, num_topk))] + [
        (COMBINE_SOURCE, kernel_defines(hidden, num_topk, False, phase)) for phase in (PHASE_SEND, PHASE_RECV)]


class LowLatencyEngine(Engine):
    def __init__(self, ctx: BufferContext, make_window: Callable[[BufferContext, int], Window]) -> None:
        """make_window(ctx, nbytes): the transport's window (collective), all zero, whose kernels are built
        for that transport (Window.kernel) and take its Transport struct (Window.transport_params)."""
        self.ctx = ctx
        self.recv_x_in_buffer = False
        self.base: Optional[int] = None
        self.broken: Optional[str] = None
        self._calls = 0                 # LL calls launched through this engine (host mirror of the device counter)
        self._recvs = 0                 # receive kernels launched (host mirror of RECVD): always in call order
        self._epoch = 0                 # bumped by clean_low_latency_buffer: hooks from before it are refused
        self._signal_experts: Optional[int] = None   # num_experts whose signal slots the buffer holds
        # Per call shape (layout checked once): the kernels and a params struct with every shape-only
        # field filled (an op copies it and sets its tensors' addresses: the host path of a decode step
        # is of the order of the op itself).
        self._plans: dict = {}
        if ctx.num_rdma_bytes == 0:
            return
        if ctx.device.type != "cuda":
            raise RuntimeError("the low-latency kernels need a CUDA device")
        if ctx.num_rdma_bytes <= L.LL_CONTROL_BYTES:
            raise ValueError(f"low-latency mode needs num_rdma_bytes > {L.LL_CONTROL_BYTES} "
                             f"(Buffer.get_low_latency_rdma_size_hint), got {ctx.num_rdma_bytes}")
        self.rank, self.num_ranks = ctx.rank, ctx.num_ranks
        if ctx.options.get("enable_shrink") and self.num_ranks > MAX_SHRINK_RANKS:
            raise ValueError(f"enable_shrink supports up to {MAX_SHRINK_RANKS} ranks, this group has {self.num_ranks}")
        # Everything zero: counters, arrival words, error claim and every signal (seq 0 = never written).
        self.window = make_window(ctx, ctx.num_rdma_bytes)
        self.dev, self.base = self.window.dev, self.window.base
        self.errors = self.window.errors
        self._params = params_types(type(self.window.transport_params()))
        # The dispatch's placement (low_latency/dispatch.cu, by the transport's kCheapFetchAdd): where the
        # window's mapping takes atomics at full speed (NVSHMEM's heap; nvlink's shareable VMM window) the
        # senders reserve rows and write recv_x in this buffer (the op returns a view of it); otherwise
        # (a legacy CUDA IPC window, DEEPEP_PORTABLE_LL_VMM=0) the receive packs the rows into a fresh tensor.
        # Shrink mode: the ranks the kernels neither send to nor wait for (1 = masked); see the module
        # docstring. It packs on receive whatever the window: a masked rank that is still running must not
        # be able to move the live sources' rows with its reservations.
        self.mask = (torch.zeros(self.num_ranks, dtype=torch.int32, device=ctx.device)
                     if ctx.options.get("enable_shrink") else None)
        self.recv_x_in_buffer = self.window.cheap_fetch_add and self.mask is None
        self.programmatic = programmatic_launches(ctx.device)   # the LL kernels wait for the previous grid first
        self.profile = PhaseProfile(self.dev)   # DEEPEP_PORTABLE_PROFILE=1 (used by `bench`)
        # With profiling, the kernels also stamp their start / end per call (see trace_report).
        self.trace = (torch.zeros(TRACE_CALLS * len(TRACE_KERNELS) * 2, dtype=torch.int64, device=ctx.device)
                      if self.profile.enabled else None)

    # ---- helpers -----------------------------------------------------------------------------------
    def _require(self) -> None:
        if self.base is None:
            raise ValueError("low-latency ops need a Buffer created with num_rdma_bytes > 0 "
                             "(Buffer.get_low_latency_rdma_size_hint)")
        self.check()

    def _layout(self, num_max_tokens: int, hidden: int, num_experts: int) -> L.LowLatencyLayout:
        lay = L.LowLatencyLayout(num_max_tokens, hidden, self.num_ranks, num_experts)
        if lay.total_bytes > self.ctx.num_rdma_bytes:
            raise ValueError(f"num_rdma_bytes={self.ctx.num_rdma_bytes} is too small for {num_max_tokens} tokens x "
                             f"hidden {hidden} x {num_experts} experts: need >= {lay.total_bytes}")
        return lay

    def _common(self, p, lay: L.LowLatencyLayout) -> None:
        p.transport = self.window.transport_params()
        p.local_base = self.base
        p.rank, p.num_ranks = self.rank, self.num_ranks
        p.ctrl_sent, p.ctrl_recvd = L.LL_CTRL_SENT, L.LL_CTRL_RECVD
        p.ctrl_send_arrive, p.ctrl_recv_arrive = L.LL_CTRL_SEND_ARRIVE, L.LL_CTRL_RECV_ARRIVE
        p.ctrl_last = L.LL_CTRL_LAST
        p.dispatch_signal_offset, p.combine_signal_offset = lay.dispatch_signal_offset(), lay.combine_signal_offset()
        p.signal_half_stride = lay.signal_half_stride
        p.dispatch_recv_offset, p.combine_recv_offset = lay.dispatch_recv_offset(), lay.combine_recv_offset()
        p.dispatch_side_offset = lay.dispatch_side_offset()
        p.combine_send_offset = lay.combine_send_offset()
        p.data_half_stride = lay.data_half_stride
        p.num_experts, p.num_max_tokens, p.msg_bytes = lay.num_experts, lay.num_max_tokens, lay.message_bytes
        p.error_claim = self.base + L.LL_CTRL_ERROR
        p.error_host = self.errors.dev
        p.timeout_ns = int(self.ctx.timeout_s * 1e9)
        p.trace = ptr(self.trace)
        p.phases = PHASE_SEND | PHASE_RECV
        p.ctrl_stage_arrive, p.ctrl_staged = L.LL_CTRL_STAGE_ARRIVE, L.LL_CTRL_STAGED
        p.mask = ptr(self.mask)
        p.barrier_offset = L.LL_BARRIER_OFFSET

    # ---- kernel timing trace (profiling only) ---------------------------------------------------------
    def trace_reset(self) -> None:
        """Forget the stamps (starts to ~0, ends to 0) on the current stream."""
        slots = self.trace.view(-1, 2)
        slots[:, 0].fill_(-1)
        slots[:, 1].zero_()

    def trace_report(self) -> dict:
        """Median microseconds over the traced calls since trace_reset() (profiling.kernel_trace_report)."""
        return kernel_trace_report(self.trace.view(TRACE_CALLS, len(TRACE_KERNELS), 2).tolist(), TRACE_KERNELS,
                                   TRACE_PHASES)

    def trace_call_spans(self) -> List[Tuple[int, int]]:
        """(first start, last end), globaltimer ns, of each traced call since trace_reset(), in start order."""
        return kernel_call_spans(self.trace.view(TRACE_CALLS, len(TRACE_KERNELS), 2).tolist(), TRACE_KERNELS,
                                 TRACE_PHASES)

    def _plan(self, op: str, num_max_tokens: int, hidden: int, num_experts: int, num_topk: int,
              logfmt: bool = False):
        """(kernel, params template) of one call shape of `op` ("dispatch" / "combine"; the combine's kernel is
        a (send, receive) pair), built once (the layout is checked then)."""
        key = (op, num_max_tokens, hidden, num_experts, num_topk, logfmt, forced_arch())
        plan = self._plans.get(key)
        if plan is None:
            dispatch = op == "dispatch"
            lay = self._layout(num_max_tokens, hidden, num_experts)
            template = self._params[0 if dispatch else 1]()
            self._common(template, lay)
            if dispatch:
                template.send_stage_offset = lay.send_stage_offset
                template.stage_flags_offset = L.LL_STAGE_FLAGS_OFFSET
                defines = kernel_defines(hidden, num_topk)
                if self.window.cheap_fetch_add and not self.recv_x_in_buffer:   # shrink mode: pack on receive
                    defines["PACK_ON_RECEIVE"] = 1
                kernel = self.window.kernel(DISPATCH_SOURCE, DISPATCH_KERNEL, defines)
            else:   # one kernel per phase (see the module docstring)
                kernel = tuple(self.window.kernel(COMBINE_SOURCE, COMBINE_KERNEL,
                                                  kernel_defines(hidden, num_topk, logfmt, phase))
                               for phase in (PHASE_SEND, PHASE_RECV))
            plan = self._plans[key] = (kernel, template)
        return plan

    def grid(self, num_sms: int) -> int:
        """Buffer.num_sms, capped so every rank sharing this GPU fits at once (and to the stage flags)."""
        return min(self.window.grid(num_sms), L.LL_MAX_STAGE_BLOCKS)

    def _check_signal_geometry(self, num_experts: int) -> None:
        """The signal slots' places depend on num_experts only; with another num_experts they would land on
        bytes that held payload (garbage sequence numbers). Changing it needs clean_low_latency_buffer.
        (Changing T or hidden moves only the data halves: safe once every rank's previous LL call has
        completed, e.g. after a barrier; the double-buffer argument holds only between calls of one shape.)"""
        if self._signal_experts is None:
            self._signal_experts = num_experts
        elif num_experts != self._signal_experts:
            raise ValueError(f"this low-latency buffer holds the signals of num_experts={self._signal_experts}; "
                             f"call clean_low_latency_buffer(..., num_experts={num_experts}) on every rank before "
                             f"using num_experts={num_experts}")

    def _current_stream(self):
        return torch.cuda.current_stream(self.ctx.device)

    def _two_phase(self, op: str, kernel, params, return_recv_hook: bool, num_sms: int,
                   keep: tuple) -> Optional[Callable[[], None]]:
        """Launch `kernel` for both phases now, or for the send phase now and the receive phase in the
        returned hook (params.phases says which).

        Receive phases number themselves RECVD + 1 on the device, so they are launched in call order
        (see the module docstring); `keep` holds what the receive phase reads or writes until then."""
        if not return_recv_hook and self._recvs != self._calls:
            raise RuntimeError(f"{self._calls - self._recvs} receive hook(s) of earlier low-latency calls are still "
                               f"pending: call them (in call order) before a low-latency op without "
                               f"return_recv_hook=True")
        comm = self.ctx.comm_stream
        grid = self.grid(num_sms)
        per_phase = isinstance(kernel, tuple)   # (send, receive): a kernel per phase; else one for both
        send, recv = kernel if per_phase else (kernel, kernel)
        if not return_recv_hook:
            # DEEPEP_PORTABLE_PROFILE=1: events around the op (both phases, in one launch or two back to back)
            marks = self.profile.start(comm)
            params.phases = PHASE_SEND if per_phase else PHASE_SEND | PHASE_RECV
            launch(send, grid, THREADS, params, stream_handle(comm), programmatic=self.programmatic)
            if per_phase:
                params.phases = PHASE_RECV
                launch(recv, grid, THREADS, params, stream_handle(comm), programmatic=self.programmatic)
            self._calls += 1
            self._recvs += 1
            self.profile.mark(marks, comm)
            self.profile.finish(op, ("send+recv",), marks)
            return None
        params.phases = PHASE_SEND
        launch(send, grid, THREADS, params, stream_handle(comm), programmatic=self.programmatic)
        self._calls += 1
        params.phases = PHASE_RECV
        blob = bytes(params)   # frozen now: the hook launches exactly this call's receive
        call, epoch = self._calls, self._epoch
        state = {"keep": keep}

        def hook() -> None:
            if state["keep"] is None:
                raise RuntimeError("this low-latency receive hook was already called (each hook runs once)")
            if epoch != self._epoch:
                raise RuntimeError("clean_low_latency_buffer was called after the op that returned this hook")
            if call != self._recvs + 1:
                raise RuntimeError(f"low-latency receive hooks must be called in call order: this is call {call}, "
                                   f"but call {self._recvs + 1} has not been received yet")
            self.check()
            current = self._current_stream()
            comm.wait_stream(current)
            recv.launch(grid, THREADS, 0, stream_handle(comm), blob, None, False, self.programmatic)
            self._recvs += 1
            # Tensors the receive kernel uses were allocated on the caller's stream at op time: their
            # memory must not be reused before the kernel ran, whatever stream frees them.
            used = [t for t in state["keep"] if isinstance(t, torch.Tensor) and t.is_cuda]
            if used and not torch.cuda.is_current_stream_capturing():
                for t in used:
                    t.record_stream(comm)
            state["keep"] = None
            current.wait_stream(comm)

        return hook

    # ---- ops ---------------------------------------------------------------------------------------
    def dispatch(self, args: LowLatencyDispatchArgs) -> LowLatencyDispatchResult:
        self._require()
        x, idx = args.x, args.topk_idx
        num_tokens, hidden = x.shape
        num_topk = idx.size(1)
        T, E, R = args.num_max_dispatch_tokens_per_rank, args.num_experts, self.num_ranks
        num_local = E // R
        kernel, template = self._plan("dispatch", T, hidden, E, num_topk)
        self._check_signal_geometry(E)
        check_aligned("x", x)
        dev = x.device
        # recv_x is the half's output area in the window (the peers write it); the small outputs are
        # allocated on the current stream (Buffer made the right one current), like the reference's
        half = self.next_half()
        recv_x, scales, recv_count, src_info, layout_range = allocate_low_latency_outputs(
            num_local, R, T, hidden, args.use_fp8, args.use_ue8m0, dev, with_recv_x=not self.recv_x_in_buffer)
        if self.recv_x_in_buffer:
            recv_x = self._rows_view(template.dispatch_recv_offset + half * template.data_half_stride, T, hidden,
                                     E, args.use_fp8)

        p = type(template).from_buffer_copy(template)
        p.x, p.topk_idx, p.num_tokens = x.data_ptr(), idx.data_ptr(), num_tokens
        p.use_fp8, p.round_scale, p.use_ue8m0 = int(args.use_fp8), int(args.round_scale), int(args.use_ue8m0)
        p.recv_x = 0 if self.recv_x_in_buffer else recv_x.data_ptr()
        p.expect_half, p.recv_scales, p.src_info = half, ptr(scales), src_info.data_ptr()
        p.layout_range, p.recv_count = layout_range.data_ptr(), recv_count.data_ptr()
        p.cumulative_recv_stats = ptr(args.cumulative_local_expert_recv_stats)
        p.wait_stats = ptr(args.dispatch_wait_recv_cost_stats)
        keep = (recv_x, scales, recv_count, src_info, layout_range, args.cumulative_local_expert_recv_stats,
                args.dispatch_wait_recv_cost_stats)
        hook = self._two_phase("low_latency_dispatch", kernel, p, args.return_recv_hook, args.num_sms, keep)
        handle = LowLatencyHandle(src_info, layout_range, T, hidden, E)
        return LowLatencyDispatchResult(recv_x, scales, recv_count, handle, hook)

    def combine(self, args: LowLatencyCombineArgs) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
        self._require()
        x, idx, w, handle = args.x, args.topk_idx, args.topk_weights, args.handle
        T, hidden, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        num_tokens, num_topk = idx.shape
        kernel, template = self._plan("combine", T, hidden, E, num_topk, args.use_logfmt)
        out = args.out if args.out is not None else torch.empty(num_tokens, hidden, dtype=torch.bfloat16,
                                                                device=x.device)
        if not out.is_contiguous():
            raise ValueError("low_latency_combine(out=...) must be contiguous")
        self._check_signal_geometry(E)
        check_aligned("x", x)
        check_aligned("out", out)
        p = type(template).from_buffer_copy(template)
        p.x, p.src_info, p.layout_range = x.data_ptr(), handle.src_info.data_ptr(), handle.layout_range.data_ptr()
        p.expect_half = -1
        for half in (0, 1):   # the plan's offsets: no layout arithmetic per call
            if x.data_ptr() == self.base + p.combine_send_offset + half * p.data_half_stride:
                p.expect_half = half
        p.x_in_dispatch_area = int(self._in_dispatch_area(x, p))
        if args.use_logfmt and p.expect_half >= 0:
            # The encoder stages rows for network peers in that very area (rows grow by their meta).
            raise ValueError("use_logfmt=True needs x outside the zero-copy buffer "
                             "(get_next_low_latency_combine_buffer): copy it, or combine without LogFMT")
        p.topk_idx, p.topk_weights, p.out, p.num_tokens = idx.data_ptr(), w.data_ptr(), out.data_ptr(), num_tokens
        p.wait_stats = ptr(args.combine_wait_recv_cost_stats)
        # Which row of each selected expert holds each of my tokens: the send kernel fills it, the receive
        # kernel reads it (same stream; kept alive until the hook ran).
        slot_table = torch.empty(num_tokens, num_topk, dtype=torch.int32, device=x.device)
        if slot_table.numel() and not torch.cuda.is_current_stream_capturing():
            slot_table.record_stream(self.ctx.comm_stream)   # freed here, read on the comm stream later
        p.slot_table = slot_table.data_ptr()
        keep = (x, idx, w, out, handle.src_info, handle.layout_range, args.combine_wait_recv_cost_stats, slot_table)
        hook = self._two_phase("low_latency_combine", kernel, p, args.return_recv_hook, args.num_sms, keep)
        return out, hook

    def _in_dispatch_area(self, x: torch.Tensor, p) -> bool:
        """Whether x's bytes overlap either half's dispatch area of my window (recv_x given back to the
        combine): the kernel then signals only after its whole grid has read x (combine.cu send_phase)."""
        lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
        for half in (0, 1):
            area = self.base + p.dispatch_recv_offset + half * p.data_half_stride
            if lo < self.base + p.combine_send_offset + half * p.data_half_stride and area < hi:
                return True
        return False

    def next_half(self) -> int:
        """The half the next LL call uses (call n, counted from 1, uses half n & 1)."""
        return (self._calls + 1) & 1

    def _rows_view(self, offset: int, num_max_tokens: int, hidden: int, num_experts: int,
                   use_fp8: bool) -> torch.Tensor:
        """[E_local, R*T, H] FP8 or bf16 view of the rows at `offset` in my window (a dispatch output
        area, or the combine send area). A view of this Buffer's memory (no copy, no ownership): it must
        not be used after the Buffer is destroyed."""
        shape = (num_experts // self.num_ranks, self.num_ranks * num_max_tokens, hidden)
        nbytes = shape[0] * shape[1] * shape[2] * (1 if use_fp8 else 2)
        flat = self.window.view(offset, nbytes, self.ctx.device)
        return flat.view(torch.float8_e4m3fn if use_fp8 else torch.bfloat16).view(shape)

    def next_dispatch_recv_x(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                             use_fp8: bool) -> Optional[torch.Tensor]:
        """The recv_x the next LL call returns if it is a dispatch of that shape, when it lies in this
        buffer (None otherwise: a fresh tensor). The tests poison it before the call: the peers write it
        during their send phase, before any hook."""
        self._require()
        if not self.recv_x_in_buffer:
            return None
        lay = self._layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return self._rows_view(lay.dispatch_recv_offset(self.next_half()), num_max_dispatch_tokens_per_rank, hidden,
                               num_experts, use_fp8)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """bf16 [E_local, R*T, H] view of the combine send area of the next call's half.

        A view of this Buffer's memory (no copy, no ownership). Only this rank writes it (peers write
        receive areas only): it holds until this rank's next-but-one LL call, the next one on the same
        half, and never after the Buffer is destroyed."""
        self._require()
        T, hidden, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        lay = self._layout(T, hidden, E)
        return self._rows_view(lay.combine_send_offset(self.next_half()), T, hidden, E, use_fp8=False)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective, on the device (low_latency/clean.cu): a barrier over the live ranks, zero the control
        words and both halves' signals, a barrier. Ordered after this rank's earlier LL calls (comm
        stream) and before the caller's later work; a timeout is reported by the next op (shrink mode:
        the silent peer is masked instead)."""
        if self.base is None:
            return
        self.check()
        lay = self._layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        kernel = self.window.kernel(CLEAN_SOURCE, CLEAN_KERNEL, {})
        p = self._params[2]()
        self._common(p, lay)
        p.control_bytes = L.LL_CLEANED_BYTES   # the control words and the dispatch's stage flags
        p.signals_begin = lay.dispatch_signal_offset(0)
        p.signals_end = lay.dispatch_signal_offset(0) + 2 * lay.signal_bytes
        comm, current = self.ctx.comm_stream, self._current_stream()
        comm.wait_stream(current)
        launch(kernel, 1, THREADS, p, stream_handle(comm))
        current.wait_stream(comm)
        self._calls = self._recvs = 0
        self._epoch += 1
        self._signal_experts = num_experts

    # ---- shrink mode -------------------------------------------------------------------------------
    def shrink_mask(self) -> Optional[torch.Tensor]:
        """int32 [R] on the device, 1 = masked (shrink mode), or None. Written by the kernels on the comm
        stream: order against it (Buffer does)."""
        return self.mask

    def destroy(self) -> None:
        if self.base is None:
            return
        self.window.close()
        self.base = None


# The shapes `python -m deepep_portable precompile` and CI compile for a backend (register_families).
HIDDENS = (7168, 4096, 2048, 7680)


def register_families(build) -> None:
    """Declare the LL kernel families for a backend's KernelBuild (windows.base): every HIDDENS at top-8
    (the combine also with LogFMT at 7168), and the clean kernel."""
    jit.register_family("low_latency_dispatch", DISPATCH_SOURCE, [DISPATCH_KERNEL],
                        variants=[build.kernel_defines(kernel_defines(h, 8)) for h in HIDDENS], extra_flags=build.flags)
    jit.register_family("low_latency_combine", COMBINE_SOURCE, [COMBINE_KERNEL],
                        variants=[build.kernel_defines(kernel_defines(h, 8, lf, ph)) for h, lf in
                                  [(h, False) for h in HIDDENS] + [(7168, True)] for ph in (PHASE_SEND, PHASE_RECV)],
                        extra_flags=build.flags)
    jit.register_family("low_latency_clean", CLEAN_SOURCE, [CLEAN_KERNEL], variants=[build.kernel_defines({})],
                        extra_flags=build.flags)
