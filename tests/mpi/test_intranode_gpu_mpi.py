"""The "nvlink" transport (intranode CUDA IPC kernels) through `deep_ep.Buffer`, on every rank, vs tests/oracle.py.

Run on the GPU machine, all ranks sharing one GPU under CUDA MPS (no thread-percentage cap):
    mpirun --allow-run-as-root --oversubscribe -n 2|4|8 python -m pytest --with-mpi -q tests/mpi
Without CUDA the whole module is skipped; when the transport is missing or unusable (on any rank) it is
skipped with the reason from `deep_ep.available_transports()`.

What is checked, bit for bit (seeded per run, rank and test; replay with DEEPEP_TEST_SEED):
- get_dispatch_layout; dispatch (BF16, FP8 data + float32 scales, top-k or none, expert_alignment,
  num_worst_tokens), the handle's fields, cached dispatch, combine (x, top-k weights, 0/1/2 biases:
  the oracle's float32 order is the contract, so combine is exact too).
- With num_worst_tokens, rows past the real ones are padding: recv_topk_idx must be -1 there and
  handle.recv_src_idx -1 (as documented in handles.py); recv_x, scales and weights are only compared on
  the real rows, and handle.num_recv_tokens may be -1 ("only the GPU knows").
- Every case runs two rounds on the same Buffer with fresh inputs and token counts (stale data from the
  first round, and the dispatch -> combine -> dispatch sequence, are checked).
- Stream ordering: inputs are written on the caller's stream after a GPU sleep, so a kernel that does
  not wait for the caller's stream (or for previous_event) reads poison; async_finish events are waited
  on before anything is read; allocate_on_comm_stream.
- SM budgets of 4 and 8 (per-call Config, and Buffer.set_num_sms for the default config), so all
  ranks' blocks are resident at once on one GPU.
- CUDA graph capture of dispatch + combine with num_worst_tokens, replayed with new input contents.
- The sm_80 code path (DEEPEP_PORTABLE_FORCE_ARCH=sm_80, run through PTX JIT).
- The round counter preset just below 2^32: rounds across the wrap of a 32-bit field stay exact.
- A peer that never arrives: CommTimeoutError naming op, rank and peer within the timeout; afterwards a
  fresh Buffer works (last test of the file).

A failure on one rank never leaves the others waiting in a collective: kernel calls are guarded, the ranks
agree after each communicating call whether to go on, and findings are gathered at the end of each test.
A watchdog (faulthandler, DEEPEP_TEST_WATCHDOG_S, default 600 s per test) dumps the stacks and exits a
rank that hangs, so mpirun ends the job with a traceback instead of hanging silently.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import sys
import time
from typing import Callable, List, Optional

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/mpi (shared helpers)

import deepep_portable as deep_ep  # noqa: E402
import oracle  # noqa: E402
from deepep_portable import layout as L  # noqa: E402
from test_reference_mpi import (Checker, allgather, generator, make_topk,  # noqa: E402
                                num_experts_for, nvl_bytes, world)

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the nvlink transport tests need a CUDA GPU"),
]

# The normal-mode ops run the intranode kernels over CUDA IPC whatever the backend; DEEPEP_TEST_NORMAL_TRANSPORT
# (default nvlink) runs the suite through another backend's Buffer (e.g. nccl_gin over a real NCCL).
TRANSPORT = os.environ.get("DEEPEP_TEST_NORMAL_TRANSPORT", "nvlink")
MAX_HIDDEN = 7680                 # the shared Buffer is sized for the largest hidden and token count below
MAX_TOKENS = 512
DEFAULT_SMS = 8                   # Buffer.set_num_sms while this module runs (default configs)
SLEEP_CYCLES = 2_000_000          # ~1 ms of GPU sleep before inputs are written (stream-ordering checks)
TIMEOUT_S = 3.0
WATCHDOG_S = float(os.environ.get("DEEPEP_TEST_WATCHDOG_S", "600"))
FORCE_ARCH = "DEEPEP_PORTABLE_FORCE_ARCH"


# ---- shared state ------------------------------------------------------------------------------------
class _Shared:
    """One Buffer shared by the tests (created on first use). A test in which some rank saw an exception
    from the library marks it broken and the next test creates a fresh one. Buffers are never freed
    while the job runs (`graveyard`): a peer's kernel may still reference their memory after a failure."""

    buf = None
    broken = False
    graveyard: List[object] = []


_SHARED = _Shared()


def _short(e: BaseException) -> str:
    text = str(e).strip().replace("\n", " | ")
    return f"{type(e).__name__}: {text[:600]}"


class GpuChecker(Checker):
    """Checker (test_reference_mpi) for device results: compares on the host, turns exceptions (from
    the library or from a sticky CUDA error) into findings, and lets the ranks agree whether to go on."""

    def __init__(self, pg) -> None:
        super().__init__(pg)
        self.raised = False

    def fail(self, what: str, e: BaseException) -> None:
        self.raised = True
        self.errors.append(f"{what}: raised {_short(e)}")

    def bits(self, got, expected, what: str) -> None:
        try:
            got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
            expected = expected.detach().cpu() if isinstance(expected, torch.Tensor) else expected
            super().bits(got, expected, what)
        except Exception as e:   # noqa: BLE001 - reported, not swallowed
            self.fail(what, e)

    def run(self, what: str, fn: Callable):
        try:
            return fn()
        except Exception as e:   # noqa: BLE001
            self.fail(what, e)
            return None

    @contextlib.contextmanager
    def guard(self, what: str):
        try:
            yield
        except Exception as e:   # noqa: BLE001
            self.fail(what, e)

    def host(self, t: Optional[torch.Tensor], what: str) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return self.run(f"{what} (copy to host)", lambda: t.detach().cpu())

    def agree(self, ok: bool) -> bool:
        """True on every rank iff `ok` on every rank (a collective: call it on all ranks)."""
        return all(self.gather("agree", bool(ok)))

    def done(self) -> None:
        found = self.gather("done", (self.errors, self.raised))
        if any(raised for _, raised in found):
            _SHARED.broken = True
        report = [f"rank {r}: {e}" for r, (errs, _) in enumerate(found) for e in errs]
        assert not report, "\n".join(report[:40])

    def gather(self, tag: str, value) -> list:
        """Every rank's `value`, gathered under `tag`. A rank that is in another collective (an agree() where this
        rank is in done(), or a library call whose collectives one rank left early by raising) answers under
        another tag or none: the ranks' checks diverged, and what each rank recorded so far says why."""
        rank, num_ranks = world(self.pg)
        found: list = [None] * num_ranks
        dist.all_gather_object(found, (tag, value), group=self.pg)
        apart = [r for r, f in enumerate(found) if not (isinstance(f, tuple) and len(f) == 2 and f[0] == tag)]
        if apart:
            _SHARED.broken = True
            raise AssertionError(f"rank {rank} in {tag}(): ranks {apart} were in another collective (the ranks' "
                                 f"checks diverged); this rank recorded: {self.errors[:10] or 'nothing'}")
        return [f[1] for f in found]


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def nvlink_env(pg):
    """Skip (on every rank alike) unless the transport is usable everywhere; small SM budgets and few
    CPU threads per rank (N ranks share one GPU and the host's cores) while the module runs."""
    rank, num_ranks = world(pg)
    status = deep_ep.available_transports().get(TRANSPORT)
    mine = (False, f"transport {TRANSPORT!r} is not registered in deep_ep.available_transports()") \
        if status is None else (bool(status.usable), status.reason)
    everyone: list = [None] * num_ranks
    dist.all_gather_object(everyone, mine, group=pg)
    bad = [f"rank {r}: {reason}" for r, (usable, reason) in enumerate(everyone) if not usable]
    if bad:
        pytest.skip(f"{TRANSPORT} transport unusable: " + "; ".join(bad[:4]))
    old_sms, old_threads = deep_ep.Buffer.num_sms, torch.get_num_threads()
    deep_ep.Buffer.set_num_sms(DEFAULT_SMS)
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // num_ranks)))
    yield
    deep_ep.Buffer.num_sms = old_sms
    torch.set_num_threads(old_threads)


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def nvl(pg, nvlink_env):
    if _SHARED.buf is None or _SHARED.broken:
        if _SHARED.buf is not None:
            _SHARED.graveyard.append(_SHARED.buf)
        _, num_ranks = world(pg)
        _SHARED.buf = deep_ep.Buffer(pg, nvl_bytes(num_ranks, MAX_HIDDEN, MAX_TOKENS), 0, transport=TRANSPORT)
        _SHARED.broken = False
    return _SHARED.buf


