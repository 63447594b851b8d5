"""Host side of the intranode (NVLink, peer-mapped memory) high-throughput kernels.

`IntranodeEngine` owns one buffer per rank that every peer maps (shareable VMM memory, or legacy CUDA IPC
memory with DEEPEP_PORTABLE_INTRANODE_VMM=0: windows/ipc.py), the table of peer addresses, the mapped
host words the kernels report through, and the launch sequence of each op (see
csrc/common/kernels/intranode/protocol.cuh for the device protocol). All device work goes on the
Buffer's communication stream; outputs are allocated on the current stream (Buffer._op sets it).

Two more entries into the same ops live in the same class, since they launch the same plans and read and
write the same per-op state:
  * zero-copy inputs: `Buffer.get_next_dispatch_buffer` / `get_next_combine_buffer` (deepep_portable/buffer.py)
    open the next round ahead of its op with the round's prologue alone (open_round.cu) and hand out a view of
    this rank's send area; the op then finds x there (`_reads_in_place`) and stages only what is not in place;
  * the combine's eager path (`combine_eager`): the common call with the fewest host steps before its first
    kernel (why and what it takes: the comment above it).
"""
from __future__ import annotations

import os
import struct
import sys
import time
from typing import List, NamedTuple, Optional, Tuple

import torch

from .. import _validate as check
from .. import errors, jit
from .. import layout as L
from ..failures import after_launch
from ..contract import BufferContext, CachedDispatchArgs, CombineArgs, DispatchArgs, DispatchResult
from ..handles import DispatchHandle, IntranodeState
from ..jit import forced_arch
from ..profiling import PhaseProfile
from ..windows.base import MappedWords
from ..windows.ipc import IpcWindow
from .base import Engine
from .launch import (current_stream_handle, launch, params_struct, ptr, stream_handle, stream_idle,
                     stream_wait_stream)

DISPATCH_SOURCE = "common/kernels/intranode/dispatch.cu"
COMBINE_SOURCE = "common/kernels/intranode/combine.cu"
OPEN_ROUND_SOURCE = "common/kernels/intranode/open_round.cu"
# (stage, pull) kernels of each op; only the pull, which moves the op's data, carries the op's name.
DISPATCH_KERNELS = (jit.kernel_symbol("deepep_portable::intranode::stage_tokens", "DispatchParams"),
                    jit.kernel_symbol("deepep_portable::intranode::dispatch", "DispatchParams"))
COMBINE_KERNELS = (jit.kernel_symbol("deepep_portable::intranode::stage_expert_rows", "CombineParams"),
                   jit.kernel_symbol("deepep_portable::intranode::combine", "CombineParams"))
# The next round's prologue alone, launched ahead of an op whose input the caller writes in place (one block).
OPEN_ROUND_KERNEL = jit.kernel_symbol("deepep_portable::intranode::open_round", "OpenRoundParams")
VMM_SWITCH = "DEEPEP_PORTABLE_INTRANODE_VMM"
MAX_SPARES = 4   # (kind, tokens) shapes whose next dispatch finds its small outputs ready
THREADS = 512   # __launch_bounds__ of the intranode kernels (the opener's one block, the ops' blocks)
MAX_AREA_VIEWS = 4   # (op, shape)s whose view of the rows is kept between calls
# Words of the control area every intranode kernel takes, in ControlLayout's order (protocol.cuh).
CONTROL = ["round", "current", "ready", "error", "num_tokens", "done", "count_to", "expert_count", "counted",
           "token_ticket", "pull_arrive"]

DispatchParams = params_struct("DispatchParams", [
    "peer_bases", "rank", *[f"ctrl_{f}" for f in CONTROL],
    "send_list_offset", "rows_offset", "meta_offset", "meta_bytes", "capacity", "scales_offset", "topk_idx_offset",
    "topk_weights_offset", "x", "x_scales", "topk_idx", "topk_weights", "is_token_in_rank", "send_pos",
    "num_tokens_per_rank",
    "num_tokens_per_expert", "num_tokens", "num_scales", "scale_token_stride", "scale_hidden_stride", "num_experts",
    "recv_x", "recv_scales",
    "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "rank_prefix_matrix", "send_rows",
    "num_recv_out", "expert_counts_out", "host_out", "max_recv_rows", "speculative", "expert_alignment",
    "error_claim", "error_host", "timeout_ns"])
CombineParams = params_struct("CombineParams", [
    "peer_bases", "rank", *[f"ctrl_{f}" for f in CONTROL],
    "send_area_offset", "weights_area_offset", "x", "topk_weights", "x_rows", "rank_prefix_matrix", "send_rows",
    "bias_0", "bias_1", "out", "out_topk_weights", "num_tokens", "error_claim", "error_host", "timeout_ns"])
OpenRoundParams = params_struct("OpenRoundParams", [
    "peer_bases", "rank", "num_ranks", *[f"ctrl_{f}" for f in CONTROL], "op", "error_claim", "error_host",
    "timeout_ns"])
