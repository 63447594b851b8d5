"""Host-side checks of the low-latency kernels that need no GPU: parameter structs against the compiled
kernels (size and field order), compilation for a spread of shapes, the LowLatencyLayout arithmetic,
and the FP8 cast code of fp8.cuh (compiled for the host) against tests/oracle.py bit for bit. Kernels
are built for the nvlink backend here (tests/test_nvshmem_backend.py builds them for NVSHMEM)."""
import ctypes
import os
import re
import subprocess

import pytest
import torch

from deepep_portable import jit
from deepep_portable.contract import scale_shape
from deepep_portable import layout as L
from deepep_portable.engines import low_latency as ll
from deepep_portable.profiling import PhaseProfile
from deepep_portable.transports.nvlink.window import NvlinkTransportParams, nvlink_build

import oracle

try:
    NVCC = jit.find_nvcc()
except Exception:   # pragma: no cover - CI installs a compiler
    NVCC = None

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc")
LLDispatchParams, LLCombineParams, LLCleanParams = ll.params_types(NvlinkTransportParams)
VMM, LEGACY = nvlink_build(shareable=True), nvlink_build(shareable=False)   # the nvlink window's two builds
# (source, kernel symbol, params mirror, defines, id): one kernel name per op (the dispatch's phases in its params,
# the combine's compiled in: a kernel per phase)
SEND, RECV = ll.PHASE_SEND, ll.PHASE_RECV
KERNELS = [(ll.DISPATCH_SOURCE, ll.DISPATCH_KERNEL, LLDispatchParams, ll.kernel_defines(256, 3), "dispatch"),
           (ll.COMBINE_SOURCE, ll.COMBINE_KERNEL, LLCombineParams, ll.kernel_defines(256, 3, False, SEND),
            "combine-send"),
           (ll.COMBINE_SOURCE, ll.COMBINE_KERNEL, LLCombineParams, ll.kernel_defines(256, 3, False, RECV),
            "combine-recv"),
           (ll.COMBINE_SOURCE, ll.COMBINE_KERNEL, LLCombineParams, ll.kernel_defines(512, 3, True, SEND),
            "combine-logfmt-send"),
           (ll.COMBINE_SOURCE, ll.COMBINE_KERNEL, LLCombineParams, ll.kernel_defines(512, 3, True, RECV),
            "combine-logfmt-recv"),
           (ll.CLEAN_SOURCE, ll.CLEAN_KERNEL, LLCleanParams, {}, "clean")]


