"""Python launch glue for the CUDA kernels: parameter structs, launch helpers, op wrappers.

Convention (shared with csrc/common/kernels/common.cuh): a kernel takes one struct parameter
passed by value. Its host mirror here is a `ctypes.Structure` with the same fields in the same
order: pointers as `c_uint64` (tensor.data_ptr()), integers with explicit widths. `launch()` packs
it to bytes; `_C` rejects a launch whose byte size differs from the kernel's parameter (when the
driver can report it), and tests/test_jit.py checks the sizes against the PTX on the CPU.

Streams: outputs are allocated with torch on the *current* stream; device work is enqueued on the
`stream` argument. Ordering between the two (and record_stream) is the caller's job (Buffer._op).
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence, Tuple, Union

import torch

from . import jit
from .device import device_index, device_info, forced_arch, sm_count  # noqa: F401

Dim = Union[int, Sequence[int]]


# ---- generic helpers --------------------------------------------------------------------------

StreamLike = Union[None, int, torch.cuda.Stream]


def stream_handle(stream: StreamLike, device: Optional[int] = None) -> int:
    """CUstream as an int: `stream` itself if an int, its handle if a torch stream, else the
    current torch stream of `device`. (Resolve once per op: current_stream() costs microseconds.)"""
    if stream is None:
        stream = torch.cuda.current_stream(device)
    return stream if isinstance(stream, int) else int(stream.cuda_stream)


def launch(fn, grid: Dim, block: Dim, params: ctypes.Structure, stream: StreamLike = None,
           shared_mem: int = 0, cluster: Optional[Dim] = None, cooperative: bool = False) -> None:
    """Launch `fn` (a `_C.Function`) with the packed `params` struct on `stream`."""
    fn.launch(grid, block, shared_mem, stream_handle(stream, fn.device), bytes(params), cluster, cooperative)


def zero_async(t: torch.Tensor, stream: StreamLike) -> None:
    """Zero a contiguous CUDA tensor on `stream` (cuMemsetD8Async, no torch kernel)."""
    from . import _C

    nbytes = t.numel() * t.element_size()
    if nbytes:
        dev = device_index(t)
        _C.memset_d8_async(dev, t.data_ptr(), 0, nbytes, stream_handle(stream, dev))


class KernelCache:
    """jit.load memoized per (source, kernel, defines, forced arch) for one device: the hot path of
    an op should not rebuild jit's cache keys on every call."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._fns: dict = {}

    def get(self, source: str, name: str, defines: dict):
        key = (source, name, tuple(sorted(defines.items())), forced_arch())
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = jit.load(source, name, defines, self.device)
        return fn


# ---- dispatch layout ----------------------------------------------------------------------------

LAYOUT_SOURCE = "common/kernels/layout.cu"
LAYOUT_KERNEL = "dispatch_layout"
LAYOUT_THREADS = 256  # kThreads in layout.cu


class LayoutParams(ctypes.Structure):
    """Mirror of `struct LayoutParams` in layout.cu."""

    _fields_ = [
        ("topk_idx", ctypes.c_uint64),
        ("num_tokens_per_rank", ctypes.c_uint64),
        ("num_tokens_per_expert", ctypes.c_uint64),
        ("is_token_in_rank", ctypes.c_uint64),
        ("num_tokens", ctypes.c_int64),
    ]


def layout_defines(num_topk: int, num_ranks: int, num_experts: int) -> dict:
    return dict(NUM_TOPK=num_topk, NUM_RANKS=num_ranks, NUM_EXPERTS=num_experts)


def _check_layout_args(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> None:
    if not topk_idx.is_cuda or topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be a 2-D int64 CUDA tensor, got {topk_idx.dtype} "
                         f"{tuple(topk_idx.shape)} on {topk_idx.device}")
    if not 1 <= topk_idx.size(1) <= 128:
        raise ValueError(f"top-k must be in [1, 128], got {topk_idx.size(1)}")
    if num_ranks < 1 or num_experts < num_ranks or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})")


