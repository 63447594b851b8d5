"""Host-side checks of the intranode kernels that need no GPU: parameter structs against the
compiled kernels, and the buffer layout arithmetic."""
import ctypes
import os
import re
import subprocess

import pytest

from deepep_portable import jit
from deepep_portable import errors
from deepep_portable.engines import intranode
from deepep_portable import layout as L

try:
    NVCC = jit.find_nvcc()
except Exception:   # pragma: no cover - CI installs a compiler
    NVCC = None


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
@pytest.mark.parametrize("source,kernel,struct,defines", [
    (intranode.DISPATCH_SOURCE, intranode.DISPATCH_KERNELS[1], intranode.DispatchParams,
     dict(NUM_RANKS=3, HIDDEN_BYTES=256, NUM_TOPK=5, NUM_SCALES=2)),
    (intranode.COMBINE_SOURCE, intranode.COMBINE_KERNELS[1], intranode.CombineParams,
     dict(NUM_RANKS=3, HIDDEN=128, NUM_TOPK=0)),
    (intranode.OPEN_ROUND_SOURCE, intranode.OPEN_ROUND_KERNEL, intranode.OpenRoundParams, {}),
])
def test_param_struct_matches_kernel(tmp_path, source, kernel, struct, defines):
    out = tmp_path / "k.ptx"
    cmd = [NVCC, "-ptx", "-arch=sm_80", *jit.BASE_FLAGS, f"-I{jit.kernel_root()}",
           *(f"-D{k}={v}" for k, v in defines.items()), os.path.join(jit.kernel_root(), source), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    sizes = re.findall(rf"\.param\s+\.align\s+\d+\s+\.b8\s+{kernel}_param_0\[(\d+)\]", out.read_text())
    assert sizes == [str(ctypes.sizeof(struct))]


def test_layout_capacity_is_consistent_with_hint():
    for ranks, tokens, hidden in ((2, 1, 128), (8, 4096, 7168), (5, 37, 7680)):
        hint = L.normal_buffer_bytes(tokens, hidden * 2, ranks)
        for elem, scales, topk in ((2, 0, 8), (1, hidden // 128, 8), (2, 0, 0), (2, 0, 32)):
            lay = L.NormalLayout(ranks, hidden, elem, scales, topk)
            cap = lay.max_tokens_per_rank(hint)
            assert cap >= tokens
            # the dispatch's rows, meta slots and send lists at that capacity, in that order, 16-byte aligned
            rows, meta, lists = lay.dispatch_rows_offset(), lay.dispatch_meta_offset(cap), lay.send_list_offset(cap)
            assert rows == L.ROWS_OFFSET >= L.CONTROL_BYTES and rows % 128 == 0 and meta % 16 == 0
            assert meta == rows + cap * hidden * elem and lists >= meta + cap * lay.dispatch_meta_bytes
            assert lists + ranks * cap * 4 <= hint
            assert lay.dispatch_topk_weights_offset + topk * 4 <= lay.dispatch_meta_bytes
            # the combine's two arrays (rows, then weights) fit in the same area, the weights 16-byte aligned
            rows, weights = lay.combine_rows_offset(), lay.combine_weights_area_offset(cap)
            assert rows == L.ROWS_OFFSET
            assert weights == rows + lay.combine_rows(cap) * hidden * 2 and weights % 16 == 0
            assert weights + lay.combine_rows(cap) * topk * 4 <= hint


def test_control_area_fits():
    for ranks in (1, 8, 72):
        assert L.ctrl_expert_count(ranks) + 4 * 256 <= L.CONTROL_BYTES
        assert L.max_experts_in_control(ranks) >= 256


def test_control_words_do_not_overlap():
    ranks = 8
    words = sorted([(L.CTRL_ROUND, 8), (L.CTRL_CURRENT, 8), (L.CTRL_READY, 8), (L.CTRL_ERROR, 4),
                    (L.CTRL_NUM_TOKENS, 4), (L.CTRL_COUNTED, 8), (L.CTRL_TOKEN_TICKET, 4), (L.CTRL_PULL_ARRIVE, 4),
                    (L.CTRL_DONE, 8 * ranks),
                    (L.ctrl_count_to(ranks), 4 * ranks), (L.ctrl_expert_count(ranks), 4)])
    for (a, size_a), (b, _) in zip(words, words[1:]):
        assert a + size_a <= b
    for off, size in words:
        assert off % min(size, 8) == 0   # u64 signals are 8-byte aligned
    # the kernels' ControlLayout takes the offsets in this order
    assert intranode.CONTROL[-1] == "pull_arrive" and len(intranode.CONTROL) == 11


class _PlanStub:
    """What IntranodeEngine's plan builders use, without a GPU (no window, no JIT)."""

    def __init__(self, num_ranks: int, num_nvl_bytes: int) -> None:
        self.num_ranks = num_ranks
        self.ctx = type("Ctx", (), {"num_nvl_bytes": num_nvl_bytes})()
        self.kernels = []

    def _common(self, p) -> None:
        p.rank = 3

    def _kernel(self, source, name, defines):
        self.kernels.append((source, name, tuple(sorted(defines.items()))))
        return name

    _capacity = intranode.IntranodeEngine._capacity


def test_dispatch_plan_fills_the_layout_fields_once():
    ranks, hidden, scales, topk = 8, 7168, 56, 8
    stub = _PlanStub(ranks, 1 << 30)
    kernels, t = intranode.IntranodeEngine._dispatch_plan(stub, hidden, 1, scales, topk, 256, 4)
    lay = L.NormalLayout(ranks, hidden, 1, scales, topk)
    cap = lay.max_tokens_per_rank(1 << 30)
    assert kernels == intranode.DISPATCH_KERNELS
    assert dict(stub.kernels[0][2]) == dict(NUM_RANKS=ranks, HIDDEN_BYTES=hidden, NUM_TOPK=topk, NUM_SCALES=scales)
    assert (t.send_list_offset, t.rows_offset) == (lay.send_list_offset(cap), L.ROWS_OFFSET)
    assert (t.meta_offset, t.meta_bytes, t.capacity) == (L.ROWS_OFFSET + cap * hidden, lay.dispatch_meta_bytes, cap)
    # the meta slot: scales | top-k ids | top-k weights, each 16-byte aligned, inside the slot
    assert t.scales_offset == 0 and t.topk_idx_offset == L.align_up(scales * 4)
    assert t.topk_weights_offset + topk * 4 <= t.meta_bytes
    assert (t.num_scales, t.num_experts, t.expert_alignment, t.rank) == (scales, 256, 4, 3)
    # a call copies the template and fills its own pointers: the template stays as built
    p = intranode.DispatchParams.from_buffer_copy(t)
    p.x, p.host_out, p.num_tokens = 1234, 5678, 99
    assert (t.x, t.host_out, t.num_tokens) == (0, 0, 0) and p.meta_bytes == t.meta_bytes


def test_combine_plan_fills_the_layout_fields_once():
    stub = _PlanStub(4, 1 << 28)
    kernels, t = intranode.IntranodeEngine._combine_plan(stub, 4096, 8)
    lay = L.NormalLayout(4, 4096, 2, 0, 8)
    assert kernels == intranode.COMBINE_KERNELS
    assert t.send_area_offset == lay.combine_rows_offset()
    cap = lay.max_tokens_per_rank(1 << 28)
    assert (t.weights_area_offset, t.rank) == (lay.combine_weights_area_offset(cap), 3)
    p = intranode.CombineParams.from_buffer_copy(t)
    p.out = 42
    assert t.out == 0


def test_eager_combine_packs_the_words_the_full_path_sets():
    """The eager path's params (template head + the per-call words + tail) are byte for byte the full path's
    CombineParams with the same fields set; and a struct whose per-call words are not contiguous is refused."""
    stub = _PlanStub(8, 1 << 30)
    _, t = intranode.IntranodeEngine._combine_plan(stub, 7168, 8)
    t.timeout_ns, t.error_host = 123, 456   # fields after the per-call words must survive in the tail
    begin, end = intranode.call_words_span(intranode.CombineParams)
    raw = bytes(t)
    words = dict(x=0x7f00_0000_1000, topk_weights=0x7f00_0000_2000, x_rows=21600, rank_prefix_matrix=0x7f00_3000,
                 send_rows=0x7f00_4000, bias_0=0, bias_1=0, out=0x7f00_5000, out_topk_weights=0x7f00_6000,
                 num_tokens=4096)
    p = intranode.CombineParams.from_buffer_copy(t)
    for k, v in words.items():
        setattr(p, k, v)
    assert raw[:begin] + intranode._CALL_WORDS.pack(*words.values()) + raw[end:] == bytes(p)
    assert tuple(words) == intranode._CALL_FIELDS
    shuffled = type("Shuffled", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_int64) for f in (
        "x", "topk_weights", "x_rows", "rank_prefix_matrix", "send_rows", "bias_0", "out", "bias_1",
        "out_topk_weights", "num_tokens")]})
    with pytest.raises(AssertionError, match="contiguous"):
        intranode.call_words_span(shuffled)