# ---- helpers -----------------------------------------------------------------------------------------
def config(num_sms: Optional[int]) -> Optional[deep_ep.Config]:
    return None if num_sms is None else deep_ep.Config(num_sms, 6, 256, 6, 128)


def wide(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """bf16 rows whose magnitudes span 2**-20 .. 2**20, so float32 sums depend on the summation order."""
    magnitude = torch.exp2(torch.randint(-20, 21, (rows, 1), generator=gen).float())
    return (torch.randn(rows, cols, generator=gen) * magnitude).to(torch.bfloat16)


def capture_graph(ck: GpuChecker, body: Callable[[], dict], what: str):
    """(graph, outputs): body() captured once into a CUDA graph under ck.run (outputs None if that failed).
    Also the low-latency suite's."""
    graph = torch.cuda.CUDAGraph()

    def capture() -> dict:
        with torch.cuda.graph(graph):
            outs = body()
        torch.cuda.synchronize()
        return outs

    return graph, ck.run(what, capture)


def gpu_sleep() -> None:
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SLEEP_CYCLES)


def late(device, *tensors):
    """Device copies of host tensors, poisoned and then written on the current stream after a GPU sleep:
    a kernel that does not wait for the caller's stream reads poison (NaN) instead of the data."""
    srcs = [t.to(device) if t is not None else None for t in tensors]
    outs = []
    for s in srcs:
        if s is None:
            outs.append(None)
            continue
        d = torch.empty(s.shape, dtype=s.dtype, device=device)
        if d.numel():
            d.view(torch.uint8).fill_(0xFF)
        outs.append(d)
    gpu_sleep()
    for s, d in zip(srcs, outs):
        if d is not None:
            d.copy_(s)
    return outs


def resolve_tokens(spec, gen: torch.Generator, rank: int, hidden: int, rnd: int) -> int:
    if isinstance(spec, int):
        return spec
    if spec == "typical":
        return int(torch.randint(128, (512 if hidden <= 4096 else 256) + 1, (1,), generator=gen))
    if spec == "odd":
        return (37, 1, 3)[(rank + rnd) % 3]
    if spec == "zero":                     # rank 1 holds no tokens at all
        return 0 if rank == 1 else (37, 3)[rnd % 2]
    if spec == "small":
        return int(torch.randint(1, 65, (1,), generator=gen))
    raise ValueError(spec)


def check_handle(ck: GpuChecker, tag: str, handle, expected: oracle.DispatchExpect, exp_in_rank: torch.Tensor,
                 num_tokens: int, hidden: int, worst: bool) -> None:
    with ck.guard(f"{tag} handle"):
        n, rows = expected.num_recv_tokens, expected.recv_x.shape[0]
        ck.true(isinstance(handle, deep_ep.DispatchHandle), f"{tag} handle is a {type(handle).__name__}")
        allowed = (n, -1) if worst else (n,)
        ck.true(handle.num_recv_tokens in allowed, f"{tag} handle.num_recv_tokens {handle.num_recv_tokens}, "
                f"expected one of {allowed}")
        ck.true(handle.num_recv_rows == rows, f"{tag} handle.num_recv_rows {handle.num_recv_rows} != {rows}")
        ck.true(handle.num_tokens == num_tokens and handle.hidden == hidden,
                f"{tag} handle num_tokens/hidden {handle.num_tokens}/{handle.hidden} != {num_tokens}/{hidden}")
        ck.bits(handle.rank_prefix_matrix, expected.rank_prefix_matrix, f"{tag} handle.rank_prefix_matrix")
        ck.bits(handle.recv_src_idx, expected.recv_src_idx, f"{tag} handle.recv_src_idx (-1 on padding rows)")
        ck.bits(handle.send_rows, expected.send_rows, f"{tag} handle.send_rows")
        ck.bits(handle.is_token_in_rank, exp_in_rank, f"{tag} handle.is_token_in_rank")


def check_dispatch(ck: GpuChecker, tag: str, out, expected: oracle.DispatchExpect, exp_in_rank: torch.Tensor, *,
                   fp8: bool, use_topk: bool, worst: bool, num_tokens: int, hidden: int) -> None:
    """out = (recv_x or (recv_x, scales), recv_topk_idx, recv_topk_weights, per-expert list, handle)."""
    recv, r_idx, r_w, lst, handle = out
    cut = expected.num_recv_tokens if worst else expected.recv_x.shape[0]   # rows with defined payload
    with ck.guard(f"{tag} dispatch outputs"):
        if fp8:
            ck.true(isinstance(recv, tuple) and len(recv) == 2, f"{tag} FP8 dispatch must return (recv_x, scales)")
            recv_x, recv_s = recv
        else:
            recv_x, recv_s = recv, None
        e = expected.recv_x
        ck.true(recv_x.dtype == e.dtype and tuple(recv_x.shape) == tuple(e.shape),
                f"{tag} recv_x is {recv_x.dtype}{list(recv_x.shape)}, expected {e.dtype}{list(e.shape)}")
        ck.bits(recv_x[:cut], e[:cut], f"{tag} recv_x")
        if fp8:
            es = expected.recv_x_scales
            ck.true(recv_s.dtype == es.dtype and tuple(recv_s.shape) == tuple(es.shape),
                    f"{tag} recv_x_scales is {recv_s.dtype}{list(recv_s.shape)}, expected {es.dtype}{list(es.shape)}")
            ck.bits(recv_s[:cut], es[:cut], f"{tag} recv_x_scales")
            ck.true(recv_s.is_contiguous(), f"{tag} recv_x_scales must be row-major [rows, S], as DeepEP returns them")
        if use_topk:
            ck.bits(r_idx, expected.recv_topk_idx, f"{tag} recv_topk_idx (-1 on padding rows)")
            ck.bits(None if r_w is None else r_w[:cut], expected.recv_topk_weights[:cut], f"{tag} recv_topk_weights")
        else:
            ck.true(r_idx is None and r_w is None, f"{tag} dispatch without topk_idx must return None top-k")
        want = expected.num_recv_tokens_per_expert_list
        ck.true(isinstance(lst, list) and lst == want, f"{tag} num_recv_tokens_per_expert_list {lst} != {want}")
    check_handle(ck, tag, handle, expected, exp_in_rank, num_tokens, hidden, worst)