# CombineParams' per-call words, contiguous in the struct from `x` to `num_tokens`:
# x, topk_weights, x_rows, rank_prefix_matrix, send_rows, bias_0, bias_1, out, out_topk_weights, num_tokens.
_CALL_WORDS = struct.Struct("<10q")
_CALL_FIELDS = ("x", "topk_weights", "x_rows", "rank_prefix_matrix", "send_rows", "bias_0", "bias_1", "out",
                "out_topk_weights", "num_tokens")


class EagerCombinePlan(NamedTuple):
    stage: object            # _C.Function
    pull: object
    head: bytes              # the params template before `x`
    tail: bytes              # ... and after `num_tokens`
    grid: int
    room: int                # tokens per rank this Buffer holds for this shape (the full path raises above it)


def call_words_span(params_cls) -> Tuple[int, int]:
    """[begin, end) byte offsets of the per-call words in the params struct; they must be contiguous, in order."""
    offsets = [getattr(params_cls, f).offset for f in _CALL_FIELDS]
    if offsets != list(range(offsets[0], offsets[0] + 8 * len(offsets), 8)):
        raise AssertionError(f"{params_cls.__name__}: fields {_CALL_FIELDS} are not contiguous 64-bit words")
    return offsets[0], offsets[-1] + 8


def vmm_buffer_wanted() -> bool:
    """The buffer is shareable VMM memory (every op runs faster over it: docs/PERFORMANCE.md) unless
    DEEPEP_PORTABLE_INTRANODE_VMM=0, the same on every rank: a fallback to legacy CUDA IPC memory for systems
    that refuse the POSIX file-descriptor exchange of VMM memory (docs/CONFIGURATION.md)."""
    return os.environ.get(VMM_SWITCH, "1") != "0"


