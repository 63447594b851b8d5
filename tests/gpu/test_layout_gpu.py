"""Dispatch-layout kernel vs. a plain torch oracle on a real GPU (poisoned outputs)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepep_portable import _C, jit  # noqa: E402
from deepep_portable.engines import dispatch_layout as _kernels  # noqa: E402

_ok, _reason = _C.driver_status()
if not _ok:
    pytest.skip(f"CUDA driver unusable from _C: {_reason}", allow_module_level=True)


def oracle(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Straightforward reference on the CPU."""
    idx = topk_idx.cpu()
    n = idx.size(0)
    per_rank_experts = num_experts // num_ranks
    valid = (idx >= 0) & (idx < num_experts)
    per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    in_rank = torch.zeros(n, num_ranks, dtype=torch.bool)
    for r in range(num_ranks):
        lo, hi = r * per_rank_experts, (r + 1) * per_rank_experts
        in_rank[:, r] = ((idx >= lo) & (idx < hi)).any(dim=1)
    per_rank = in_rank.sum(0).to(torch.int32)
    return per_rank, per_expert, in_rank


def make_topk(num_tokens: int, num_topk: int, num_experts: int, masked: float, distinct: bool = True,
              gen: torch.Generator = None) -> torch.Tensor:
    if distinct:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        idx = scores.topk(num_topk, dim=1).indices
    else:
        idx = torch.randint(0, num_experts, (num_tokens, num_topk), generator=gen)
    if masked > 0 and num_tokens:
        idx[torch.rand(num_tokens, num_topk, generator=gen) < masked] = -1
    return idx.to(torch.int64).cuda()


def poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(0xAB)
    return t


def check(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, stream=None):
    n = topk_idx.size(0)
    per_rank = poisoned((num_ranks,), torch.int32)
    per_expert = poisoned((num_experts,), torch.int32)
    in_rank = poisoned((n, num_ranks), torch.bool)
    _kernels.dispatch_layout_cuda_into(topk_idx, num_experts, num_ranks, stream, per_rank, per_expert, in_rank)
    torch.cuda.synchronize()
    ref_rank, ref_expert, ref_in = oracle(topk_idx, num_experts, num_ranks)
    assert torch.equal(per_rank.cpu(), ref_rank)
    assert torch.equal(per_expert.cpu(), ref_expert)
    # Byte-exact 0/1 (not just truthy): downstream kernels read the raw bytes.
    assert torch.equal(in_rank.view(torch.uint8).cpu(), ref_in.to(torch.uint8))


SHAPES = [
    # (num_tokens, num_topk, num_experts, num_ranks, masked fraction)
    (0, 8, 256, 8, 0.0),
    (1, 8, 256, 8, 0.0),
    (1, 8, 256, 8, 1.0),          # a row of all -1
    (4096, 8, 256, 8, 0.1),
    (4096, 8, 256, 2, 0.0),
    (1000, 3, 12, 3, 0.2),        # odd everything
    (257, 1, 7, 7, 0.3),
    (3, 6, 64, 1, 0.0),           # single rank
    (513, 8, 128, 64, 0.1),       # 64 ranks: two mask words boundary
    (700, 9, 144, 72, 0.05),      # > 64 ranks
    (300, 128, 256, 16, 0.1),     # top-k 128
    (20000, 4, 128, 16, 0.0),     # more tokens than one grid pass on small grids
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}k{}e{}r{}m{}".format(*s))
def test_layout_matches_oracle(shape):
    n, k, e, r, masked = shape
    gen = torch.Generator().manual_seed(hash(shape) & 0xFFFF)
    check(make_topk(n, k, e, masked, gen=gen), e, r)


def test_layout_duplicates_and_out_of_range():
    # Non-distinct entries count per (token, k) for experts and once per rank; values outside
    # [0, E) other than -1 select nothing (Buffer validates them away; the kernel must not write).
    gen = torch.Generator().manual_seed(7)
    idx = make_topk(512, 8, 32, 0.1, distinct=False, gen=gen)
    idx[::7, 0] = 32 + 5
    idx[::11, 1] = -7
    check(idx, 32, 4)