# ---- one round: layout, dispatch, cached dispatch, combine ------------------------------------------------
def run_round(buf, pg, gen, device, ck: GpuChecker, *, hidden: int, topk: int, experts: int, tokens,
              num_sms: Optional[int], fp8: bool = False, use_topk: bool = True, expert_alignment: int = 1,
              worst_extra: Optional[int] = None, num_bias: int = 0, p_none: float = 0.1, all_none: bool = True,
              async_mode: Optional[str] = None, column_major_scales: bool = False, zero_copy: str = "",
              rnd: int = 0, tag: str = "") -> None:
    """Every collective (all-gathers for the oracle, agree) runs on every rank in the same order whatever
    fails locally; kernel calls run only while every rank is still healthy. zero_copy: "dispatch" (the tokens
    written into Buffer.get_next_dispatch_buffer's tensor before the dispatch and the cached dispatch),
    "combine" (the expert outputs into get_next_combine_buffer's), "both", or "" (neither)."""
    rank, num_ranks = world(pg)
    experts = num_experts_for(experts, num_ranks)
    num_tokens = resolve_tokens(tokens, gen, rank, hidden, rnd)
    cfg = config(num_sms)
    tag = f"[{tag} round {rnd}, {num_tokens} tokens]"

    # inputs and expectations, all on the host
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    scales = None
    if fp8:
        x, scales = oracle.fp8_cast(x)
    idx = make_topk(num_tokens, topk, experts, gen, p_none, all_none)
    w = torch.rand(num_tokens, topk, generator=gen)
    exp_rank, exp_expert, exp_in_rank = oracle.dispatch_layout(idx, experts, num_ranks)
    x_all, scales_all = allgather(x, pg), allgather(scales, pg)
    idx_all, w_all = allgather(idx, pg), allgather(w, pg)
    in_rank_all, per_expert_all = allgather(exp_in_rank, pg), allgather(exp_expert, pg)
    num_worst = 0
    if worst_extra is not None:
        most = max(sum(int(m[:, j].sum()) for m in in_rank_all) for j in range(num_ranks))
        num_worst = most + worst_extra
    worst = num_worst > 0
    expected = oracle.dispatch(rank, experts, x_all, in_rank_all, scales_all, idx_all if use_topk else None,
                               w_all if use_topk else None, per_expert_all, expert_alignment, num_worst)
    rows = expected.recv_x.shape[0]
    y = wide(gen, rows, hidden)                       # padding rows (num_worst_tokens) hold values to ignore
    y_w = wide(gen, rows, topk).float() if use_topk else None
    biases = [wide(gen, num_tokens, hidden) for _ in range(num_bias)]
    exp_x, exp_w = oracle.combine(rank, allgather(y, pg), in_rank_all, allgather(y_w, pg),
                                  biases[0] if num_bias else None, biases[1] if num_bias == 2 else None)

    # stream-ordering arguments
    kw = {} if async_mode is None else dict(async_finish=True, allocate_on_comm_stream=async_mode == "comm-alloc")

    def ordered() -> dict:
        return dict(kw, previous_event=deep_ep.Buffer.capture()) if kw else {}

    def finish(event, what: str) -> None:
        if kw:
            ck.true(isinstance(event, deep_ep.EventOverlap) and event.event is not None,
                    f"{tag} {what} with async_finish=True must return an EventOverlap holding an event")
            event.current_stream_wait()

    d_idx, d_w = idx.to(device), w.to(device)

    def do_layout():
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(d_idx, experts, **ordered())
        finish(ev, "get_dispatch_layout")
        return per_rank, per_rdma, per_expert, in_rank

    layout = ck.run(f"{tag} get_dispatch_layout", do_layout)
    if layout is not None:
        per_rank, per_rdma, per_expert, in_rank = layout
        ck.true(per_rdma is None, f"{tag} num_tokens_per_rdma_rank is not None")
        ck.bits(per_rank, exp_rank, f"{tag} num_tokens_per_rank")
        ck.bits(per_expert, exp_expert, f"{tag} num_tokens_per_expert")
        ck.bits(in_rank, exp_in_rank, f"{tag} is_token_in_rank")
    else:   # go on with the oracle's layout so that dispatch still runs on every rank
        per_rank, per_expert, in_rank = exp_rank.to(device), exp_expert.to(device), exp_in_rank.to(device)

    def payload():
        d = late(device, x, scales)
        if zero_copy in ("dispatch", "both"):   # the tokens written into the Buffer itself (collective)
            in_buffer = buf.get_next_dispatch_buffer(num_tokens, hidden, d[0].dtype)
            in_buffer.copy_(d[0])
            d[0] = in_buffer
        if fp8 and column_major_scales:   # what DeepGEMM consumes and DeepEP's tests pass: read in place
            return d[0], d[1].T.contiguous().T
        return (d[0], d[1]) if fp8 else d[0]

    def do_dispatch():
        d_x = payload()
        recv, r_idx, r_w, lst, handle, ev = buf.dispatch(
            d_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=d_idx if use_topk else None, topk_weights=d_w if use_topk else None,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst, config=cfg, **ordered())
        finish(ev, "dispatch")
        return recv, r_idx, r_w, lst, handle

    out = ck.run(f"{tag} dispatch", do_dispatch)
    if not ck.agree(out is not None):
        return
    check_dispatch(ck, tag, out, expected, exp_in_rank, fp8=fp8, use_topk=use_topk, worst=worst,
                   num_tokens=num_tokens, hidden=hidden)
    handle = out[4]
    cut = expected.num_recv_tokens if worst else rows

    def do_cached():
        res = buf.dispatch(payload(), handle=handle, config=cfg, **ordered())
        finish(res[5], "cached dispatch")
        return res[:5]

    cached = ck.run(f"{tag} cached dispatch", do_cached)
    if cached is not None:
        with ck.guard(f"{tag} cached dispatch outputs"):
            ck.true(all(r is None for r in cached[1:5]),
                    f"{tag} cached dispatch must return None for topk_idx/weights/list/handle")
            c_x, c_s = cached[0] if fp8 else (cached[0], None)
            ck.bits(c_x[:cut], expected.recv_x[:cut], f"{tag} cached recv_x")
            if fp8:
                ck.bits(c_s[:cut], expected.recv_x_scales[:cut], f"{tag} cached recv_x_scales")
    if not ck.agree(cached is not None):
        return

    def do_combine():
        d_y, d_b0, d_b1 = late(device, y, biases[0] if num_bias else None, biases[1] if num_bias == 2 else None)
        bias = None if num_bias == 0 else (d_b0 if num_bias == 1 else (d_b0, d_b1))
        if zero_copy in ("combine", "both"):   # the expert outputs written into the Buffer itself (collective)
            in_buffer = buf.get_next_combine_buffer(handle)
            in_buffer.copy_(d_y)
            d_y = in_buffer
        cx, cw, ev = buf.combine(d_y, handle, topk_weights=y_w.to(device) if use_topk else None, bias=bias,
                                 config=cfg, **ordered())
        finish(ev, "combine")
        return cx, cw

    combined = ck.run(f"{tag} combine", do_combine)
    if combined is not None:
        ck.bits(combined[0], exp_x, f"{tag} combined_x")
        ck.bits(combined[1], exp_w, f"{tag} combined_topk_weights")
    ck.agree(combined is not None)


