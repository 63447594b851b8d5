"""Kernels of the benchmark (csrc/common/kernels/copy.cu): a plain copy with a given block count, a
copy of spans to many addresses (an op's traffic pattern), and the GPU start line every timed sample
leaves from. Tools only: no op of the library launches them."""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from .. import jit
from ..device import device_index
from ..engines.launch import StreamLike, launch
from ..windows.base import MappedWords
from ..windows.ipc import IpcWindow

COPY_SOURCE = "common/kernels/copy.cu"
COPY_INT4 = jit.kernel_symbol("deepep_portable::bench::copy_int4", "CopyParams")
COPY_SEGMENTS = jit.kernel_symbol("deepep_portable::bench::copy_segments", "CopySegmentsParams")
START_LINE = jit.kernel_symbol("deepep_portable::bench::start_line", "StartLineParams")


class CopyParams(ctypes.Structure):
    """Mirror of `struct CopyParams` in copy.cu."""

    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("num_int4", ctypes.c_int64)]


def copy_with_blocks(dst: torch.Tensor, src: torch.Tensor, num_blocks: int, stream: StreamLike = None) -> None:
    """dst <- src (same byte size, multiple of 16) with exactly `num_blocks` blocks of 256 threads."""
    nbytes = src.numel() * src.element_size()
    assert nbytes == dst.numel() * dst.element_size() and nbytes % 16 == 0
    fn = jit.load(COPY_SOURCE, COPY_INT4, {}, device_index(src))
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
        self.fn = jit.load(COPY_SOURCE, COPY_SEGMENTS, {}, device_index(src))

    def __call__(self, num_blocks: int, stream: StreamLike = None) -> None:
        launch(self.fn, max(1, num_blocks), 256, self.params, stream)


class StartLineParams(ctypes.Structure):
    """Mirror of `struct StartLineParams` in copy.cu."""

    _fields_ = [("counter", ctypes.c_uint64), ("target", ctypes.c_uint64), ("timed_out", ctypes.c_uint64),
                ("timeout_ns", ctypes.c_uint64), ("released", ctypes.c_uint64)]


class StartLine:
    """The benchmark's start line on the GPU (kernel `start_line` in copy.cu): cross() enqueues a
    one-thread kernel that returns once every rank's stream has reached its own cross(), or after
    `timeout_s`, setting the flag check() raises on. Collective to build (one IPC window over ctx's
    group); every rank must call cross() the same number of times. The ranks add to one word in rank
    0's memory with system-scope atomics: ranks on one GPU or on NVLink-connected GPUs; GPUs joined by
    PCIe without peer atomics need `bench --start-line host`."""

    def __init__(self, ctx, timeout_s: float = 60.0) -> None:
        self.window = IpcWindow(ctx, 256, 256, "start line")
        self.flag = MappedWords(self.window.dev, 4)   # [0]: timed out; bytes 8..15: globaltimer at the release
        self.world, self.crossings, self.timeout_ns = ctx.num_ranks, 0, int(timeout_s * 1e9)
        self.fn = jit.load(COPY_SOURCE, START_LINE, {}, self.window.dev)

    def cross(self, stream: StreamLike = None) -> None:
        self.crossings += 1
        params = StartLineParams(self.window.bases[0], self.world * self.crossings, self.flag.dev, self.timeout_ns,
                                 self.flag.dev + 8)
        launch(self.fn, 1, 32, params, stream)

    def check(self) -> None:
        if self.flag.words[0]:
            raise RuntimeError("bench start line: a rank waited past the timeout for the others (a rank "
                               "skipped a timed sample or is stuck)")

    def released_ns(self) -> int:
        """The GPU's globaltimer (ns) when the last crossing on this rank's stream opened (after a synchronize)."""
        return ctypes.c_uint64.from_address(self.flag.host + 8).value

    def close(self) -> None:
        self.window.close()   # collective
        self.flag.free()


jit.register_family("copy", COPY_SOURCE, [COPY_INT4, COPY_SEGMENTS, START_LINE], variants=[{}])