def test_layout_rows_at_an_unaligned_address():
    """R % 8 == 0 but is_token_in_rank starts one byte into an allocation: the kernel must take its byte-wise
    path (its 8-byte stores need an 8-aligned base), and write nothing outside the view."""
    gen = torch.Generator().manual_seed(13)
    idx = make_topk(777, 8, 256, 0.1, gen=gen)
    per_rank, per_expert = poisoned((16,), torch.int32), poisoned((256,), torch.int32)
    backing = poisoned((777 * 16 + 2,), torch.bool)
    in_rank = backing[1:-1].view(777, 16)
    _kernels.dispatch_layout_cuda_into(idx, 256, 16, None, per_rank, per_expert, in_rank)
    torch.cuda.synchronize()
    ref_rank, ref_expert, ref_in = oracle(idx, 256, 16)
    assert torch.equal(per_rank.cpu(), ref_rank) and torch.equal(per_expert.cpu(), ref_expert)
    assert torch.equal(in_rank.view(torch.uint8).cpu(), ref_in.to(torch.uint8))
    edges = backing.view(torch.uint8)[[0, -1]].cpu().tolist()
    assert edges == [0xAB, 0xAB], f"bytes around the view were written: {edges}"


@pytest.mark.parametrize("num_topk", [8, 5])
def test_layout_topk_at_an_8_byte_aligned_address(num_topk):
    """topk_idx starting 8 bytes into an allocation (8- but not 16-byte aligned): the kernel must take its
    entry-by-entry paths (its 16-byte loads need a 16-aligned base), for an even and an odd top-k."""
    gen = torch.Generator().manual_seed(29)
    src = make_topk(1001, num_topk, 128, 0.1, gen=gen)
    backing = torch.empty(src.numel() + 1, dtype=torch.int64, device="cuda")
    idx = backing[1:].view(1001, num_topk)
    idx.copy_(src)
    assert idx.data_ptr() % 16 == 8
    got = _kernels.dispatch_layout_cuda(idx, 128, 8)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), want) for g, want in zip(got, oracle(idx, 128, 8)))