def run_case(buf, pg, gen, device, ck: GpuChecker, rounds: int = 2, tag: str = "", **case) -> None:
    for rnd in range(rounds):
        if not ck.agree(not ck.errors):
            break
        run_round(buf, pg, gen, device, ck, rnd=rnd, tag=tag, **case)


# ---- normal dispatch / combine ---------------------------------------------------------------------------
CASES = {
    "bf16-h2048-top8-sm4": dict(hidden=2048, topk=8, experts=256, tokens="typical", num_sms=4),
    "bf16-h4096-top8-sm8-align4-bias1": dict(hidden=4096, topk=8, experts=256, tokens="typical", num_sms=8,
                                             expert_alignment=4, num_bias=1),
    "bf16-h7168-top8-sm8-bias2": dict(hidden=7168, topk=8, experts=256, tokens="typical", num_sms=8, num_bias=2),
    "bf16-h7680-top3-odd-sm4-bias1": dict(hidden=7680, topk=3, experts=24, tokens="odd", num_sms=4, num_bias=1),
    "fp8-h7168-top8-sm4-align4-bias1": dict(hidden=7168, fp8=True, topk=8, experts=256, tokens="typical", num_sms=4,
                                            expert_alignment=4, num_bias=1),
    "fp8-h7168-top3-odd-sm8-worst": dict(hidden=7168, fp8=True, topk=3, experts=24, tokens="odd", num_sms=8,
                                         worst_extra=5),
    "fp8-h7168-top8-column-major-scales": dict(hidden=7168, fp8=True, topk=8, experts=256, tokens="typical",
                                               num_sms=8, column_major_scales=True),
    "bf16-h2048-top3-zero-rank-sm8-bias2": dict(hidden=2048, topk=3, experts=24, tokens="zero", num_sms=8, num_bias=2),
    "bf16-h4096-no-topk-odd-sm4-align4": dict(hidden=4096, topk=8, experts=256, tokens="odd", num_sms=4,
                                              use_topk=False, expert_alignment=4),
    "bf16-h4096-top8-sm8-worst-exact": dict(hidden=4096, topk=8, experts=256, tokens="typical", num_sms=8,
                                            worst_extra=0, num_bias=1),
    # more tokens than one step of the stage kernel's send-position scan (512), with fewer blocks than ranks
    "bf16-h2048-top8-1100-tokens-sm4": dict(hidden=2048, topk=8, experts=256, tokens=1100, num_sms=4),
    "bf16-h7168-top8-dense-default-config": dict(hidden=7168, topk=8, experts=256, tokens="small", num_sms=None,
                                                 p_none=0.0, all_none=False),
    # the expert outputs written into Buffer.get_next_combine_buffer's view (the combine reads them in place)
    # and the tokens written into Buffer.get_next_dispatch_buffer's (the dispatch's peers read them in place)
    "bf16-h7168-top8-sm8-bias1-zero-copy": dict(hidden=7168, topk=8, experts=256, tokens="typical", num_sms=8,
                                                num_bias=1, zero_copy="combine"),
    "fp8-h7168-top3-odd-sm4-worst-zero-copy": dict(hidden=7168, fp8=True, topk=3, experts=24, tokens="odd",
                                                   num_sms=4, worst_extra=5, zero_copy="both"),
    "bf16-h2048-no-topk-zero-rank-zero-copy": dict(hidden=2048, topk=3, experts=24, tokens="zero", num_sms=8,
                                                   use_topk=False, zero_copy="both"),
    "fp8-h7168-top8-column-major-zero-copy-dispatch": dict(hidden=7168, fp8=True, topk=8, experts=256,
                                                           tokens="typical", num_sms=8, column_major_scales=True,
                                                           zero_copy="dispatch"),
    "bf16-h4096-top8-sm4-align4-zero-copy-dispatch": dict(hidden=4096, topk=8, experts=256, tokens="odd",
                                                          num_sms=4, expert_alignment=4, zero_copy="dispatch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_combine(nvl, pg, device, request, base_seed, case):
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    ck = GpuChecker(pg)
    run_case(nvl, pg, gen, device, ck, tag=case, **CASES[case])
    ck.done()


def test_round_counter_past_2_32(pg, device, request, base_seed, nvlink_env):
    """The round counter preset just below 2^32 on every rank of a fresh Buffer: dispatches and combines keep
    matching the oracle across the wrap of a 32-bit field (every round word is 64-bit)."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    buf = deep_ep.Buffer(pg, nvl_bytes(num_ranks, 2048, 64), 0, transport=TRANSPORT)
    _SHARED.graveyard.append(buf)
    window = buf.backend.engine("normal").window
    preset = (1 << 32) - 2
    torch.cuda.synchronize()
    window.view(L.CTRL_ROUND, 8, device).view(torch.int64)[0] = preset
    # As a Buffer past `preset` rounds holds it: every peer told DONE = preset at the end of its last pull.
    window.view(L.CTRL_DONE, 8 * num_ranks, device).view(torch.int64).fill_(preset)
    torch.cuda.synchronize()
    dist.barrier(group=pg)   # every rank preset before anyone signals
    ck = GpuChecker(pg)
    run_case(buf, pg, gen, device, ck, rounds=3, tag="wrap", hidden=2048, topk=4, experts=32, tokens="odd",
             num_sms=4, num_bias=1)
    round_now = int(window.view(L.CTRL_ROUND, 8, device).view(torch.int64)[0])
    ck.true(round_now > (1 << 32), f"round counter {round_now}: did not cross 2^32 from {preset}")
    ck.done()


ASYNC_CASES = {
    "bf16-h4096-async": dict(hidden=4096, topk=8, experts=256, tokens="typical", num_sms=8, num_bias=1,
                             async_mode="async"),
    "fp8-h7168-async-comm-alloc": dict(hidden=7168, fp8=True, topk=8, experts=256, tokens="typical", num_sms=4,
                                       num_bias=2, async_mode="comm-alloc"),
    "bf16-h2048-zero-rank-worst-async-comm-alloc": dict(hidden=2048, topk=3, experts=24, tokens="zero", num_sms=4,
                                                        worst_extra=2, async_mode="comm-alloc"),
}


def test_zero_copy_combine_matches_the_staged_one_and_refuses_overlap(nvl, pg, device, request, base_seed):
    """Buffer.get_next_combine_buffer: an x that overlaps the Buffer's combine area without being that tensor
    is refused before any launch (it would be copied onto itself mid-read), on every rank with rows; then the
    zero-copy combine of the received rows gives bit for bit the staged combine's result on the same handle."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    hidden, experts = 4096, num_experts_for(64, num_ranks)
    n = int(torch.randint(0, 200, (1,), generator=gen))
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = make_topk(n, 4, experts, gen, 0.1).to(device)
    ck = GpuChecker(pg)

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = nvl.get_dispatch_layout(idx, experts)
        recv_x, *_, handle, _ = nvl.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                             num_tokens_per_expert=per_expert)
        return recv_x, handle

    def staged_then_zero_copy():
        recv_x, handle = dispatch()
        staged, _, _ = nvl.combine(recv_x, handle)
        recv_x, handle = dispatch()
        area = nvl.get_next_combine_buffer(handle)
        refused = True
        # Every rank refuses this call (a refusal on some ranks only would stop the Buffer: failures.py): an empty x
        # reads nothing and would run, so a rank without rows makes another bad call of the same op.
        shifted = nvl.get_local_buffer_tensor(torch.bfloat16, area.shape,
                                              offset=L.NormalLayout.combine_rows_offset() + 16)
        try:
            nvl.combine(shifted if area.numel() else recv_x.float(), handle)
            refused = False
        except (TypeError, ValueError) as e:
            refused = "overlaps" in str(e) or not area.numel()
        if area.numel():
            area = nvl.get_next_combine_buffer(handle)   # the refused call closed the opened area: open it again
        area.copy_(recv_x)
        engine = nvl.backend.engine("normal")
        before = engine.in_place_combines
        in_place, _, _ = nvl.combine(area, handle)
        torch.cuda.synchronize()
        return staged, in_place, refused and engine.in_place_combines == before + (area.numel() > 0)

    out = ck.run("zero-copy combine", staged_then_zero_copy)
    if out is not None:
        staged, in_place, refused = out
        ck.true(refused, "combine(x overlapping the combine area) must raise ValueError naming the overlap, and "
                         "combine(get_next_combine_buffer's tensor) must read it in place")
        ck.bits(in_place, staged, "zero-copy combine vs the staged combine")
    ck.done()


def test_zero_copy_dispatch_matches_the_staged_one_and_refuses_stale_rows(nvl, pg, device, request, base_seed):
    """Buffer.get_next_dispatch_buffer: FP8 tokens written into its tensor dispatch, fresh and cached, bit for bit
    as the same tokens from outside the Buffer. The same tensor passed again without reopening it (the peers may
    still read those rows) is refused before any launch on every rank with tokens, and the Buffer goes on: reopened,
    the rows still hold the tokens, and a cached dispatch reads them in place."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    hidden, experts, topk = 2048, num_experts_for(64, num_ranks), 4
    n = int(torch.randint(0, 200, (1,), generator=gen))
    x, scales = (t.to(device) for t in oracle.fp8_cast(torch.randn(n, hidden, generator=gen).to(torch.bfloat16)))
    idx = make_topk(n, topk, experts, gen, 0.1).to(device)
    w = torch.rand(n, topk, generator=gen).to(device)
    ck = GpuChecker(pg)

    def staged_then_zero_copy():
        per_rank, _, per_expert, in_rank, _ = nvl.get_dispatch_layout(idx, experts)

        def dispatch(tokens):
            return nvl.dispatch((tokens, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

        staged = dispatch(x)
        rows = nvl.get_next_dispatch_buffer(n, hidden, x.dtype)
        rows.copy_(x)
        engine = nvl.backend.engine("normal")
        before = engine.in_place_dispatches
        zero = dispatch(rows)
        refused = True
        try:   # every rank refuses (see the zero-copy combine test): an empty x would run, so a wrong dtype there
            dispatch(rows if n else rows.view(torch.uint8))
            refused = False
        except (TypeError, ValueError) as e:
            refused = "overlaps" in str(e) or not n
        rows = nvl.get_next_dispatch_buffer(n, hidden, x.dtype)   # the refused call closed the rows: reopen
        cached = nvl.dispatch((rows, scales), handle=zero[4])
        torch.cuda.synchronize()
        return staged, zero, cached, refused, engine.in_place_dispatches - before

    out = ck.run("zero-copy dispatch", staged_then_zero_copy)
    if out is not None:
        staged, zero, cached, refused, in_place = out
        ck.true(refused and in_place == (2 if n else 0),
                f"dispatch(rows not reopened) must raise ValueError naming the overlap ({refused}), and both "
                f"dispatches of get_next_dispatch_buffer's tensor must read it in place ({in_place} did)")
        for k, what in enumerate(("recv_x", "recv_x_scales")):
            ck.bits(zero[0][k], staged[0][k], f"zero-copy dispatch {what} vs the staged dispatch")
            ck.bits(cached[0][k], staged[0][k], f"zero-copy cached dispatch {what} vs the staged dispatch")
        ck.bits(zero[1], staged[1], "zero-copy dispatch recv_topk_idx")
        ck.bits(zero[2], staged[2], "zero-copy dispatch recv_topk_weights")
        ck.bits(zero[4].send_rows, staged[4].send_rows, "zero-copy dispatch handle.send_rows")
    ck.done()


def combine_inputs(pg, device, request, base_seed, min_tokens: int):
    """(rank, num_ranks, experts, x, w, idx) of the combine tests below: up to 149 tokens of hidden 2048, top-4 of
    32 experts (per rank count), seeded per rank."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    hidden, experts = 2048, num_experts_for(32, num_ranks)
    n = int(torch.randint(min_tokens, 150, (1,), generator=gen))
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16).to(device)
    w = torch.rand(n, 4, generator=gen).to(device)
    idx = make_topk(n, 4, experts, gen, 0.1).to(device)
    return rank, num_ranks, experts, x, w, idx