class _EagerStub:
    """What IntranodeEngine.combine_eager reads before its first driver call."""

    def __init__(self, **kw) -> None:
        self._opened, self.broken, self.errors = None, None, type("W", (), {"words": [0]})()
        self.profile = type("P", (), {"enabled": False})()
        self._eager_plans, self._send_area = {}, (0, 0)
        self.grid = lambda num_sms: num_sms   # no other Buffer open: the budget as it is
        self.__dict__.update(kw)


def test_eager_combine_leaves_what_it_does_not_handle_to_the_full_path(monkeypatch):
    """combine_eager returns None (the caller takes the full path, which checks, raises and profiles) before any
    launch or stream call when: a zero-copy round is open, the engine is broken or a kernel recorded an error, the
    profiler is on, the handle's tokens exceed the room of this shape, or x overlaps the Buffer's send area."""
    import torch
    monkeypatch.delenv("DEEPEP_PORTABLE_FORCE_ARCH", raising=False)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    handle = type("H", (), {"num_tokens": 10})()
    plan = intranode.EagerCombinePlan(None, None, b"", b"", 1, room=10)
    key = (64, 0, 16, None)

    def call(**kw):
        return intranode.IntranodeEngine.combine_eager(_EagerStub(**kw), x, handle, None, 16)

    assert call(_opened=("combine", 1, 4, 64)) is None
    assert call(broken="a timeout earlier") is None
    assert call(errors=type("W", (), {"words": [3]})()) is None
    assert call(profile=type("P", (), {"enabled": True})()) is None
    assert call(_eager_plans={key: plan._replace(room=9)}) is None
    lo = x.data_ptr()
    for span in ((lo - 64, lo + 1), (lo + 4 * 64 * 2 - 1, lo + (1 << 20)), (lo - 8, lo + 8)):
        assert call(_eager_plans={key: plan}, _send_area=span) is None, span
    # Past every refusal (room enough, x outside the send area) it goes on to order the streams: no stub for that.
    with pytest.raises(AttributeError):
        call(_eager_plans={key: plan}, _send_area=(lo + 4 * 64 * 2, lo + (1 << 20)))