def _launch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, dev: int, stream: int,
                   per_rank_ptr: int, per_expert_ptr: int, in_rank_ptr: int) -> None:
    """The kernel alone (counters must already be zeroed on `stream`); nothing for 0 tokens."""
    num_tokens, num_topk = topk_idx.shape
    if num_tokens == 0:
        return
    fn = jit.load(LAYOUT_SOURCE, LAYOUT_KERNEL, layout_defines(num_topk, num_ranks, num_experts), device=dev)
    params = LayoutParams(topk_idx.data_ptr(), per_rank_ptr, per_expert_ptr, in_rank_ptr, num_tokens)
    blocks = min((num_tokens + LAYOUT_THREADS - 1) // LAYOUT_THREADS, 2 * sm_count(dev))
    fn.launch(blocks, LAYOUT_THREADS, 0, stream, bytes(params))


def dispatch_layout_cuda_into(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, stream: StreamLike,
                              num_tokens_per_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                              is_token_in_rank: torch.Tensor) -> None:
    """Write the layout of `topk_idx` into the given outputs (any prior contents) on `stream`.

    Outputs: num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool, all contiguous on topk_idx's device. Enqueues two memsets and
    (for N > 0) one kernel on `stream`; topk_idx must stay alive until they run.
    """
    _check_layout_args(topk_idx, num_experts, num_ranks)
    num_tokens = topk_idx.size(0)
    for name, t, shape, dtype in (("num_tokens_per_rank", num_tokens_per_rank, (num_ranks,), torch.int32),
                                  ("num_tokens_per_expert", num_tokens_per_expert, (num_experts,), torch.int32),
                                  ("is_token_in_rank", is_token_in_rank, (num_tokens, num_ranks), torch.bool)):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != topk_idx.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {topk_idx.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not topk_idx.is_contiguous():
        raise ValueError("topk_idx must be contiguous")
    dev = device_index(topk_idx)
    h = stream_handle(stream, dev)
    zero_async(num_tokens_per_rank, h)
    zero_async(num_tokens_per_expert, h)
    _launch_layout(topk_idx, num_experts, num_ranks, dev, h, num_tokens_per_rank.data_ptr(),
                   num_tokens_per_expert.data_ptr(), is_token_in_rank.data_ptr())


def dispatch_layout_cuda(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                         stream: StreamLike = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool).

    Outputs are allocated on the current stream, the work (one memset, one kernel) runs on
    `stream` (current if None). Rank r holds experts [r*E/R, (r+1)*E/R); entries of -1 select
    nothing; a token counts once per rank however many of its experts live there. The two count
    tensors are views of one int32 allocation [R + E] (one memset instead of two).
    """
    _check_layout_args(topk_idx, num_experts, num_ranks)
    dev = device_index(topk_idx)
    h = stream_handle(stream, dev)
    if not topk_idx.is_contiguous():
        topk_idx = topk_idx.contiguous()
        if stream is not None and h != torch.cuda.current_stream(dev).cuda_stream:
            topk_idx.record_stream(stream if isinstance(stream, torch.cuda.Stream)
                                   else torch.cuda.ExternalStream(h, device=topk_idx.device))
    counts = torch.empty(num_ranks + num_experts, dtype=torch.int32, device=topk_idx.device)
    in_rank = torch.empty(topk_idx.size(0), num_ranks, dtype=torch.bool, device=topk_idx.device)
    zero_async(counts, h)
    ptr = counts.data_ptr()
    _launch_layout(topk_idx, num_experts, num_ranks, dev, h, ptr, ptr + 4 * num_ranks, in_rank.data_ptr())
    return counts[:num_ranks], counts[num_ranks:], in_rank


# ---- plain copy (the benchmark's ceiling) -------------------------------------------------------

COPY_SOURCE = "common/kernels/copy.cu"


class CopyParams(ctypes.Structure):
    """Mirror of `struct CopyParams` in copy.cu."""

    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("num_int4", ctypes.c_int64)]


def copy_with_blocks(dst: torch.Tensor, src: torch.Tensor, num_blocks: int, stream: StreamLike = None) -> None:
    """dst <- src (same byte size, multiple of 16) with exactly `num_blocks` blocks of 256 threads."""
    nbytes = src.numel() * src.element_size()
    assert nbytes == dst.numel() * dst.element_size() and nbytes % 16 == 0
    fn = jit.load(COPY_SOURCE, "copy_int4", {}, device_index(src))
    launch(fn, max(1, num_blocks), 256, CopyParams(src.data_ptr(), dst.data_ptr(), nbytes // 16), stream)


class CopySegmentsParams(ctypes.Structure):
    """Mirror of `struct CopySegmentsParams` in copy.cu."""

    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("num_int4", ctypes.c_uint64),
                ("num_segments", ctypes.c_int32)]


class SegmentCopy:
    """One launch that copies consecutive spans of `src` to the given addresses (peers' memory
    mapped over CUDA IPC included): the benchmark's ceiling for an op's traffic pattern. The address
    and length tables live on the device, so the launch can be captured in a CUDA graph."""

    def __init__(self, src: torch.Tensor, dst_addresses: Sequence[int], nbytes: Sequence[int]) -> None:
        if len(dst_addresses) != len(nbytes) or any(n % 16 for n in nbytes):
            raise ValueError("one destination per segment, each a multiple of 16 bytes")
        if sum(nbytes) > src.numel() * src.element_size():
            raise ValueError("the segments exceed the source")
        self.src = src
        self.dst = torch.tensor(list(dst_addresses), dtype=torch.int64, device=src.device)
        self.num_int4 = torch.tensor([n // 16 for n in nbytes], dtype=torch.int64, device=src.device)
        self.params = CopySegmentsParams(src.data_ptr(), self.dst.data_ptr(), self.num_int4.data_ptr(), len(nbytes))
        self.fn = jit.load(COPY_SOURCE, "copy_segments", {}, device_index(src))

    def __call__(self, num_blocks: int, stream: StreamLike = None) -> None:
        launch(self.fn, max(1, num_blocks), 256, self.params, stream)


class StartLineParams(ctypes.Structure):
    """Mirror of `struct StartLineParams` in copy.cu."""

    _fields_ = [("counter", ctypes.c_uint64), ("target", ctypes.c_uint64), ("timed_out", ctypes.c_uint64),
                ("timeout_ns", ctypes.c_uint64)]


class StartLine:
    """The benchmark's start line on the GPU (kernel `start_line` in copy.cu): cross() enqueues a
    one-thread kernel that returns once every rank's stream has reached its own cross(), or after
    `timeout_s`, setting the flag check() raises on. Collective to build (one IPC window over ctx's
    group); every rank must call cross() the same number of times. The ranks add to one word in rank
    0's memory with system-scope atomics: ranks on one GPU or on NVLink-connected GPUs; GPUs joined by
    PCIe without peer atomics need `bench --start-line host`."""

    def __init__(self, ctx, timeout_s: float = 60.0) -> None:
        from .ipc import IpcWindow, MappedWords

        self.window = IpcWindow(ctx, 256, 256, "start line")
        self.flag = MappedWords(self.window.dev, 1)
        self.world, self.crossings, self.timeout_ns = ctx.num_ranks, 0, int(timeout_s * 1e9)
        self.fn = jit.load(COPY_SOURCE, "start_line", {}, self.window.dev)

    def cross(self, stream: StreamLike = None) -> None:
        self.crossings += 1
        params = StartLineParams(self.window.bases[0], self.world * self.crossings, self.flag.dev, self.timeout_ns)
        launch(self.fn, 1, 32, params, stream)

    def check(self) -> None:
        if self.flag.words[0]:
            raise RuntimeError("bench start line: a rank waited past the timeout for the others (a rank "
                               "skipped a timed sample or is stuck)")

    def close(self) -> None:
        self.window.close()   # collective
        self.flag.free()