@pytest.mark.parametrize("path", ["eager", "full"])
def test_combine_whose_outputs_cannot_be_allocated_serves_its_peers(nvl, pg, device, request, base_seed, path):
    """The combine allocates its outputs after its stage kernel's launch (host time off the GPU's path). When that
    allocation fails on one rank (out of memory, forced here), the rank still runs a pull of no tokens: its peers'
    combines finish with their right result, it raises the allocation error, and the next combine works everywhere.
    Both paths: the eager one (the plain call) and the full one (async_finish, then a wait on its event)."""
    rank, num_ranks, experts, x, w, idx = combine_inputs(pg, device, request, base_seed, min_tokens=1)
    engine = nvl.backend.engine("normal")
    failing = num_ranks - 1
    ck = GpuChecker(pg)

    def no_memory(*_args):
        raise torch.cuda.OutOfMemoryError("forced by the test: no memory for the combine's outputs")

    def rounds():
        per_rank, _, per_expert, in_rank, _ = nvl.get_dispatch_layout(idx, experts)
        recv_x, _, recv_w, _, handle, _ = nvl.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        first, raised = None, ""
        if rank == failing:
            engine._combine_outputs = no_memory   # this instance only; removed below
        try:
            if path == "eager":
                first = nvl.combine(recv_x, handle, recv_w)[:2]
            else:
                *first, event = nvl.combine(recv_x, handle, recv_w, async_finish=True)
                event.current_stream_wait()
        except torch.cuda.OutOfMemoryError as e:
            raised = str(e)
        finally:
            engine.__dict__.pop("_combine_outputs", None)
        again = nvl.combine(recv_x, handle, recv_w)[:2]
        torch.cuda.synchronize()
        return first, raised, again

    out = ck.run("combine with a failing output allocation on one rank", rounds)
    if out is not None:
        first, raised, again = out
        if rank == failing:
            ck.true(first is None and "forced by the test" in raised,
                    f"the failing rank must raise the allocation error (raised {raised!r})")
        else:
            ck.true(first is not None and not raised, f"a peer of the failing rank must combine ({raised!r})")
            if first is not None:
                ck.bits(first[0], again[0], "combined x beside a failed rank vs the next combine")
                ck.bits(first[1], again[1], "combined top-k weights beside a failed rank vs the next combine")
    ck.done()