def test_layout_returns_fresh_outputs_on_side_stream():
    gen = torch.Generator().manual_seed(3)
    idx = make_topk(2048, 8, 256, 0.05, gen=gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    per_rank, per_expert, in_rank = _kernels.dispatch_layout_cuda(idx, 256, 8, side)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ref = oracle(idx, 256, 8)
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert torch.equal(per_rank.cpu(), ref[0]) and torch.equal(per_expert.cpu(), ref[1])
    assert torch.equal(in_rank.cpu(), ref[2])
    # Repeated launches into the same outputs: counters are re-zeroed each time.
    for _ in range(3):
        _kernels.dispatch_layout_cuda_into(idx, 256, 8, None, per_rank, per_expert, in_rank)
    torch.cuda.synchronize()
    assert torch.equal(per_rank.cpu(), ref[0]) and torch.equal(per_expert.cpu(), ref[1])


def test_layout_eager_path_in_a_cuda_graph(one_rank_group):
    """The eager hot path (dispatch_layout_current_stream, and Buffer.get_dispatch_layout around it: the bench's
    layout_graph row) captured once and replayed with new topk_idx contents; each replay matches the oracle."""
    import deepep_portable as deep_ep

    gen = torch.Generator().manual_seed(17)
    idx = make_topk(1000, 8, 256, 0.05, gen=gen)
    buf = deep_ep.Buffer(one_rank_group, 1 << 20, 0, transport="nvlink")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up outside the capture (kernel load, the range check's cache)
        _kernels.dispatch_layout_current_stream(idx, 256, 8, idx.device.index)
        buf.get_dispatch_layout(idx, 256)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _kernels.dispatch_layout_current_stream(idx, 256, 8, idx.device.index)
        per_rank1, _, per_expert1, in_rank1, _ = buf.get_dispatch_layout(idx, 256)
    for _ in range(3):
        idx.copy_(make_topk(1000, 8, 256, 0.05, gen=gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = oracle(idx, 256, 8)
        assert all(torch.equal(got.cpu(), want) for got, want in zip(outs, ref))
        ref1 = oracle(idx, 256, 1)
        assert torch.equal(per_rank1.cpu(), ref1[0]) and torch.equal(per_expert1.cpu(), ref1[1])
        assert torch.equal(in_rank1.cpu(), ref1[2])


def test_buffer_layout_hot_path_and_its_checks(one_rank_group, monkeypatch):
    """Buffer.get_dispatch_layout's eager hot path: taken for a plain, range-checked tensor (the full checks are not
    run again), and every argument it does not accept goes to the full checks, which raise; the Buffer stays usable
    and, once destroyed, refuses."""
    import deepep_portable as deep_ep
    from deepep_portable import _validate as check

    gen = torch.Generator().manual_seed(23)
    idx = make_topk(500, 8, 64, 0.05, gen=gen)
    buf = deep_ep.Buffer(one_rank_group, 1 << 20, 0, transport="nvlink", explicitly_destroy=True)
    buf.get_dispatch_layout(idx, 64)   # the full path: checks and remembers idx
    with monkeypatch.context() as m:
        m.setattr(check, "layout_args", lambda *a: pytest.fail("the hot path ran the full checks"))
        per_rank, per_node, per_expert, in_rank, event = buf.get_dispatch_layout(idx, 64)
    torch.cuda.synchronize()
    ref = oracle(idx, 64, 1)
    assert per_node is None and event.event is None
    assert torch.equal(per_rank.cpu(), ref[0]) and torch.equal(per_expert.cpu(), ref[1])
    assert torch.equal(in_rank.cpu(), ref[2])
    bad = idx.clone()
    bad[0, 0] = 64
    kept = int(idx[0, 0])
    idx[0, 0] = 64   # the same (range-checked) tensor object modified in place: checked again, refused
    with pytest.raises(ValueError, match="outside"):
        buf.get_dispatch_layout(idx, 64)
    idx[0, 0] = kept
    with torch.inference_mode():
        frozen = idx.clone()   # no version counter: never taken as checked
    torch.cuda.synchronize()
    assert torch.equal(buf.get_dispatch_layout(frozen, 64)[3].cpu(), ref[2])
    for call, error in ((lambda: buf.get_dispatch_layout(idx.int(), 64), TypeError),
                        (lambda: buf.get_dispatch_layout(idx.cpu(), 64), ValueError),
                        (lambda: buf.get_dispatch_layout(idx[:, ::2], 64), ValueError),
                        (lambda: buf.get_dispatch_layout(idx[:, :0], 64), ValueError),
                        (lambda: buf.get_dispatch_layout(idx, 64.0), TypeError),
                        (lambda: buf.get_dispatch_layout(idx, 0), ValueError),
                        (lambda: buf.get_dispatch_layout(idx, 32), ValueError),   # entries >= 32: out of range
                        (lambda: buf.get_dispatch_layout(bad, 64), ValueError)):
        with pytest.raises(error):
            call()
    assert torch.equal(buf.get_dispatch_layout(idx, 64)[3].cpu(), ref[2])
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.get_dispatch_layout(idx, 64)


def test_layout_non_contiguous_input():
    gen = torch.Generator().manual_seed(11)
    wide = make_topk(300, 16, 64, 0.1, gen=gen)
    idx = wide[:, ::2]  # [300, 8], not contiguous
    per_rank, per_expert, in_rank = _kernels.dispatch_layout_cuda(idx, 64, 4)
    torch.cuda.synchronize()
    ref = oracle(idx, 64, 4)
    assert torch.equal(per_rank.cpu(), ref[0]) and torch.equal(per_expert.cpu(), ref[1])
    assert torch.equal(in_rank.cpu(), ref[2])


def test_param_size_known_to_driver():
    fn = jit.load(_kernels.LAYOUT_SOURCE, _kernels.LAYOUT_KERNEL, {})
    import ctypes

    assert fn.param_size in (-1, ctypes.sizeof(_kernels.LayoutParams))
    attrs = fn.attributes()
    assert attrs["num_regs"] > 0 and attrs["local_bytes"] == 0


@pytest.mark.parametrize("shape", [(4096, 8, 256, 8, 0.1), (1000, 3, 12, 3, 0.2), (700, 9, 144, 72, 0.05)],
                         ids=lambda s: "n{}k{}e{}r{}".format(*s[:4]))
def test_layout_forced_sm80(monkeypatch, shape):
    """The sm_80 build (compute_80 PTX, JIT-compiled by the driver) on a newer GPU."""
    native = jit.device_arch(torch.cuda.current_device())
    if jit.arch_number(native) < 80:
        pytest.skip(f"device is {native}")
    monkeypatch.setenv("DEEPEP_PORTABLE_FORCE_ARCH", "sm_80")
    jit.clear_memory_cache()  # the environment is read when a function is first loaded
    try:
        n, k, e, r, masked = shape
        gen = torch.Generator().manual_seed(5)
        check(make_topk(n, k, e, masked, gen=gen), e, r)
        fn = jit.load(_kernels.LAYOUT_SOURCE, _kernels.LAYOUT_KERNEL, {})
        if native != "sm_80":
            attrs = fn.attributes()
            assert attrs["binary_version"] == int(native[3:])  # SASS JIT-compiled for this GPU
            assert attrs["ptx_version"] == 80                 # ... from the compute_80 PTX
    finally:
        monkeypatch.delenv("DEEPEP_PORTABLE_FORCE_ARCH")
        jit.clear_memory_cache()


def test_driver_helpers_roundtrip():
    dev = torch.cuda.current_device()
    info = _C.device_info(dev)
    major, minor = torch.cuda.get_device_capability(dev)
    assert (info["cc_major"], info["cc_minor"]) == (major, minor)
    assert info["sm_count"] == torch.cuda.get_device_properties(dev).multi_processor_count
    ptr = _C.mem_alloc(dev, 4096)
    try:
        base, size = _C.mem_get_address_range(dev, ptr + 100)
        assert base == ptr and size >= 4096
        _C.memset_d8_async(dev, ptr, 0x5A, 4096, 0)
        _C.stream_synchronize(dev, 0)
        assert _C.stream_query(dev, 0)
        assert len(_C.ipc_get_mem_handle(dev, ptr)) == _C.IPC_HANDLE_BYTES
    finally:
        _C.mem_free(dev, ptr)
    host, dptr = _C.host_alloc_mapped(dev, 256)
    assert host and dptr
    _C.host_free(dev, host)
    # torch's current device is untouched by _C's context switching.
    assert torch.cuda.current_device() == dev


def test_stream_wait_stream_orders_eager_and_captured_work():
    """_C.stream_wait_stream (Buffer's ordering of its comm stream against the caller's): work on the waiter
    starts after the waited stream's earlier work, eagerly (behind a 20 ms sleep) and inside a CUDA graph."""
    dev = torch.cuda.current_device()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x, y = torch.zeros(1, device="cuda"), torch.full((1,), -1.0, device="cuda")
    torch.cuda.synchronize()
    for value in (1.0, 2.0):   # twice: the reused event orders the second pair as the first
        with torch.cuda.stream(a):
            torch.cuda._sleep(40_000_000)
            x.fill_(value)
        _C.stream_wait_stream(dev, b.cuda_stream, a.cuda_stream)
        with torch.cuda.stream(b):
            y.copy_(x)
        torch.cuda.synchronize()
        assert y.item() == value
    # captured: a fork to a side stream and the join back, as a captured op's comm stream does
    src, dst = torch.arange(1 << 20, device="cuda", dtype=torch.float32), torch.zeros(1 << 20, device="cuda")
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture):
        with torch.cuda.graph(graph, stream=capture):
            src.add_(1)
            _C.stream_wait_stream(dev, side.cuda_stream, capture.cuda_stream)
            with torch.cuda.stream(side):
                dst.copy_(src)
            _C.stream_wait_stream(dev, capture.cuda_stream, side.cuda_stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, src) and float(src[0]) == 1.0


def test_forced_arch_newer_than_device_is_refused(monkeypatch):
    dev = torch.cuda.current_device()
    monkeypatch.setenv("DEEPEP_PORTABLE_FORCE_ARCH", "sm_999")
    jit.clear_memory_cache()
    try:
        with pytest.raises(ValueError, match="newer than device"):
            jit.load(_kernels.LAYOUT_SOURCE, _kernels.LAYOUT_KERNEL, {}, device=dev)
    finally:
        monkeypatch.delenv("DEEPEP_PORTABLE_FORCE_ARCH")
        jit.clear_memory_cache()