def _stub_engine(monkeypatch, log: list):
    """An IntranodeEngine without a GPU: kernels, launches and stream waits recorded in `log` (CPU tensors)."""
    import types
    import torch

    class Fn:
        def __init__(self, name):
            self.name, self.device = name, 0

        def launch(self, grid, block, smem, stream, params, *rest):
            log.append(("launch", self.name, grid, block, smem, stream, bytes(params), rest))

    monkeypatch.setattr(intranode, "launch", lambda fn, grid, block, p, s, *a, **k:
                        log.append(("launch", fn.name, grid, block, 0, s, bytes(p), ())))
    monkeypatch.setattr(intranode, "stream_wait_stream", lambda dev, waiter, waited:
                        log.append(("wait", waiter, waited)))
    monkeypatch.setattr(intranode, "current_stream_handle", lambda dev: 777)
    monkeypatch.delenv("DEEPEP_PORTABLE_FORCE_ARCH", raising=False)
    eng = intranode.IntranodeEngine.__new__(intranode.IntranodeEngine)
    eng.ctx = types.SimpleNamespace(num_nvl_bytes=1 << 26, comm_stream=types.SimpleNamespace(cuda_stream=555),
                                    device=torch.device("cpu"), timeout_s=100.0, uid=1)
    eng.rank, eng.num_ranks, eng.broken, eng.base, eng.dev = 1, 4, None, 1 << 40, 0
    eng.peer_bases = torch.zeros(4, dtype=torch.int64)
    eng.errors = types.SimpleNamespace(words=[0], dev=12345)
    eng.window = types.SimpleNamespace(grid=lambda n: min(int(n), 16), base=None, size=1 << 26)
    eng.profile = types.SimpleNamespace(enabled=False, start=lambda c: None, host_time=lambda *a: None,
                                        mark=lambda *a: None, finish=lambda *a: None)
    eng._plans, eng._kernel = {}, lambda source, name, defines: Fn(name)
    eng.error_claim, eng.ctrl = eng.base + 8, list(range(11))
    eng._init_zero_copy()
    eng._init_eager()
    return eng