CONFIG_SMS = 8   # test_eager_combine_matches_the_full_path's Config


def test_eager_combine_matches_the_full_path(nvl, pg, device, request, base_seed):
    """The common combine call (nothing to overlap, no bias, x outside the Buffer) takes the eager path
    (IntranodeEngine.combine_eager), with and without top-k weights and with a Config; the same inputs through the full
    path (async_finish, then a wait on its event) give bit for bit the same outputs."""
    _, _, experts, x, w, idx = combine_inputs(pg, device, request, base_seed, min_tokens=0)
    engine = nvl.backend.engine("normal")
    ck = GpuChecker(pg)

    def both_paths():
        per_rank, _, per_expert, in_rank, _ = nvl.get_dispatch_layout(idx, experts)
        recv_x, _, recv_w, _, handle, _ = nvl.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        before = engine.eager_combines
        eager = nvl.combine(recv_x, handle, recv_w)[:2]
        eager_no_w = nvl.combine(recv_x, handle)[0]
        # A budget whose grid is not the default combine's (Buffer.num_sms: 16 or 20 blocks when 8 or 4 ranks share
        # 132 SMs), and no plan of that grid left from earlier tests: the Config's plan must come from this call.
        # Plans are keyed (hidden, topk, grid, arch).
        for key in [k for k in engine._eager_plans if k[2] == engine.grid(CONFIG_SMS)]:
            del engine._eager_plans[key]
        eager_cfg = nvl.combine(recv_x, handle, recv_w, config=deep_ep.Config(CONFIG_SMS))[:2]
        taken = engine.eager_combines - before
        config_grid = any(key[2] == engine.grid(CONFIG_SMS) for key in engine._eager_plans)
        full_x, full_w, event = nvl.combine(recv_x, handle, recv_w, async_finish=True)
        event.current_stream_wait()
        torch.cuda.synchronize()
        return eager, eager_no_w, eager_cfg, (full_x, full_w), taken, engine.eager_combines - before, config_grid

    out = ck.run("eager combine against the full path", both_paths)
    if out is not None:
        eager, eager_no_w, eager_cfg, full, taken, after, config_grid = out
        ck.true(taken == 3 and after == 3, f"three eager combines then a full one: {taken} then {after} eager")
        ck.true(config_grid, f"the combine with Config({CONFIG_SMS}) must take its plan for {engine.grid(CONFIG_SMS)} "
                             f"blocks")
        for what, got in (("eager", eager), ("eager with a Config", eager_cfg)):
            ck.bits(got[0], full[0], f"{what} combined x vs the full path")
            ck.bits(got[1], full[1], f"{what} combined top-k weights vs the full path")
        ck.bits(eager_no_w, full[0], "eager combined x without weights vs the full path")
    ck.done()


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_async_previous_event(nvl, pg, device, request, base_seed, case):
    """previous_event=Buffer.capture(), async_finish=True (event waited on before reading), and
    allocate_on_comm_stream=True, for the layout, dispatch, cached dispatch and combine."""
    rank, _ = world(pg)
    gen = generator(request, base_seed, rank)
    ck = GpuChecker(pg)
    run_case(nvl, pg, gen, device, ck, tag=case, **ASYNC_CASES[case])
    ck.done()


# ---- CUDA graph --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8,zero_copy", [(False, False), (True, False), (True, True)],
                         ids=["bf16-h4096", "fp8-h7168", "fp8-h7168-zero-copy"])