def _ptx(tmp_path, source: str, arch: str, defines: dict, build=VMM, extra=()) -> str:
    out = tmp_path / f"{os.path.basename(source)}.{arch}.ptx"
    cmd = [NVCC, "-ptx", f"-arch={arch}", *jit.BASE_FLAGS, *extra, f"-I{jit.kernel_root()}", *build.flags,
           *(f"-D{k}={v}" for k, v in build.kernel_defines(defines).items()), os.path.join(jit.kernel_root(), source),
           "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out.read_text()


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source,kernel,struct,defines,name", KERNELS, ids=[k[4] for k in KERNELS])
def test_param_struct_size_matches_ptx(tmp_path, arch, source, kernel, struct, defines, name):
    """The kernel is there under the symbol the host looks up, and takes a struct of the mirror's size."""
    text = _ptx(tmp_path, source, arch, defines)
    assert re.findall(r"\.entry\s+(\w+)\(", text) == [kernel]
    sizes = re.findall(rf"\.param\s+\.align\s+\d+\s+\.b8\s+{kernel}_param_0\[(\d+)\]", text)
    assert sizes == [str(ctypes.sizeof(struct))]


@needs_nvcc
@pytest.mark.parametrize("hidden,topk", [(128, 1), (7168, 8), (7680, 9), (2048, 8)])
@pytest.mark.parametrize("source", [ll.DISPATCH_SOURCE, ll.COMBINE_SOURCE])
def test_kernels_compile(source, hidden, topk):
    variants = [ll.kernel_defines(hidden, topk)] if source == ll.DISPATCH_SOURCE else \
        [ll.kernel_defines(hidden, topk, logfmt, phase) for logfmt in ((False, True) if hidden % 512 == 0 else (False,))
         for phase in (SEND, RECV)]
    for arch in ("sm_90", "sm_80"):
        for defines in variants:
            assert jit.compile(source, VMM.kernel_defines(defines), arch, extra_flags=VMM.flags)
    if source == ll.DISPATCH_SOURCE:   # the other placement: legacy IPC windows, and shrink mode, pack on receive
        assert jit.compile(source, LEGACY.kernel_defines(ll.kernel_defines(hidden, topk)), "sm_90",
                           extra_flags=LEGACY.flags)
        assert jit.compile(source, VMM.kernel_defines(dict(ll.kernel_defines(hidden, topk), PACK_ON_RECEIVE=1)),
                           "sm_90", extra_flags=VMM.flags)


@needs_nvcc
def test_dispatch_placement_follows_the_window(tmp_path):
    """Shareable (VMM) windows: the send reserves rows with a system-scope 64-bit add on the peer's word;
    legacy CUDA IPC windows: none (the receive packs the rows)."""
    vmm = _ptx(tmp_path, ll.DISPATCH_SOURCE, "sm_90", ll.kernel_defines(2048, 8), VMM)
    legacy = _ptx(tmp_path, ll.DISPATCH_SOURCE, "sm_90", ll.kernel_defines(2048, 8), LEGACY)
    assert "atom.sys.add.u64" in _kernel_body(vmm, ll.DISPATCH_KERNEL)
    assert "atom.sys.add.u64" not in _kernel_body(legacy, ll.DISPATCH_KERNEL)
    # shrink mode packs on receive on any window: no reservations a masked, still running rank could move
    shrink = _ptx(tmp_path, ll.DISPATCH_SOURCE, "sm_90", dict(ll.kernel_defines(2048, 8), PACK_ON_RECEIVE=1), VMM)
    assert "atom.sys.add.u64" not in _kernel_body(shrink, ll.DISPATCH_KERNEL)


def _kernel_body(ptx: str, kernel: str) -> str:
    start = ptx.index(f".entry {kernel}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:] if end < 0 else ptx[start:end]


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_no_fused_multiply_add(tmp_path, arch):
    """The FP8 cast and the combine sum are bit-exact with tests/oracle.py only without contraction:
    products and sums rounded separately (__fmul_rn / __fadd_rn). So the PTX is the same when nvcc may not
    contract (-fmad=false), and the BF16 combine has no fma at all. The cast's quotient uses fma on purpose
    (fp8.cuh div_by_scale, checked against division by test_fp8_division_without_div_is_exact); so does the
    LogFMT combine (LOGFMT=1), where DeepEP's LogFMT arithmetic does (logfmt.cuh)."""
    for source, defines in ((ll.DISPATCH_SOURCE, ll.kernel_defines(7680, 9)),
                            (ll.COMBINE_SOURCE, ll.kernel_defines(7680, 9, False, SEND)),
                            (ll.COMBINE_SOURCE, ll.kernel_defines(7680, 9, False, RECV))):
        text = _ptx(tmp_path, source, arch, defines)
        assert ".entry" in text
        assert text == _ptx(tmp_path, source, arch, defines, extra=("-fmad=false",)), \
            f"{source} ({arch}) contains a contracted multiply-add"
        if source == ll.COMBINE_SOURCE:
            assert "fma." not in text, f"{source} ({arch}) contains fused multiply-add"


@needs_nvcc
def test_sender_checks_overwrite_and_counters_are_released(tmp_path):
    """The send kernels read the destination's RECVD (overwrite detection) and the counters are stored
    with a system-scope release (a peer reads RECVD across the fabric)."""
    for source, kernel, defines in ((ll.DISPATCH_SOURCE, ll.DISPATCH_KERNEL, ll.kernel_defines(2048, 8)),
                                    (ll.COMBINE_SOURCE, ll.COMBINE_KERNEL, ll.kernel_defines(2048, 8, False, SEND))):
        body = _kernel_body(_ptx(tmp_path, source, "sm_90", defines), kernel)
        assert "st.release.sys.global.u64" in body, kernel
        assert "ld.volatile" in body


def test_families_registered():
    from deepep_portable.tools.precompile import load_families

    fams = load_families()
    assert fams["low_latency_dispatch"].kernels == (ll.DISPATCH_KERNEL,)
    assert fams["low_latency_combine"].kernels == (ll.COMBINE_KERNEL,)
    assert fams["low_latency_clean"].kernels == (ll.CLEAN_KERNEL,)


SHAPES = [(t, h, r, e) for t in (1, 128, 1000) for h in (128, 7168, 7680) for r in (1, 3, 8) for e in (8, 256)]


@pytest.mark.parametrize("tokens,hidden,ranks,experts", SHAPES)
def test_layout_regions(tokens, hidden, ranks, experts):
    experts = experts // ranks * ranks
    lay = L.LowLatencyLayout(tokens, hidden, ranks, experts)
    assert lay.total_bytes == L.low_latency_rdma_size_hint(tokens, hidden, ranks, experts)
    # a message holds the header and the larger of the BF16 row and FP8 row + float32 scales
    assert lay.message_bytes >= L.LL_MSG_HEADER + max(2 * hidden, hidden + hidden // 128 * 4)
    assert lay.message_bytes % 16 == 0 and (L.LL_MSG_HEADER + hidden) % 16 == 0
    regions = [("control", 0, L.LL_CONTROL_BYTES), ("stage flags", L.LL_STAGE_FLAGS_OFFSET, 8 * L.LL_MAX_STAGE_BLOCKS),
               ("barrier words", L.LL_BARRIER_OFFSET, 8 * ranks)]
    assert L.LL_CLEANED_BYTES == L.LL_STAGE_FLAGS_OFFSET + 8 * L.LL_MAX_STAGE_BLOCKS <= L.LL_BARRIER_OFFSET
    for half in (0, 1):
        regions.append((f"dispatch signals {half}", lay.dispatch_signal_offset(half), 8 * experts))
        regions.append((f"combine signals {half}", lay.combine_signal_offset(half), 8 * experts))
        regions.append((f"dispatch range signals {half}", lay.dispatch_range_offset(half), 8 * experts))
        regions.append((f"dispatch reserve signals {half}", lay.dispatch_reserve_offset(half),
                        8 * lay.num_local_experts))
        # the combine send area (zero-copy buffer) has its own bytes: peers' later dispatches write the
        # dispatch receive area, never this rank's combine send area
        regions.append((f"dispatch recv {half}", lay.dispatch_recv_offset(half), lay.dispatch_recv_bytes))
        regions.append((f"dispatch side {half}", lay.dispatch_side_offset(half), lay.dispatch_side_bytes))
        regions.append((f"combine send {half}", lay.combine_send_offset(half), lay.combine_send_bytes))
        regions.append((f"combine recv {half}", lay.combine_recv_offset(half), lay.combine_recv_bytes))
        assert lay.combine_send_offset(0) + half * lay.data_half_stride == lay.combine_send_offset(half)
        # what the kernels compute from half 0 and the strides
        assert lay.dispatch_signal_offset(0) + half * lay.signal_half_stride == lay.dispatch_signal_offset(half)
        assert lay.combine_signal_offset(0) + half * lay.signal_half_stride == lay.combine_signal_offset(half)
        assert lay.dispatch_recv_offset(0) + half * lay.data_half_stride == lay.dispatch_recv_offset(half)
        assert lay.dispatch_side_offset(0) + half * lay.data_half_stride == lay.dispatch_side_offset(half)
        assert lay.dispatch_range_offset(0) + half * lay.signal_half_stride == lay.dispatch_range_offset(half)
        assert lay.dispatch_reserve_offset(0) + half * lay.signal_half_stride == lay.dispatch_reserve_offset(half)
        assert lay.combine_recv_offset(0) + half * lay.data_half_stride == lay.combine_recv_offset(half)
    regions.append(("send stage", lay.send_stage_offset, tokens * lay.message_bytes))
    regions.sort(key=lambda r: r[1])
    for (name_a, a, size_a), (name_b, b, _) in zip(regions, regions[1:]):
        assert a + size_a <= b, f"{name_a} overlaps {name_b}"
    name, last, size = regions[-1]
    assert last + size <= lay.total_bytes
    for name, off, _ in regions:
        assert off % (8 if "signals" in name else 16) == 0, name   # u64 signals; int4 rows
    # a send-stage message is a side message followed by a recv_x row (FP8 or bf16)
    assert lay.side_bytes % 16 == 0 and lay.side_bytes >= L.LL_MSG_HEADER + hidden // 128 * 4
    assert lay.message_bytes >= max(lay.side_bytes + hidden, L.LL_MSG_HEADER + 2 * hidden)
    # the side message slot table: (local expert, source, token) -> inside the half's side area
    last_msg = ((lay.num_local_experts - 1) * ranks + ranks - 1) * tokens + tokens - 1
    assert (last_msg + 1) * lay.side_bytes <= lay.dispatch_side_bytes
    # recv_x [E_local, R*T, H] as bf16 (the larger) fills the dispatch output area
    assert lay.num_local_experts * ranks * tokens * hidden * 2 == lay.dispatch_recv_bytes
    # pack on receive: whole messages [E_local][R][T] from the dispatch area's start, within its bytes
    assert experts * tokens * lay.message_bytes <= \
        lay.dispatch_side_offset(0) + lay.dispatch_side_bytes - lay.dispatch_recv_offset(0)
    # the zero-copy view [E_local, R*T, H] bf16 and the combine rows [E, T, H] bf16
    # (LogFMT rows, staged or received, are logfmt_row_bytes apart: meta + at most the bf16 row)
    assert lay.num_local_experts * ranks * tokens * lay.logfmt_row_bytes == lay.combine_send_bytes
    assert experts * tokens * lay.logfmt_row_bytes == lay.combine_recv_bytes
    assert lay.logfmt_row_bytes % 16 == 0 and lay.logfmt_row_bytes >= hidden // 128 * 4 + 2 * hidden
    if hidden % 512 == 0:   # LogFMT's shapes: the kernels' Format::kRowBytes
        assert lay.logfmt_row_bytes == hidden // 128 * 4 + 2 * hidden
    # the control words the kernels use
    words = sorted([(L.LL_CTRL_SENT, 8), (L.LL_CTRL_RECVD, 8), (L.LL_CTRL_SEND_ARRIVE, 4),
                    (L.LL_CTRL_RECV_ARRIVE, 4), (L.LL_CTRL_ERROR, 4), (L.LL_CTRL_LAST, 8 * 2 * 2)])
    for (a, size_a), (b, _) in zip(words, words[1:]):
        assert a + size_a <= b
    assert words[-1][0] + words[-1][1] <= L.LL_CONTROL_BYTES
    assert L.LL_CTRL_SENT % 8 == 0 and L.LL_CTRL_RECVD % 8 == 0 and L.LL_CTRL_LAST % 8 == 0


def test_scale_storage_is_column_major():
    for ue8m0, cols in ((False, 56), (True, 14)):
        shape = scale_shape(3, 40, 7168, ue8m0)
        view = torch.empty(shape).transpose(1, 2)
        assert tuple(view.shape) == (3, 40, cols) and view.stride(1) == 1
        # the kernel writes element (e, row, s) at e * S * slots + s * slots + row
        e, row, s = 2, 17, cols - 1
        assert view.stride(0) * e + view.stride(1) * row + view.stride(2) * s == e * cols * 40 + s * 40 + row


# ---- the FP8 cast of protocol.cuh, compiled for the host, against the oracle --------------------------
CAST_MAIN = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include "common/kernels/fp8.cuh"
using namespace deepep_portable::fp8;
// stdin: n, h, round_scale, then n*h bf16 bit patterns (uint16). stdout (binary): fp8 bytes, float scales.
int main() {
    int n, h, rs;
    if (fread(&n, 4, 1, stdin) != 1 || fread(&h, 4, 1, stdin) != 1 || fread(&rs, 4, 1, stdin) != 1) return 1;
    uint16_t* x = (uint16_t*)malloc(sizeof(uint16_t) * n * h);
    if (fread(x, 2, (size_t)n * h, stdin) != (size_t)n * h) return 2;
    unsigned char* data = (unsigned char*)malloc((size_t)n * h);
    float* scales = (float*)malloc(sizeof(float) * n * (h / 128));
    for (int t = 0; t < n; ++t)
        for (int b = 0; b < h / 128; ++b) {
            float f[128], amax = 0.0f;
            for (int i = 0; i < 128; ++i) {
                uint32_t bits = (uint32_t)x[(size_t)t * h + b * 128 + i] << 16;
                memcpy(&f[i], &bits, 4);
                amax = fmaxf(amax, fabsf(f[i]));
            }
            const float scale = fp8_scale(amax, rs != 0);
            scales[t * (h / 128) + b] = scale;
            for (int i = 0; i < 128; i += 2) {
                uint16_t q = fp8x2_inv(f[i], f[i + 1], scale, reciprocal(scale));   // the kernels' path
                data[(size_t)t * h + b * 128 + i] = q & 0xff;
                data[(size_t)t * h + b * 128 + i + 1] = q >> 8;
            }
        }
    fwrite(data, 1, (size_t)n * h, stdout);
    fwrite(scales, 4, (size_t)n * (h / 128), stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def cast_exe(tmp_path_factory):
    if NVCC is None:
        pytest.skip("no nvcc")
    d = tmp_path_factory.mktemp("ll_cast")
    src, exe = d / "cast.cu", d / "cast"
    src.write_text(CAST_MAIN)
    proc = subprocess.run([NVCC, "-std=c++17", "-O2", f"-I{jit.kernel_root()}",
                           str(src), "-o", str(exe)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail("host build of the FP8 cast failed:\n" + proc.stdout + proc.stderr)
    return str(exe)


def _run_cast(exe: str, x: torch.Tensor, round_scale: bool):
    n, h = x.shape
    header = torch.tensor([n, h, int(round_scale)], dtype=torch.int32).numpy().tobytes()
    out = subprocess.run([exe], input=header + x.view(torch.int16).numpy().tobytes(), capture_output=True,
                         check=True).stdout
    data = torch.frombuffer(bytearray(out[:n * h]), dtype=torch.uint8).view(n, h)
    scales = torch.frombuffer(bytearray(out[n * h:]), dtype=torch.float32).view(n, h // 128)
    return data, scales


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_code_matches_oracle(cast_exe, round_scale):
    gen = torch.Generator().manual_seed(7)
    n, h = 64, 1024
    magnitude = torch.exp2(torch.randint(-30, 20, (n, h // 128, 1), generator=gen).float())
    x = (torch.randn(n, h // 128, 128, generator=gen) * magnitude).reshape(n, h)
    x[0] = 0                      # all-zero token: amax clamp
    x[1, :128] *= 1e-7            # tiny block: amax clamp
    x[2, 5] = -x[2].abs().max() * 3   # negative amax
    x = x.to(torch.bfloat16)
    data, scales = _run_cast(cast_exe, x, round_scale)
    exp_data, exp_scales = oracle.fp8_cast(x, round_scale)
    assert torch.equal(scales.view(torch.int32), exp_scales.view(torch.int32))
    assert torch.equal(data, exp_data.view(torch.uint8))
    if round_scale:
        # the receive kernel's UE8M0 packing: byte b of word w = biased exponent of scale 4w + b
        exp_bits = (scales.view(torch.int32) >> 23) & 0xFF
        words = exp_bits.view(n, -1, 4)
        packed = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
        _, exp_packed = oracle.fp8_cast(x, True, True)
        assert torch.equal(packed.to(torch.int32), exp_packed)


# Every quotient the cast can compute: x / scale for every finite bf16 x with |x| <= amax, for every bf16 amax
# (a block's amax is one of its |x|; below 1e-4 it is clamped, so one scale stands for all of those), in both
# scale modes; div_by_scale (no division, what the kernels run) must give the same FP8 bytes, and the same float
# bits wherever neither x nor the quotient is below 2^-100.
DIV_MAIN = r"""
#include <cstdio>
#include <cstring>
#include <cmath>
#include "common/kernels/fp8.cuh"
using namespace deepep_portable::fp8;
static float bf16(uint32_t bits) { float f; bits <<= 16; memcpy(&f, &bits, 4); return f; }
int main() {
    long long checked = 0, wrong = 0;
    for (int rs = 0; rs < 2; ++rs)
        for (uint32_t a = 0; a < 0x7f80u; ++a) {   // every finite non-negative bf16 amax
            const float amax = bf16(a);
            if (amax < 1e-4f && a != 0)
                continue;                           // the same clamped scale as amax = 0
            const float scale = fp8_scale(amax, rs != 0), inv = reciprocal(scale);
            const float top = amax < 1e-4f ? 1e-4f : amax;
            for (uint32_t xb = 0; xb < 0x10000u; ++xb) {
                const float x = bf16(xb);
                if (!(fabsf(x) <= top))
                    continue;                       // NaN, Inf, or not in a block of this amax
                const float want = x / scale, got = div_by_scale(x, scale, inv);
                ++checked;
                // always the same FP8 byte; the same float too unless x or the quotient is below 2^-100 (then the
                // remainder or the quotient may underflow, and the quotient casts to a zero of x's sign anyway)
                const bool exact = !(fabsf(x) >= 0x1p-100f && fabsf(want) >= 0x1p-100f) || memcmp(&want, &got, 4) == 0;
                const bool same = exact && fp8x2(x, -x, scale) == fp8x2_inv(x, -x, scale, inv);
                if (!same && ++wrong <= 5)
                    printf("x=%a scale=%a: %a != %a\n", x, scale, got, want);
            }
        }
    // outside the contract, but no worse than division: a block holding an Inf has scale Inf, and its finite
    // channels must still cast to the zero x / Inf gives (not to NaN)
    for (int rs = 0; rs < 2; ++rs) {
        const float scale = fp8_scale(INFINITY, rs != 0), inv = reciprocal(scale);
        for (uint32_t xb = 0; xb < 0x10000u; ++xb) {
            const float x = bf16(xb);
            if (!std::isfinite(x))
                continue;
            ++checked;
            if (fp8x2(x, -x, scale) != fp8x2_inv(x, -x, scale, inv) && ++wrong <= 5)
                printf("x=%a scale=inf: fp8 differs\n", x);
        }
    }
    printf("checked %lld wrong %lld\n", checked, wrong);
    return wrong != 0;
}
"""


def test_fp8_division_without_div_is_exact(tmp_path):
    if NVCC is None:
        pytest.skip("no nvcc")
    src, exe = tmp_path / "div.cu", tmp_path / "div"
    src.write_text(DIV_MAIN)
    # -O2 without -ffast-math: IEEE division and fmaf on the host, as the device's div.rn / fma.rn
    proc = subprocess.run([NVCC, "-std=c++17", "-O2", f"-I{jit.kernel_root()}", str(src), "-o", str(exe)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout
    assert "wrong 0" in run.stdout and int(run.stdout.split()[1]) > 10 ** 8


# ---- host engine bookkeeping (no GPU: kernels and streams are stand-ins) ----------------------------
class _Stream:
    def __init__(self) -> None:
        self.waits = 0

    def wait_stream(self, other) -> None:
        self.waits += 1


class _Kernel:
    """Stands in for the op's kernel: logs each launch as name:phases (the phases its params ask for)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def launch(self, *args) -> None:   # the hook's launch: (grid, threads, smem, stream, params bytes, ...)
        self.record(LLDispatchParams.from_buffer_copy(args[4]))

    def record(self, params) -> None:
        self.log.append(f"{self.name}:{ {1: 'send', 2: 'recv', 3: 'both'}[params.phases] }")


def _fake_engine(monkeypatch):
    from types import SimpleNamespace

    eng = ll.LowLatencyEngine.__new__(ll.LowLatencyEngine)
    eng.ctx = SimpleNamespace(comm_stream=_Stream(), device=torch.device("cpu"))
    eng.base, eng.broken = None, None
    eng._calls = eng._recvs = eng._epoch = 0
    eng._signal_experts = None
    eng.profile = PhaseProfile(0)
    eng.programmatic = False
    eng.grid = lambda num_sms: 1
    stream = _Stream()
    eng._current_stream = lambda: stream
    monkeypatch.setattr(ll, "launch", lambda fn, grid, threads, params, stream, programmatic: fn.record(params))
    monkeypatch.setattr(ll, "stream_handle", lambda *a, **k: 0)
    return eng


def test_receive_hooks_run_in_call_order_once(monkeypatch):
    """Receive phases number themselves RECVD + 1: launching them out of call order would pair a call's
    outputs with another call's half. The engine refuses that instead of corrupting. Without a hook one
    launch runs both phases; with one, the same kernel runs the send now and the receive in the hook."""
    log: list = []
    eng = _fake_engine(monkeypatch)
    p = LLDispatchParams()
    keep = (torch.zeros(1),)
    h1 = eng._two_phase("op", _Kernel("k1", log), p, True, 1, keep)   # a kernel for both phases (the dispatch)
    h2 = eng._two_phase("op", _Kernel("k2", log), p, True, 1, keep)
    with pytest.raises(RuntimeError, match="call order"):
        h2()
    with pytest.raises(RuntimeError, match="pending"):
        eng._two_phase("op", _Kernel("k3", log), p, False, 1, keep)
    h1()
    with pytest.raises(RuntimeError, match="already called"):
        h1()
    h2()
    assert eng._two_phase("op", _Kernel("k3", log), p, False, 1, keep) is None
    assert log == ["k1:send", "k2:send", "k1:recv", "k2:recv", "k3:both"]
    assert (eng._calls, eng._recvs) == (3, 3)
    h4 = eng._two_phase("op", _Kernel("k4", log), p, True, 1, keep)
    eng._epoch += 1          # what clean_low_latency_buffer does
    eng._calls = eng._recvs = 0
    with pytest.raises(RuntimeError, match="clean_low_latency_buffer"):
        h4()


def test_a_kernel_per_phase_runs_send_then_receive(monkeypatch):
    """The combine has a kernel per phase: without a hook both launch back to back, send first; with one,
    the send kernel now and the receive kernel in the hook."""
    log: list = []
    eng = _fake_engine(monkeypatch)
    p = LLDispatchParams()
    pair = (_Kernel("send", log), _Kernel("recv", log))
    assert eng._two_phase("op", pair, p, False, 1, (torch.zeros(1),)) is None
    hook = eng._two_phase("op", pair, p, True, 1, (torch.zeros(1),))
    assert log == ["send:send", "recv:recv", "send:send"]
    hook()
    assert log[-1] == "recv:recv" and (eng._calls, eng._recvs) == (2, 2)


def test_timeout_on_own_blocks_is_named_so():
    """The LL dispatch's send waits for its own blocks' stage flags and reports itself as the peer."""
    from deepep_portable.errors import CommTimeoutError

    own = str(CommTimeoutError("low_latency_dispatch", 3, 3, 5, 2.0))
    assert "its own blocks" in own and "block 5" in own and "rank 3" in own
    peer = str(CommTimeoutError("low_latency_dispatch", 3, 1, 5, 2.0))
    assert "waiting for peer 1 (channel 5)" in peer


def test_misaligned_rows_refused():
    x = torch.zeros(33, dtype=torch.bfloat16)
    ll.check_aligned("x", x[:32])
    with pytest.raises(ValueError, match="16-byte"):
        ll.check_aligned("x", x[1:])


def test_num_experts_change_needs_clean(monkeypatch):
    """Signal slots move with num_experts: onto bytes that held payload unless the buffer is cleaned."""
    eng = _fake_engine(monkeypatch)
    eng._check_signal_geometry(256)
    eng._check_signal_geometry(256)
    with pytest.raises(ValueError, match="clean_low_latency_buffer"):
        eng._check_signal_geometry(128)
    eng._signal_experts = 128      # what clean_low_latency_buffer(..., 128) records
    eng._check_signal_geometry(128)


def test_trace_report_spans_gaps_and_period():
    """The kernels' stamps (profiling) turn into per-kernel spans, gaps, the call span and the period."""
    trace = torch.zeros(ll.TRACE_CALLS * len(ll.TRACE_KERNELS) * 2, dtype=torch.int64)
    view = trace.view(ll.TRACE_CALLS, len(ll.TRACE_KERNELS), 2)
    view[:, :, 0] = -1
    for i, seq in enumerate((63, 0, 1)):   # three dispatch calls, the slot index wrapping around
        t0 = 1_000_000 + 100_000 * i       # ns: one call every 100 us
        view[seq, 0] = torch.tensor([t0, t0 + 10_000])              # stage 10 us
        view[seq, 1] = torch.tensor([t0 + 12_000, t0 + 40_000])     # send 28 us, 2 us after the stage
        view[seq, 2] = torch.tensor([t0 + 30_000, t0 + 80_000])     # recv started while send ran
        view[seq, 5] = torch.tensor([t0, t0 + 1_000])               # spreads: block starts over 1 us,
        view[seq, 6] = torch.tensor([t0 + 7_000, t0 + 9_000])       # arrivals at the stage barrier 7-9 us in
    engine = type("Stub", (), {"trace": trace})()
    report = ll.LowLatencyEngine.trace_report(engine)
    assert report["dispatch_stage"] == 10.0 and report["dispatch_send"] == 28.0 and report["dispatch_recv"] == 50.0
    assert report["dispatch_stage>dispatch_send"] == 2.0 and report["dispatch_send>dispatch_recv"] == -10.0
    assert report["call"] == 80.0 and report["period"] == 100.0
    assert report["dispatch_blocks"] == 1.0 and report["+last block start"] == 1.0
    assert report["+first staged"] == 7.0 and report["+last staged"] == 9.0
    assert not any(">" in k and "dispatch_blocks" in k or "dispatch_staged>" in k for k in report)   # not phases
    assert not any(k.startswith("combine") for k in report)   # untouched slots are not calls


@needs_nvcc
def test_kernels_wait_for_the_previous_grid(tmp_path):
    """Every LL kernel may be a programmatic dependent launch on sm_90 (grid_dependency.cuh): it waits for the
    previous grid before anything else and lets the next one be scheduled at its last phase's end; sm_80 has
    neither instruction (its launches are never programmatic)."""
    kernels = [(ll.DISPATCH_SOURCE, ll.DISPATCH_KERNEL, ll.kernel_defines(2048, 8))] + [
        (ll.COMBINE_SOURCE, ll.COMBINE_KERNEL, ll.kernel_defines(2048, 8, False, phase)) for phase in (SEND, RECV)]
    for source, kernel, defines in kernels:
        body = _kernel_body(_ptx(tmp_path, source, "sm_90", defines), kernel)
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body, (source, defines)
        assert body.index("griddepcontrol.wait") < body.index("ld.volatile"), "the wait comes before any counter read"
        assert "griddepcontrol" not in _ptx(tmp_path, source, "sm_80", defines)


def test_no_programmatic_launch_for_kernels_forced_to_an_older_architecture(monkeypatch):
    from deepep_portable.engines.launch import programmatic_launches

    monkeypatch.setenv("DEEPEP_PORTABLE_FORCE_ARCH", "sm_80")   # their wait for the previous grid is compiled out
    assert not programmatic_launches(torch.device("cuda", 0))   # decided without a device query


def test_programmatic_launches_switch(monkeypatch):
    from deepep_portable.engines.launch import PDL_SWITCH, programmatic_launches

    assert not programmatic_launches(torch.device("cpu"))
    monkeypatch.setenv(PDL_SWITCH, "0")
    assert not programmatic_launches(torch.device("cuda", 0))   # switched off: no device query at all