@pytest.mark.parametrize("topk", [0, 4])
@pytest.mark.parametrize("outputs_fail", [False, True])
def test_eager_combine_launches_what_the_full_path_launches(monkeypatch, topk, outputs_fail):
    """On an engine whose launches are recorded: the eager path launches the same kernels, with the same grid, block,
    stream and params bytes (but the fresh output pointers) as the full path; the comm stream waits for the caller's
    before the first and the caller's for the comm stream after the last. When the outputs cannot be allocated, both
    launch the stage, then a pull of no tokens, and raise (the eager path after the caller's stream waits for the pull,
    which reads x; the full path's wait is Buffer._op's)."""
    import torch
    from deepep_portable.contract import CombineArgs
    from deepep_portable.handles import DispatchHandle

    log: list = []
    eng = _stub_engine(monkeypatch, log)
    if outputs_fail:
        def no_memory(*_args):
            raise MemoryError("forced")
        eng._combine_outputs = no_memory
    rows, hidden, tokens = 37, 256, 20
    x = torch.randn(rows, hidden).bfloat16()
    w = torch.rand(rows, topk) if topk else None
    handle = DispatchHandle(torch.zeros(4, 4, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32), None,
                            torch.zeros(tokens, 4, dtype=torch.int32), rows, rows, tokens, hidden, 1)
    runs = []
    for call in (lambda: eng.combine(CombineArgs(x=x, handle=handle, topk_weights=w, bias_0=None, bias_1=None,
                                                 num_sms=24)),
                 lambda: eng.combine_eager(x, handle, w, 24)):
        log.clear()
        if outputs_fail:
            with pytest.raises(MemoryError):
                call()
        else:
            call()
        runs.append(list(log))
    full, eager = runs
    out = intranode.CombineParams.out.offset   # out and out_topk_weights: fresh per call

    def masked(entries):
        return [e[:6] + (e[6][:out] + e[6][out + 16:], e[7]) for e in entries if e[0] == "launch"]

    assert [e[1] for e in masked(full)] == list(intranode.COMBINE_KERNELS)
    assert masked(eager) == masked(full)
    first = [[e for e in run if e[0] == "launch"][0] for run in (full, eager)]
    assert first[0][6] == first[1][6]   # the stage's params, byte for byte
    waits = [e for e in eager if e[0] == "wait"]
    assert eager[0] == ("wait", 555, 777)
    assert waits == [("wait", 555, 777), ("wait", 777, 555)] and eager[-1] == ("wait", 777, 555)
    if not outputs_fail:
        assert eng.eager_combines == 1
        pull = intranode.CombineParams.from_buffer_copy(eager[2][6])
        assert (pull.num_tokens, pull.x_rows) == (tokens, rows) and pull.out != 0
    else:
        pull = intranode.CombineParams.from_buffer_copy(eager[2][6])
        assert (pull.num_tokens, pull.out) == (0, 0)