def test_cuda_graph_num_worst_tokens(nvl, pg, device, request, base_seed, fp8, zero_copy):
    """dispatch + combine captured once (num_worst_tokens: no host sync), replayed with new input contents
    (tokens, experts, weights, biases, combine inputs); every replay must match the oracle. Then an eager
    round on the same Buffer. zero_copy: the tokens and the expert outputs are written into the Buffer
    (get_next_dispatch_buffer / get_next_combine_buffer, their openers captured with the ops)."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    hidden, topk = (7168 if fp8 else 4096), 8
    experts = num_experts_for(256, num_ranks)
    counts = [40 + 3 * r for r in range(num_ranks)]
    num_tokens, num_worst = counts[rank], sum(counts)      # num_worst: every token of every rank
    cfg = config(8)
    ck = GpuChecker(pg)

    def draw() -> dict:
        x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
        scales = None
        if fp8:
            x, scales = oracle.fp8_cast(x)
        return dict(x=x, scales=scales, idx=make_topk(num_tokens, topk, experts, gen),
                    w=torch.rand(num_tokens, topk, generator=gen),
                    row_scale=torch.exp2(torch.randint(-12, 13, (num_worst, 1), generator=gen).float()).to(torch.bfloat16),
                    bias=wide(gen, num_tokens, hidden))

    host = draw()
    st = {k: (v.to(device).clone() if v is not None else None) for k, v in host.items()}
    lay = oracle.dispatch_layout(host["idx"], experts, num_ranks)
    st["per_rank"], st["per_expert"], st["in_rank"] = (t.to(device).clone() for t in lay)

    def load(h: dict, tag: str) -> None:
        """New contents into the captured inputs (same tensors), layout from get_dispatch_layout."""
        for k in ("x", "scales", "idx", "w", "row_scale", "bias"):
            if st[k] is not None:
                st[k].copy_(h[k].to(device))
        exp = oracle.dispatch_layout(h["idx"], experts, num_ranks)
        got = ck.run(f"[{tag}] get_dispatch_layout", lambda: nvl.get_dispatch_layout(st["idx"], experts))
        if got is not None:
            for t, e, name in zip((got[0], got[2], got[3]), exp, ("num_tokens_per_rank", "num_tokens_per_expert",
                                                                   "is_token_in_rank")):
                ck.bits(t, e, f"[{tag}] {name}")
            src = (got[0], got[2], got[3])
        else:
            src = tuple(t.to(device) for t in exp)
        for k, t in zip(("per_rank", "per_expert", "in_rank"), src):
            st[k].copy_(t)
        torch.cuda.synchronize()

    def body() -> dict:
        tokens = st["x"]
        if zero_copy:
            tokens = nvl.get_next_dispatch_buffer(num_tokens, hidden, tokens.dtype)
            tokens.copy_(st["x"])
        x_in = (tokens, st["scales"]) if fp8 else tokens
        recv, r_idx, r_w, lst, handle, _ = nvl.dispatch(
            x_in, num_tokens_per_rank=st["per_rank"], is_token_in_rank=st["in_rank"],
            num_tokens_per_expert=st["per_expert"], topk_idx=st["idx"], topk_weights=st["w"],
            num_worst_tokens=num_worst, config=cfg)
        recv_x = recv[0] if fp8 else recv
        y = recv_x.to(torch.bfloat16) * st["row_scale"]      # expert "compute" on the dispatched rows
        y_in = y
        if zero_copy:
            y_in = nvl.get_next_combine_buffer(handle)
            y_in.copy_(y)
        combined, combined_w, _ = nvl.combine(y_in, handle, topk_weights=r_w, bias=st["bias"], config=cfg)
        return dict(out=(recv, r_idx, r_w, lst, handle), y=y, combined=combined, combined_w=combined_w)

    def check(outs: Optional[dict], h: dict, tag: str) -> None:
        """Collectives run whatever `outs` holds (None: the call failed on this rank)."""
        exp_rank, exp_expert, exp_in_rank = oracle.dispatch_layout(h["idx"], experts, num_ranks)
        in_rank_all = allgather(exp_in_rank, pg)
        expected = oracle.dispatch(rank, experts, allgather(h["x"], pg), in_rank_all, allgather(h["scales"], pg),
                                   allgather(h["idx"], pg), allgather(h["w"], pg), allgather(exp_expert, pg),
                                   1, num_worst)
        y = r_w = None
        if outs is not None:
            check_dispatch(ck, tag, outs["out"], expected, exp_in_rank, fp8=fp8, use_topk=True, worst=True,
                           num_tokens=num_tokens, hidden=hidden)
            y = ck.host(outs["y"], f"{tag} y")
            r_w = ck.host(outs["out"][2], f"{tag} recv_topk_weights")
        ok = (y is not None and tuple(y.shape) == (num_worst, hidden)
              and r_w is not None and tuple(r_w.shape) == (num_worst, topk))
        if outs is not None and not ok:
            ck.true(False, f"[{tag}] combine inputs y/recv_topk_weights unusable for the oracle")
        if not ok:
            y = torch.zeros(num_worst, hidden, dtype=torch.bfloat16)
            r_w = torch.zeros(num_worst, topk)
        y_all, r_w_all = allgather(y.to(torch.bfloat16), pg), allgather(r_w.float(), pg)
        if outs is not None and ok:
            exp = ck.run(f"[{tag}] oracle.combine", lambda: oracle.combine(rank, y_all, in_rank_all, r_w_all,
                                                                         h["bias"], None))
            if exp is not None:
                ck.bits(outs["combined"], exp[0], f"[{tag}] combined_x")
                ck.bits(outs["combined_w"], exp[1], f"[{tag}] combined_topk_weights")

    load(host, "warm-up")
    side = torch.cuda.Stream()

    def warm_up() -> dict:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs = body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return outs

    outs0 = ck.run("[graph warm-up] eager dispatch+combine", warm_up)
    check(outs0, host, "graph warm-up (eager)")
    if ck.agree(outs0 is not None and not ck.errors):
        graph, outs = capture_graph(ck, body, "[graph] capture of dispatch+combine")
        if ck.agree(outs is not None):
            for i in range(3):
                host = draw()
                load(host, f"replay {i}")
                done = ck.run(f"[graph replay {i}] replay", lambda: (graph.replay(), torch.cuda.synchronize()))
                check(outs if done is not None else None, host, f"graph replay {i}")
                if not ck.agree(not ck.errors):
                    break
    if ck.agree(not ck.errors):
        run_round(nvl, pg, gen, device, ck, hidden=2048, topk=3, experts=24, tokens="odd", num_sms=4,
                  tag="eager after graph replays")
    ck.done()


# ---- sm_80 code path ---------------------------------------------------------------------------------
def test_sm80_variant(pg, device, request, base_seed, nvlink_env):
    """Kernels compiled as sm_80 (no TMA/clusters), loaded through PTX JIT, on a fresh Buffer."""
    from deepep_portable import jit

    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    ck = GpuChecker(pg)
    old = os.environ.get(FORCE_ARCH)
    try:
        os.environ[FORCE_ARCH] = "sm_80"
        jit.clear_memory_cache()
        buf = ck.run("Buffer with DEEPEP_PORTABLE_FORCE_ARCH=sm_80", lambda: deep_ep.Buffer(
            pg, nvl_bytes(num_ranks, 7168, 64), 0, transport=TRANSPORT))
        if ck.agree(buf is not None):
            _SHARED.graveyard.append(buf)
            run_round(buf, pg, gen, device, ck, hidden=4096, topk=8, experts=256, tokens="odd", num_sms=4,
                      num_bias=2, tag="sm_80 bf16")
            if ck.agree(not ck.errors):
                run_round(buf, pg, gen, device, ck, hidden=7168, fp8=True, topk=8, experts=256, tokens="small",
                          num_sms=8, worst_extra=3, rnd=1, tag="sm_80 fp8")
    finally:
        if old is None:
            os.environ.pop(FORCE_ARCH, None)
        else:
            os.environ[FORCE_ARCH] = old
        jit.clear_memory_cache()
    ck.done()


# ---- timeout (keep last: it leaves a Buffer behind that a peer never finished) -------------------------
@pytest.mark.mpi(min_size=2)
def test_zz_timeout_names_op_rank_peer_then_fresh_buffer_works(nvl, pg, device, request, base_seed):
    """Rank 1 skips a dispatch the others call: they raise deep_ep.CommTimeoutError (a RuntimeError with
    .op, .rank, .peer) naming "dispatch", their rank and a peer, within about timeout_s. Then every rank
    creates a fresh Buffer and a normal round passes."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    shape = dict(hidden=2048, topk=3, experts=24, num_sms=4)
    experts = num_experts_for(24, num_ranks)
    ck = GpuChecker(pg)

    # JIT-compile this shape's kernels on the shared Buffer first, so no compile runs under the 3 s timeout.
    run_round(nvl, pg, gen, device, ck, tokens="odd", tag="warm-up", **shape)
    if ck.agree(not ck.errors):
        tbuf = ck.run(f"Buffer(timeout_s={TIMEOUT_S})", lambda: deep_ep.Buffer(
            pg, nvl_bytes(num_ranks, 2048, 64), 0, transport=TRANSPORT, timeout_s=TIMEOUT_S))
        if ck.agree(tbuf is not None):
            _SHARED.graveyard.append(tbuf)
            run_round(tbuf, pg, gen, device, ck, tokens="odd", tag=f"timeout_s={TIMEOUT_S}, all ranks", **shape)
            if ck.agree(not ck.errors):
                # every token goes to several ranks; every rank waits on every peer for its counts anyway
                x = torch.randn(37, 2048, generator=gen).to(torch.bfloat16).to(device)
                idx = make_topk(37, 3, experts, gen, p_none=0.0, all_none_token=False).to(device)
                w = torch.rand(37, 3, generator=gen).to(device)
                layout = ck.run("get_dispatch_layout (timeout buffer)",
                                lambda: tbuf.get_dispatch_layout(idx, experts))
                if ck.agree(layout is not None):
                    per_rank, _, per_expert, in_rank, _ = layout
                    torch.cuda.synchronize()
                    dist.barrier(group=pg)
                    if rank != 1:
                        caught = None
                        t0 = time.monotonic()
                        try:
                            tbuf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                          config=config(4))
                            torch.cuda.synchronize()
                        except Exception as e:   # noqa: BLE001 - inspected below
                            caught = e
                        elapsed = time.monotonic() - t0
                        print(f"\n[rank {rank}] dispatch without rank 1: {elapsed:.2f} s, "
                              f"{_short(caught) if caught is not None else 'no exception'}")
                        check_timeout(ck, caught, elapsed, rank, num_ranks)
                    # the waiting kernels must have ended: nothing may still be spinning on this GPU
                    with ck.guard("torch.cuda.synchronize() after the timeout"):
                        torch.cuda.synchronize()

    # recovery: every rank (rank 1 included) meets here, then a fresh Buffer must work
    dist.barrier(group=pg)
    fresh = ck.run("fresh Buffer after the timeout", lambda: deep_ep.Buffer(
        pg, nvl_bytes(num_ranks, 2048, 64), 0, transport=TRANSPORT))
    if ck.agree(fresh is not None):
        _SHARED.graveyard.append(fresh)
        for rnd in range(2):
            run_round(fresh, pg, gen, device, ck, tokens="odd", rnd=rnd, tag="fresh Buffer after timeout", **shape)
    ck.done()