class IntranodeEngine(Engine):
    def __init__(self, ctx: BufferContext) -> None:
        if ctx.device.type != "cuda":
            raise RuntimeError("the nvlink transport needs a CUDA device")
        if ctx.num_nvl_bytes <= L.CONTROL_BYTES:
            raise ValueError(f"the nvlink transport needs num_nvl_bytes > {L.CONTROL_BYTES} "
                             f"(Config.get_nvl_buffer_size_hint), got {ctx.num_nvl_bytes}")
        self.ctx = ctx
        self.rank, self.num_ranks = ctx.rank, ctx.num_ranks
        self.broken: Optional[str] = None
        self.window = IpcWindow(ctx, ctx.num_nvl_bytes, L.CONTROL_BYTES, "num_nvl_bytes", shareable=vmm_buffer_wanted(),
                                legacy_switch=VMM_SWITCH)
        self.dev, self.base, self.peer_bases = self.window.dev, self.window.base, self.window.peer_bases
        self.profile = PhaseProfile(self.dev)   # DEEPEP_PORTABLE_PROFILE=1 (used by `bench`)
        self.errors = self.window.errors
        self._plans: dict = {}   # per call shape: (kernels, filled params template); see _plan
        self._spares: dict = {}   # (cached, N) -> the next such dispatch's small outputs; see _small_outputs
        self._init_zero_copy()   # the rows a zero-copy op reads in place
        self._init_eager()   # the combine's eager path
        self.notify = MappedWords(self.dev, 2 + 65536 // 4)
        self.error_claim = self.base + L.CTRL_ERROR
        self.ctrl = [L.CTRL_ROUND, L.CTRL_CURRENT, L.CTRL_READY, L.CTRL_ERROR, L.CTRL_NUM_TOKENS, L.CTRL_DONE,
                     L.ctrl_count_to(self.num_ranks), L.ctrl_expert_count(self.num_ranks), L.CTRL_COUNTED,
                     L.CTRL_TOKEN_TICKET, L.CTRL_PULL_ARRIVE]

    # ---- shared parameter setup ------------------------------------------------------------------
    def _common(self, params) -> None:
        params.peer_bases = self.peer_bases.data_ptr()
        params.rank = self.rank
        for name, off in zip(CONTROL, self.ctrl):
            setattr(params, f"ctrl_{name}", off)
        params.error_claim = self.error_claim
        params.error_host = self.errors.dev
        params.timeout_ns = int(self.ctx.timeout_s * 1e9)

    def _kernel(self, source: str, name: str, defines: dict):
        return self.window.kernel(source, name, defines)

    def _plan(self, key: tuple, build):
        """(kernels, params template) of one call shape, built once: the host path before the first
        kernel is on the op's critical path whenever the GPU has nothing queued (a template copy and
        the per-call pointers instead of layout arithmetic, a struct fill and kernel lookups). Keyed
        by the forced architecture too, like the kernel cache."""
        key = (*key, forced_arch())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
        return plan

    def grid(self, num_sms: int) -> int:
        """Blocks per kernel for an SM budget (capped so every rank sharing the GPU fits at once)."""
        return self.window.grid(num_sms)

    def _capacity(self, lay: L.NormalLayout) -> int:
        return lay.max_tokens_per_rank(self.ctx.num_nvl_bytes)

    def _dispatch_plan(self, hidden: int, elem_bytes: int, num_scales: int, topk: int, num_experts: int,
                       expert_alignment: int):
        lay = L.NormalLayout(self.num_ranks, hidden, elem_bytes, num_scales, topk)
        cap = self._capacity(lay)
        p = DispatchParams()
        self._common(p)
        p.send_list_offset, p.rows_offset = lay.send_list_offset(cap), lay.dispatch_rows_offset()
        p.meta_offset, p.meta_bytes, p.capacity = lay.dispatch_meta_offset(cap), lay.dispatch_meta_bytes, cap
        p.scales_offset, p.topk_idx_offset = lay.dispatch_scales_offset, lay.dispatch_topk_idx_offset
        p.topk_weights_offset = lay.dispatch_topk_weights_offset
        p.num_scales, p.num_experts, p.expert_alignment = num_scales, num_experts, expert_alignment
        defines = dict(NUM_RANKS=self.num_ranks, HIDDEN_BYTES=hidden * elem_bytes, NUM_TOPK=topk,
                       NUM_SCALES=num_scales)
        kernels = tuple(self._kernel(DISPATCH_SOURCE, k, defines) for k in DISPATCH_KERNELS)
        return kernels, p

    def _combine_plan(self, hidden: int, topk: int):
        lay = L.NormalLayout(self.num_ranks, hidden, 2, 0, topk)
        p = CombineParams()
        self._common(p)
        cap = self._capacity(lay)
        p.send_area_offset, p.weights_area_offset = lay.combine_rows_offset(), lay.combine_weights_area_offset(cap)
        defines = dict(NUM_RANKS=self.num_ranks, HIDDEN=hidden, NUM_TOPK=topk)
        kernels = tuple(self._kernel(COMBINE_SOURCE, k, defines) for k in COMBINE_KERNELS)
        return kernels, p

    # ---- small outputs ------------------------------------------------------------------------------
    def _allocate_small(self, cached: bool, N: int) -> tuple:
        """Small int32 outputs that only comm-stream kernels write, in one allocation on the comm stream:
        [send_pos N*R (not cached) | send_rows N*R (not cached) | rank_prefix R*R | num_recv 1], as views
        (send_pos, send_rows, rank_prefix, num_recv); the first two None for a cached dispatch."""
        R = self.num_ranks
        n = (0 if cached else 2 * N * R) + R * R + 1
        with torch.cuda.stream(self.ctx.comm_stream):
            small = torch.empty(n, dtype=torch.int32, device=self.ctx.device)
        pos = None if cached else small[:N * R].view(N, R)
        rows = None if cached else small[N * R:2 * N * R].view(N, R)
        return pos, rows, small[n - 1 - R * R:n - 1].view(R, R), small[n - 1:]

    def _small_outputs(self, cached: bool, N: int) -> tuple:
        """The views of _allocate_small for this call: the spare the previous dispatch of the same kind
        and size prepared after its last launch (so the allocation, ~75-100 us of host time under MPS,
        is not between entering the op and its first kernel), else a fresh allocation. A spare is
        handed out once; it is comm-stream memory nobody else holds. Spares are kept per (kind, size),
        so alternating calls (a dispatch and a cached one, as training's forward and backward) each
        find theirs. Never during graph capture (the memory would come from, or outlive, the graph's
        private pool)."""
        if not torch.cuda.is_current_stream_capturing():
            spare = self._spares.pop((cached, N), None)
            if spare is not None:
                return spare
        return self._allocate_small(cached, N)

    def _prepare_spare(self, cached: bool, N: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            return
        self._spares[(cached, N)] = self._allocate_small(cached, N)
        while len(self._spares) > MAX_SPARES:   # token counts that vary call to call: keep the newest
            del self._spares[next(iter(self._spares))]

    # ---- dispatch ---------------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        return self._dispatch(args.x, args.x_scales, args.num_sms, fresh=args)

    def cached_dispatch(self, args: CachedDispatchArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        res = self._dispatch(args.x, args.x_scales, args.num_sms, handle=args.handle)
        return res.recv_x, res.recv_x_scales

    def _dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], num_sms: int,
                  fresh: Optional[DispatchArgs] = None, handle: Optional[DispatchHandle] = None) -> DispatchResult:
        """A fresh dispatch (`fresh`: its routing) or a cached one (`handle`: the routing of an earlier
        dispatch; no top-k, no expert counts)."""
        t_host = time.perf_counter()
        self.check()
        opened, self._opened = self._opened, None
        # x written in place by the caller into the rows next_dispatch_buffer opened for this dispatch: the stage
        # copies only the meta parts (scales, top-k). Refused before any launch: any other x inside my send area.
        in_place = self._reads_in_place("dispatch", x, opened, self._send_area)
        self.in_place_dispatches += in_place
        op = "dispatch_zc" if in_place else "dispatch"   # the profile's name (DEEPEP_PORTABLE_PROFILE=1)
        comm = self.ctx.comm_stream
        N, hidden = x.shape
        R = self.num_ranks
        cached = handle is not None
        topk = 0 if cached or fresh.topk_idx is None else fresh.topk_idx.size(1)
        num_scales = 0 if x_scales is None else x_scales.size(1)
        num_experts = R if cached else fresh.num_experts   # cached: the expert counts are not computed
        alignment = 1 if cached else fresh.expert_alignment
        num_worst_tokens = 0 if cached else fresh.num_worst_tokens
        if num_experts > L.max_experts_in_control(R):
            raise ValueError(f"the nvlink transport supports up to {L.max_experts_in_control(R)} experts")
        (stage, pull), template = self._plan(
            ("dispatch", hidden, x.element_size(), num_scales, topk, num_experts, alignment),
            lambda: self._dispatch_plan(hidden, x.element_size(), num_scales, topk, num_experts, alignment))
        self.profile.host_time(f"{op}:check_and_plan", t_host)

        if cached:
            send_pos, per_rank = handle.transport_state.send_pos, handle.transport_state.num_tokens_per_rank
        else:
            per_rank = fresh.num_tokens_per_rank
        views = self._small_outputs(cached, N)
        if not cached:
            send_pos, send_rows = views[0], views[1]
        rank_prefix, num_recv_dev = views[2], views[3]
        self.profile.host_time(f"{op}:until_alloc", t_host)

        p = DispatchParams.from_buffer_copy(template)
        p.x, p.x_scales = (0 if in_place else x.data_ptr()), ptr(x_scales)
        if x_scales is not None:   # any strides (column-major scales are read in place)
            p.scale_token_stride, p.scale_hidden_stride = x_scales.stride()
        p.topk_idx = 0 if cached else ptr(fresh.topk_idx)
        p.topk_weights = 0 if cached else ptr(fresh.topk_weights)
        p.is_token_in_rank = 0 if cached else fresh.is_token_in_rank.data_ptr()
        p.send_pos, p.num_tokens_per_rank = send_pos.data_ptr(), per_rank.data_ptr()
        p.num_tokens_per_expert = 0 if cached else fresh.num_tokens_per_expert.data_ptr()
        p.num_tokens = N
        # Learn the receive count on the host (as DeepEP does) from the stage kernel's block 0, which
        # publishes it before its copy: the host allocates and launches the pull while the copy runs.
        learn_count = not cached and num_worst_tokens == 0
        if learn_count:
            self.notify.words[0] = 0
            p.host_out = self.notify.dev
        s = stream_handle(comm)
        grid = self.grid(num_sms)
        self.profile.host_time(f"{op}:until_params", t_host)
        marks, phases = self._phases(in_place, comm)
        t_launch = time.perf_counter()
        launch(stage, grid, THREADS, p, s)
        self.profile.host_time(f"{op}:stage_launch_call", t_launch)   # the driver call alone (MPS client)
        self.profile.host_time(f"{op}:until_stage_launch", t_host)
        self.profile.mark(marks, comm)

        experts_per_rank = num_experts // R
        p.num_recv_out, p.rank_prefix_matrix = num_recv_dev.data_ptr(), rank_prefix.data_ptr()
        p.send_rows = 0 if cached else send_rows.data_ptr()
        counts_list: List[int] = []
        t_wait = time.perf_counter()
        if cached:
            rows, num_recv = handle.num_recv_rows, handle.num_recv_tokens
        elif num_worst_tokens > 0:
            rows, num_recv = num_worst_tokens, -1
        else:
            p.host_out = 0
            rows = num_recv = -1   # learned below
        if learn_count:
            num_recv = rows = self.wait_for_count("dispatch", self.notify)
            self.profile.host_time(f"{op}:wait_notify", t_wait)
            t_wait = time.perf_counter()
            counts_list = self.notify.words[2:2 + experts_per_rank]
        recv_x, recv_scales, recv_idx, recv_w, recv_src = self._recv_outputs(p, rows, hidden, x.dtype, x_scales, topk)
        launch(pull, grid, THREADS, p, s)
        if learn_count:
            self.profile.host_time(f"{op}:notify_to_pull_launch", t_wait)
        self._prepare_spare(cached, N)   # the GPU is busy with the pull now
        self.profile.mark(marks, comm)
        self.profile.finish(op, phases, marks)
        self.profile.host_time(f"{op}:call", t_host)
        if cached:
            return DispatchResult(recv_x, recv_scales, None, None, [], handle)

        new_handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix, recv_src_idx=recv_src, is_token_in_rank=fresh.is_token_in_rank,
            send_rows=send_rows, num_recv_tokens=num_recv, num_recv_rows=rows, num_tokens=N, hidden=hidden,
            buffer_uid=self.ctx.uid,
            transport_state=IntranodeState(send_pos=send_pos, num_tokens_per_rank=per_rank, num_recv=num_recv_dev))
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, counts_list, new_handle)

    def _recv_outputs(self, p, rows: int, hidden: int, dtype: torch.dtype, x_scales: Optional[torch.Tensor],
                      topk: int) -> tuple:
        """(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx) for `rows` rows, their
        addresses set in the pull's params `p` (the outputs hold exactly the rows the host learned or was told:
        the params' `speculative` word stays 0)."""
        dev = self.ctx.device
        recv_x = torch.empty(rows, hidden, dtype=dtype, device=dev)
        recv_scales = None if x_scales is None else torch.empty(rows, x_scales.size(1), dtype=x_scales.dtype,
                                                                device=dev)
        recv_idx = recv_w = None
        if topk:
            recv_idx = torch.empty(rows, topk, dtype=torch.int64, device=dev)
            recv_w = torch.empty(rows, topk, dtype=torch.float32, device=dev)
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev)
        p.recv_x, p.recv_scales, p.recv_topk_idx, p.recv_topk_weights, p.recv_src_idx = (
            recv_x.data_ptr(), ptr(recv_scales), ptr(recv_idx), ptr(recv_w), recv_src.data_ptr())
        p.max_recv_rows = rows
        return recv_x, recv_scales, recv_idx, recv_w, recv_src

    # ---- combine ----------------------------------------------------------------------------------
    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        t_host = time.perf_counter()
        x, handle, topk_weights, bias_0, bias_1 = args.x, args.handle, args.topk_weights, args.bias_0, args.bias_1
        self.check()
        comm = self.ctx.comm_stream
        hidden = x.size(1)
        topk = 0 if topk_weights is None else topk_weights.size(1)
        (stage, pull), template = self._plan(("combine", hidden, topk), lambda: self._combine_plan(hidden, topk))
        p = CombineParams.from_buffer_copy(template)
        # x written in place by the caller into the rows next_combine_buffer opened for this combine: the stage
        # copies only the weights. Refused before any launch: any other x overlapping the rows or their weights.
        opened, self._opened = self._opened, None
        area = (self.base + p.send_area_offset, self.base + p.weights_area_offset + handle.num_recv_rows * topk * 4)
        in_place = self._reads_in_place("combine", x, opened, area)
        if in_place:   # the rows the caller wrote must end before this top-k's weights start
            most = self._combine_rows_room(hidden, topk)
            if handle.num_recv_rows > most:
                raise ValueError(f"a zero-copy combine of {handle.num_recv_rows} rows with top-k {topk} needs more "
                                 f"than this Buffer's num_nvl_bytes={self.ctx.num_nvl_bytes} (it holds {most} rows at "
                                 "that top-k): combine a tensor outside the Buffer, or size it for this top-k")
        p.x, p.topk_weights, p.x_rows = (0 if in_place else x.data_ptr()), ptr(topk_weights), x.size(0)
        self.in_place_combines += in_place
        p.rank_prefix_matrix, p.send_rows = handle.rank_prefix_matrix.data_ptr(), handle.send_rows.data_ptr()
        p.bias_0, p.bias_1 = ptr(bias_0), ptr(bias_1)
        s = stream_handle(comm)
        grid = self.grid(args.num_sms)
        marks, phases = self._phases(in_place, comm)
        launch(stage, grid, THREADS, p, s)   # it reads none of the outputs: they are allocated while it runs
        self.profile.host_time("combine:until_stage_launch", t_host)
        self.profile.mark(marks, comm)
        try:
            out, out_w = self._combine_outputs(handle.num_tokens, hidden, topk, x.device)
        except BaseException:
            # The stage opened this round for every peer: a pull of no tokens still announces READY, waits for
            # the peers and gives them DONE, so they finish their combine and the Buffer stays usable.
            p.num_tokens = 0
            launch(pull, grid, THREADS, p, s)
            raise after_launch(sys.exc_info()[1])
        p.out, p.out_topk_weights, p.num_tokens = out.data_ptr(), ptr(out_w), handle.num_tokens
        launch(pull, grid, THREADS, p, s)
        self.profile.mark(marks, comm)
        self.profile.finish("combine_zc" if in_place else "combine", phases, marks)
        return out, out_w

    @staticmethod
    def _combine_outputs(num_tokens: int, hidden: int, topk: int, device: torch.device):
        """(out [N, hidden] bf16, out_topk_weights [N, topk] f32 or None), on the current stream. Allocated after
        the stage kernel's launch: 16-25 us of host time under MPS (8 ranks), which otherwise delays the stage of a
        rank whose host is the last to reach the op, and with it every rank's pull."""
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        out_w = None if topk == 0 else torch.empty(num_tokens, topk, dtype=torch.float32, device=device)
        return out, out_w

    # ---- the combine's eager path -----------------------------------------------------------------
    # Why: ranks reach a layer's combine together (after their experts), and every rank's pull waits for the stage of
    # the rank whose host launched it last, so the host steps before the stage launch are part of the op's time. On
    # the H200 (8 ranks under MPS, 16 SMs, host marks in each timed call of `bench`) the full path took 88-116 us from
    # entering Buffer.combine to the stage launch's return: the launch itself 11-19 us, the rest Python (the Buffer's
    # checks 26-35, the stream ordering 12-20, the engine's set-up about 40; docs/PERFORMANCE.md). The same steps cost
    # about a tenth of that in a tight loop: the first call after a barrier pays for every object and bytecode it
    # touches, so the way to a shorter path is fewer of them, not faster ones. This path: 47-54 us (predicate 12-14,
    # stream ordering about 10, the launch 11-15). On that emulation the op gained less (1808-1817 -> 1799-1800 us):
    # the stages of the other seven ranks keep HBM busy while a late one starts. Where each rank has its own GPU, the
    # late stage delays every pull directly.
    #
    # Taken when Buffer.combine's cheap predicate (_validate.combine_eager) holds: nothing to overlap (no previous
    # event, no async finish), no bias, x a contiguous BF16 tensor outside this Buffer's send area. Whatever this path
    # does not handle (a zero-copy round opened, a kernel error to report, a shape whose capacity is exceeded, the
    # profiler on) returns None, and the caller takes the full path (IntranodeEngine.combine), which checks, raises
    # and profiles. Both launch the same kernels with the same parameters on the same stream, ordered the same way as
    # Buffer._op orders the full path.
    def _init_eager(self) -> None:
        self._eager_plans: dict = {}
        self.eager_combines = 0   # combines that took this path (tests look)
        self._eager_span = call_words_span(CombineParams)
        self._eager_threads = THREADS
        self._comm = int(self.ctx.comm_stream.cuda_stream)

    def _eager_plan(self, key: tuple) -> EagerCombinePlan:
        hidden, topk, num_sms, _ = key
        (stage, pull), template = self._plan(("combine", hidden, topk), lambda: self._combine_plan(hidden, topk))
        raw, (begin, end) = bytes(template), self._eager_span
        layout = check.combine_layout(self.num_ranks, hidden, topk)
        plan = EagerCombinePlan(stage, pull, raw[:begin], raw[end:], self.grid(num_sms),
                                check.room(layout, self.ctx.num_nvl_bytes))
        self._eager_plans[key] = plan
        return plan

    def combine_eager(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor],
                      num_sms: int) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(out, out_topk_weights) of a combine whose arguments passed _validate.combine_eager, or None: take the
        full path. Same kernels, parameters and stream ordering as the full path (Buffer._op + combine)."""
        if self._opened is not None or self.broken is not None or self.errors.words[0] != 0 or self.profile.enabled:
            return None
        rows, hidden = x.shape
        topk = 0 if topk_weights is None else topk_weights.size(1)
        key = (hidden, topk, self.grid(num_sms), forced_arch())   # the grid: it shrinks while other Buffers are open
        plan = self._eager_plans.get(key) or self._eager_plan(key)
        lo = x.data_ptr()
        lo_area, hi_area = self._send_area   # the zero-copy rounds' (it covers the combine's rows and weights)
        if handle.num_tokens > plan.room or (lo < hi_area and lo + 2 * rows * hidden > lo_area):
            return None   # the full path raises (capacity), or reads x in place or refuses it (in the send area)
        dev, comm, threads = self.dev, self._comm, self._eager_threads
        current = current_stream_handle(dev)
        stream_wait_stream(dev, comm, current)
        weights = 0 if topk_weights is None else topk_weights.data_ptr()
        prefix, send_rows = handle.rank_prefix_matrix.data_ptr(), handle.send_rows.data_ptr()
        # The stage reads none of the outputs: they are allocated while it runs (out, out_topk_weights, num_tokens 0).
        stage_params = plan.head + _CALL_WORDS.pack(lo, weights, rows, prefix, send_rows, 0, 0, 0, 0, 0) + plan.tail
        plan.stage.launch(plan.grid, threads, 0, comm, stage_params)
        try:
            out, out_w = self._combine_outputs(handle.num_tokens, hidden, topk, self.ctx.device)
        except BaseException:
            # As the full path: a pull of no tokens still announces READY and gives the peers DONE; the caller's stream
            # waits for it (it reads x) as Buffer._op's does on any exception.
            plan.pull.launch(plan.grid, threads, 0, comm, stage_params)
            stream_wait_stream(dev, current, comm)
            raise after_launch(sys.exc_info()[1])
        plan.pull.launch(plan.grid, threads, 0, comm,
                         plan.head + _CALL_WORDS.pack(lo, weights, rows, prefix, send_rows, 0, 0, out.data_ptr(),
                                                      0 if out_w is None else out_w.data_ptr(), handle.num_tokens)
                         + plan.tail)
        stream_wait_stream(dev, current, comm)
        self.eager_combines += 1
        return out, out_w

    # ---- zero-copy inputs: rows the caller writes in place -----------------------------------------
    def _init_zero_copy(self) -> None:
        # (op, address, rows, hidden, dtype) of the rows get_next_dispatch_buffer / get_next_combine_buffer opened
        # for the next op; any op closes them (an op reads x in place only from rows opened for it, after the
        # round's prologue).
        self._opened: Optional[tuple] = None
        self.in_place_dispatches = 0   # dispatches / combines that read x in place (tests and tools look)
        self.in_place_combines = 0
        self._window_bytes: Optional[torch.Tensor] = None   # uint8 view of the whole window (the rows' views)
        self._area_views: dict = {}   # (offset, rows, hidden, dtype) -> the view _open_rows returned for it
        self._rows_room: dict = {}   # (op, hidden, dtype or top-k) -> rows a zero-copy op's area holds (_room)
        # My send area, from the rows on: a dispatch's x overlapping it is read in place or refused (_dispatch).
        self._send_area = (self.base + L.ROWS_OFFSET, self.base + self.window.size)
        self._open_marks: Optional[list] = None   # profiling: the event before the last opener (see _phases)

    def next_dispatch_buffer(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_tokens, hidden] view of my send area's dispatch rows for a zero-copy dispatch
        (Buffer.get_next_dispatch_buffer). The rows must fit beside the meta slots of a top-k up to the size
        hints' (HINT_TOPK) and, for FP8, one scale per 128 channels; a dispatch whose shape leaves no room is
        refused before its launch (its capacity check), as any refused dispatch: the rows are closed."""
        self.check()
        most = self._dispatch_rows_room(hidden, dtype)
        if num_tokens > most:
            raise ValueError(f"get_next_dispatch_buffer: {num_tokens} tokens x hidden {hidden} ({dtype}) need more "
                             f"than this Buffer's num_nvl_bytes={self.ctx.num_nvl_bytes} holds at top-k up to "
                             f"{L.HINT_TOPK} ({most} tokens)")
        return self._open_rows("dispatch", L.NormalLayout.dispatch_rows_offset(), num_tokens, hidden, dtype)

    def next_combine_buffer(self, handle: DispatchHandle, hidden: int) -> torch.Tensor:
        """[num_recv_rows, hidden] bf16 view of my send area for a zero-copy combine (Buffer.get_next_combine_buffer).
        The rows must fit beside the weights of a top-k up to the size hints' (HINT_TOPK): a Buffer sized by a
        hint for the dispatch takes its zero-copy combine too. A combine whose wider top-k leaves no room is refused
        before its launch (combine), as any refused combine: the area is closed, open it again to retry."""
        self.check()
        rows = handle.num_recv_rows
        most = self._combine_rows_room(hidden, L.HINT_TOPK)
        if rows > most:
            raise ValueError(f"get_next_combine_buffer: {rows} rows x hidden {hidden} need more than this Buffer's "
                             f"num_nvl_bytes={self.ctx.num_nvl_bytes} holds at top-k up to {L.HINT_TOPK} ({most} rows)")
        return self._open_rows("combine", L.NormalLayout.combine_rows_offset(), rows, hidden, torch.bfloat16)

    def _open_rows(self, op: str, offset: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Opens the next round for `op` and returns the [rows, hidden] view of my window at `offset` that the op
        will read in place. The round's prologue (open_round) goes on the caller's stream: the caller's later
        work (its writes into the rows) follows it with no event, and once it has run no peer reads my send area.
        It must also follow my last op on the comm stream (it reads the round that op completed): the caller's
        stream waits for the comm stream only while that still has work (a query is one driver call, an event
        record and a wait are two, ~10 us each under MPS). While capturing a CUDA graph it goes on the comm
        stream between two waits instead. It waits until every peer has
        finished reading my last op (peers tell so at the end of their pull), not for the peers' next op."""
        t_host = time.perf_counter()
        # The template is launched as it is (only the op's id differs between calls): every step here is on the
        # op's critical path when the GPU waits for the host (parsing errors.cuh for the id took tens of us).
        opener, p = self._plan(("open_round", op), lambda: self._open_round_plan(op))
        comm, current = stream_handle(self.ctx.comm_stream), current_stream_handle(self.dev)
        if self.profile.enabled:
            self._open_marks = self.profile.start(torch.cuda.current_stream(self.dev))
        if torch.cuda.is_current_stream_capturing():
            # No query in a capture, and a capturing stream may not wait on an event recorded outside it: the comm
            # stream joins the capture first (it waits on the caller's), runs the opener, and the caller waits on it.
            stream_wait_stream(self.dev, comm, current)
            launch(opener, 1, THREADS, p, comm)
            stream_wait_stream(self.dev, current, comm)
        else:
            if not stream_idle(self.dev, comm):
                stream_wait_stream(self.dev, current, comm)
            launch(opener, 1, THREADS, p, current)
        self._opened = (op, self.base + offset, rows, hidden, dtype)
        area = self._area_views.pop((offset, rows, hidden, dtype), None)
        if area is None:   # three torch view ops, ~15 us under MPS: kept per shape
            if self._window_bytes is None:   # made once: wrapping device memory in a tensor costs tens of us
                self._window_bytes = self.window.view(0, self.window.size, self.ctx.device)
            nbytes = rows * hidden * dtype.itemsize
            area = self._window_bytes[offset:offset + nbytes].view(dtype).view(rows, hidden)
        self._area_views[(offset, rows, hidden, dtype)] = area
        while len(self._area_views) > MAX_AREA_VIEWS:   # shapes that vary call to call: keep the newest
            del self._area_views[next(iter(self._area_views))]
        self.profile.host_time(f"open_rows:{op}", t_host)
        return area

    def _phases(self, in_place: bool, comm) -> Tuple[Optional[list], tuple]:
        """The profile's first marks of an op (DEEPEP_PORTABLE_PROFILE=1) and its phase names: a zero-copy op
        starts at its opener's launch, so its first phase ("open") spans the opener's barrier and the host's
        way to the stage launch."""
        marks = self.profile.start(comm)
        opened, self._open_marks = self._open_marks, None
        if marks is None or not in_place or opened is None:
            return marks, ("stage", "pull")
        return opened + marks, ("open", "stage", "pull")

    @staticmethod
    def _reads_in_place(op: str, x: torch.Tensor, opened: Optional[tuple], area: Tuple[int, int]) -> bool:
        """Whether `op` reads x where it is: x is the rows last opened for this op (and no op ran since). Any other
        x overlapping my send area `area` [lo, hi) (rows not opened since the last op: peers may still read them)
        would be copied onto itself mid-read or race with them: refused."""
        lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
        if x.numel() > 0 and opened == (op, lo, x.size(0), x.size(1), x.dtype):
            return True
        if x.numel() > 0 and lo < area[1] and area[0] < hi:
            raise ValueError(f"x overlaps this Buffer's {op} area: pass the tensor get_next_{op}_buffer() returned "
                             f"for this {op} (call it again before each {op} that reads it), or a tensor outside "
                             "the Buffer")
        return False

    def _room(self, key: tuple, compute) -> int:
        """compute() (rows an area holds for one shape) once per key: layout arithmetic on the op's host path,
        which is the op's critical path when the GPU waits for the host."""
        room = self._rows_room.get(key)
        if room is None:
            room = self._rows_room[key] = compute()
        return room

    def _dispatch_rows_room(self, hidden: int, dtype: torch.dtype) -> int:
        """Tokens a zero-copy dispatch's rows hold beside the meta slots of a top-k up to the hints' (HINT_TOPK)."""
        def compute() -> int:
            elem = dtype.itemsize
            return self._capacity(L.NormalLayout(self.num_ranks, hidden, elem, hidden // 128 if elem == 1 else 0,
                                                 L.HINT_TOPK))
        return self._room(("dispatch", hidden, dtype), compute)

    def _combine_rows_room(self, hidden: int, topk: int) -> int:
        """Rows the combine area holds before the weights of a top-k `topk` start."""
        def compute() -> int:
            lay = L.NormalLayout(self.num_ranks, hidden, 2, 0, topk)
            return lay.combine_rows(self._capacity(lay))
        return self._room(("combine", hidden, topk), compute)

    def _open_round_plan(self, op: str):
        p = OpenRoundParams()
        self._common(p)
        p.num_ranks = self.num_ranks
        p.op = next(i for i, name in errors.table()[1].items() if name == op)   # kOpDispatch... (errors.cuh)
        return self._kernel(OPEN_ROUND_SOURCE, OPEN_ROUND_KERNEL, {}), p


# What `python -m deepep_portable precompile` and CI compile of these kernels.
jit.register_family("intranode_open_round", OPEN_ROUND_SOURCE, [OPEN_ROUND_KERNEL], variants=[{}])
jit.register_family(
    "intranode_dispatch", DISPATCH_SOURCE, list(DISPATCH_KERNELS),
    variants=[dict(NUM_RANKS=8, HIDDEN_BYTES=7168, NUM_TOPK=8, NUM_SCALES=56),      # FP8 headline
              dict(NUM_RANKS=8, HIDDEN_BYTES=7168 * 2, NUM_TOPK=8, NUM_SCALES=0),   # BF16 headline
              dict(NUM_RANKS=4, HIDDEN_BYTES=4096 * 2, NUM_TOPK=0, NUM_SCALES=0)])  # cached dispatch
jit.register_family(
    "intranode_combine", COMBINE_SOURCE, list(COMBINE_KERNELS),
    variants=[dict(NUM_RANKS=8, HIDDEN=7168, NUM_TOPK=8),
              dict(NUM_RANKS=4, HIDDEN=4096, NUM_TOPK=0)])