def test_plans_follow_the_forced_architecture(monkeypatch):
    """A plan holds loaded kernels: forcing another architecture (DEEPEP_PORTABLE_FORCE_ARCH, e.g. the
    sm_80 variant on a Hopper GPU) must build a new one, as the kernel cache does."""
    stub = _PlanStub(2, 1 << 20)
    stub._plans = {}
    builds = []
    build = lambda: builds.append(1) or ("kernels", None)   # noqa: E731
    monkeypatch.delenv("DEEPEP_PORTABLE_FORCE_ARCH", raising=False)
    intranode.IntranodeEngine._plan(stub, ("dispatch", 1), build)
    intranode.IntranodeEngine._plan(stub, ("dispatch", 1), build)
    monkeypatch.setenv("DEEPEP_PORTABLE_FORCE_ARCH", "sm_80")
    intranode.IntranodeEngine._plan(stub, ("dispatch", 1), build)
    assert len(builds) == 2


def test_small_outputs_spare_is_used_once_and_only_for_its_shape(monkeypatch):
    """The next dispatch's small outputs are allocated after the current one's last launch; a spare
    serves one call of the same kind and size, never two calls (two handles would share memory)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    stub = _PlanStub(2, 1 << 20)
    stub._spares = {}
    made = []
    stub._allocate_small = lambda cached, n: made.append((cached, n)) or ("views", len(made))
    take = lambda cached, n: intranode.IntranodeEngine._small_outputs(stub, cached, n)   # noqa: E731
    prepare = lambda cached, n: intranode.IntranodeEngine._prepare_spare(stub, cached, n)   # noqa: E731
    assert take(False, 64) == ("views", 1)           # no spare yet: allocate now
    prepare(False, 64)
    assert take(False, 64) == ("views", 2)           # the spare
    assert take(False, 64) == ("views", 3)           # used up: allocate now
    prepare(False, 64)                               # views 4
    assert take(True, 64) == ("views", 5)            # other kind: not that spare
    prepare(True, 64)                                # views 6
    assert take(False, 64) == ("views", 4)           # alternating kinds each find theirs
    assert take(True, 64) == ("views", 6)
    for n in range(intranode.MAX_SPARES + 2):        # varying sizes: only the newest few are kept
        prepare(False, n)
    assert len(stub._spares) == intranode.MAX_SPARES and (False, 0) not in stub._spares


def test_a_zero_copy_ops_profile_starts_at_its_opener():
    """DEEPEP_PORTABLE_PROFILE=1: the marks of an op that reads rows opened for it begin with the event taken
    before its opener, as an "open" phase; any op uses that event up; without profiling nothing is kept."""
    class Profile:
        enabled = True

        def start(self, stream):
            return [f"start on {stream}"]

    stub = type("Stub", (), {"profile": Profile(), "_open_marks": ["opener"]})()
    phases = intranode.IntranodeEngine._phases
    assert phases(stub, True, "comm") == (["opener", "start on comm"], ("open", "stage", "pull"))
    assert stub._open_marks is None
    assert phases(stub, True, "comm") == (["start on comm"], ("stage", "pull"))   # used up by the last op
    stub._open_marks = ["opener"]
    assert phases(stub, False, "comm") == (["start on comm"], ("stage", "pull")) and stub._open_marks is None
    stub.profile.start = lambda stream: None   # profiling off
    assert phases(stub, True, "comm") == (None, ("stage", "pull"))


def test_the_openers_plan_carries_its_ops_id():
    """The opener's params are built once per op (the id parsed from errors.cuh then, not on every call: that
    parse was tens of microseconds of the zero-copy op's host path) and launched as they are."""
    stub = _PlanStub(4, 1 << 20)
    stub._plans = {}
    ids = {name: i for i, name in errors.table()[1].items()}
    plan = lambda op: intranode.IntranodeEngine._plan(stub, ("open_round", op),   # noqa: E731
                                                      lambda: intranode.IntranodeEngine._open_round_plan(stub, op))
    (k1, p1), (k2, p2) = plan("dispatch"), plan("combine")
    assert (p1.op, p2.op, p1.num_ranks) == (ids["dispatch"], ids["combine"], 4) and p1.rank == 3
    assert plan("dispatch")[1] is p1 and len(stub.kernels) == 2   # built once per op
    assert k1 == k2 == intranode.OPEN_ROUND_KERNEL