def check_timeout(ck: GpuChecker, caught: Optional[BaseException], elapsed: float, rank: int, num_ranks: int) -> None:
    err_cls = getattr(deep_ep, "CommTimeoutError", None)
    ck.true(err_cls is not None, "deep_ep.CommTimeoutError is not exported")
    if caught is None:
        ck.true(False, "dispatch with rank 1 absent returned without raising")
        return
    msg = str(caught)
    ck.true(err_cls is not None and isinstance(caught, err_cls), f"expected CommTimeoutError, got {_short(caught)}")
    ck.true(isinstance(caught, RuntimeError), f"{type(caught).__name__} is not a RuntimeError")
    op, err_rank, peer = (getattr(caught, a, None) for a in ("op", "rank", "peer"))
    ck.true(isinstance(op, str) and "dispatch" in op, f".op is {op!r}, expected it to name dispatch")
    ck.true(err_rank == rank, f".rank is {err_rank!r}, expected {rank}")
    ck.true(isinstance(peer, int) and 0 <= peer < num_ranks and peer != rank,
            f".peer is {peer!r}, expected another rank in [0, {num_ranks})")
    ck.true("dispatch" in msg, f"message does not name the op: {msg!r}")
    ck.true(re.search(rf"\b{rank}\b", msg) is not None, f"message does not name rank {rank}: {msg!r}")
    if isinstance(peer, int):
        ck.true(re.search(rf"\b{peer}\b", msg) is not None, f"message does not name peer {peer}: {msg!r}")
    ck.true(TIMEOUT_S * 0.5 <= elapsed < TIMEOUT_S + 30,
            f"raised after {elapsed:.2f} s with timeout_s={TIMEOUT_S} (expected about the timeout)")


def test_zero_copy_combine_in_a_buffer_sized_by_the_hint(pg, device, request, base_seed):
    """A Buffer sized by get_nvl_buffer_size_hint for n tokens per rank takes the zero-copy combine of a full
    dispatch (every rank sends all n tokens to every rank: R x n rows received) at top-k up to the hints' 32, bit
    for bit the staged combine (the 2-rank nvshmem fuzz found get_next_combine_buffer refusing such rows: it
    checked them at top-k 128); a combine of the opened area at top-k 128, where the rows leave its weights no
    room, is refused before anything runs, and the Buffer still works."""
    rank, num_ranks = world(pg)
    gen = generator(request, base_seed, rank)
    n, hidden, topk = 3, 7168, max(8, num_ranks)   # top-k >= R: every token reaches every rank
    experts = num_ranks * topk
    buf = deep_ep.Buffer(pg, deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, n), 0,
                         transport=TRANSPORT, explicitly_destroy=True)
    try:
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16).to(device)
        # token t selects experts k * R + (t mod R), k < topk: distinct, and on every rank (rank of e: e // topk)
        idx = torch.stack([torch.arange(topk) * num_ranks + (t % num_ranks) for t in range(n)]) % experts
        idx, w = idx.to(device), torch.rand(n, topk, generator=gen).to(device)
        ck = GpuChecker(pg)

        def both():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w)
            staged = buf.combine(recv_x, handle, topk_weights=recv_w)[0]
            area = buf.get_next_combine_buffer(handle)
            wide = torch.ones(recv_x.size(0), L.MAX_TOPK, dtype=torch.float32, device=device)
            try:   # the rows fill the area: no room for 128 weights each
                buf.combine(area, handle, topk_weights=wide)
                refused = False
            except ValueError:
                refused = True
            area = buf.get_next_combine_buffer(handle)   # the refused call closed it: open it again
            area.copy_(recv_x)
            in_place = buf.combine(area, handle, topk_weights=recv_w)[0]
            torch.cuda.synchronize()
            return recv_x.size(0), staged, in_place, refused

        out = ck.run("zero-copy combine, hint-sized Buffer", both)
        if out is not None:
            rows, staged, in_place, refused = out
            ck.true(rows == num_ranks * n, f"received {rows} rows, expected {num_ranks * n}")
            ck.true(refused, "a combine of the area at top-k 128 with no room for its weights must raise ValueError")
            ck.bits(in_place, staged, "zero-copy combine vs the staged combine")
        ck.done()
    finally:
        buf.destroy()
