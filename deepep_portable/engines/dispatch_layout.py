"""The dispatch layout (`Buffer.get_dispatch_layout`): per-rank and per-expert token counts and the
token -> rank mask of a top-k routing, on the GPU (kernel csrc/common/kernels/layout.cu) or with
plain torch (CPU tensors). A local computation: no communication.
"""
from __future__ import annotations

import ctypes
import struct
from typing import Optional, Tuple

import torch

from .. import jit
from ..device import device_index
from .launch import StreamLike, current_stream_handle, stream_handle

LAYOUT_SOURCE = "common/kernels/layout.cu"
LAYOUT_KERNEL = jit.kernel_symbol("deepep_portable::layout::routing_layout", "LayoutParams")
LAYOUT_THREADS = 1024          # kThreads in layout.cu
LAYOUT_PER_BLOCK = 8           # kPerBlock in layout.cu: experts or ranks per block


def layout_grid(num_ranks: int, num_experts: int) -> int:
    """kGridBlocks of layout.cu: a block per 8 experts and one per 8 ranks."""
    return -(-num_experts // LAYOUT_PER_BLOCK) + -(-num_ranks // LAYOUT_PER_BLOCK)


class LayoutParams(ctypes.Structure):
    """Mirror of `struct LayoutParams` in layout.cu."""

    _fields_ = [
        ("topk_idx", ctypes.c_uint64),
        ("num_tokens_per_rank", ctypes.c_uint64),
        ("num_tokens_per_expert", ctypes.c_uint64),
        ("is_token_in_rank", ctypes.c_uint64),
        ("num_tokens", ctypes.c_int64),
        ("num_topk", ctypes.c_int32),
        ("num_ranks", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


def _check_layout_args(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> None:
    if not topk_idx.is_cuda or topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be a 2-D int64 CUDA tensor, got {topk_idx.dtype} "
                         f"{tuple(topk_idx.shape)} on {topk_idx.device}")
    if not 1 <= topk_idx.size(1) <= 128:
        raise ValueError(f"top-k must be in [1, 128], got {topk_idx.size(1)}")
    if num_ranks < 1 or num_experts < num_ranks or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})")
    if num_experts >= 1 << 31:   # the kernel takes the shapes as int32
        raise ValueError(f"num_experts ({num_experts}) must be below 2^31")


# LayoutParams packed without a ctypes object (the hot path); the ctypes mirror is what tests/test_mirrors.py
# checks against the kernel's struct, field by field.
_PACK_STRUCT = struct.Struct("<QQQQqiiii")
assert _PACK_STRUCT.size == ctypes.sizeof(LayoutParams)
_PACK = _PACK_STRUCT.pack

_functions: dict = {}   # (device, forced arch) -> kernel (one for every shape: they are run-time values)


def _kernel(dev: int):
    key = (dev, jit.forced_arch())
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = jit.load(LAYOUT_SOURCE, LAYOUT_KERNEL, {}, device=dev)
    return fn


def _launch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, dev: int, stream: int,
                   per_rank_ptr: int, per_expert_ptr: int, in_rank_ptr: int) -> None:
    """The kernel (it writes every output element, counts included, for any token count, 0 too)."""
    num_tokens, num_topk = topk_idx.shape
    _kernel(dev).launch(layout_grid(num_ranks, num_experts), LAYOUT_THREADS, 0, stream,
                        _PACK(topk_idx.data_ptr(), per_rank_ptr, per_expert_ptr, in_rank_ptr, num_tokens,
                              num_topk, num_ranks, num_experts, 0))


def dispatch_layout_cuda_into(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, stream: StreamLike,
                              num_tokens_per_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                              is_token_in_rank: torch.Tensor) -> None:
    """Write the layout of `topk_idx` into the given outputs (any prior contents) on `stream`.

    Outputs: num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool, all contiguous on topk_idx's device. Enqueues one kernel on
    `stream`; topk_idx must stay alive until it runs.
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
    _launch_layout(topk_idx, num_experts, num_ranks, dev, h, num_tokens_per_rank.data_ptr(),
                   num_tokens_per_expert.data_ptr(), is_token_in_rank.data_ptr())


def dispatch_layout_cuda(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                         stream: StreamLike = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool).

    Outputs are allocated on the current stream, the work (one kernel) runs on `stream` (current if
    None). Rank r holds experts [r*E/R, (r+1)*E/R); entries of -1 select nothing; a token counts once
    per rank however many of its experts live there. The two counts are views of one allocation: an eager
    call is bound by its host path.
    """
    _check_layout_args(topk_idx, num_experts, num_ranks)
    dev = device_index(topk_idx)
    h = stream_handle(stream, dev)
    if not topk_idx.is_contiguous():
        topk_idx = topk_idx.contiguous()
        if stream is not None and h != torch.cuda.current_stream(dev).cuda_stream:
            topk_idx.record_stream(stream if isinstance(stream, torch.cuda.Stream)
                                   else torch.cuda.ExternalStream(h, device=topk_idx.device))
    return _layout_into_new_outputs(topk_idx, num_experts, num_ranks, dev, h)


def dispatch_layout_current_stream(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, dev: int):
    """dispatch_layout_cuda on the current stream of device index `dev` (topk_idx's), for arguments already
    validated (Buffer's checks): the eager hot path, an allocation and a launch (the host path is most of such a
    call's time)."""
    return _layout_into_new_outputs(topk_idx, num_experts, num_ranks, dev, current_stream_handle(dev))


def _layout_into_new_outputs(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, dev: int, stream: int):
    """The three outputs, allocated on the current stream (the two counts as halves of one allocation), and the
    kernel writing them on `stream`. The fewest tensor operations (each costs microseconds of host time, which is
    most of an eager call): two allocations and one split (on this machine's CPU 3.7 us against 5.7 us for one
    allocation and four views; as_strided alone costs 2.3 us)."""
    device = topk_idx.device
    counts = torch.empty(num_ranks + num_experts, dtype=torch.int32, device=device)
    in_rank = torch.empty((topk_idx.size(0), num_ranks), dtype=torch.bool, device=device)
    ptr = counts.data_ptr()
    _launch_layout(topk_idx, num_experts, num_ranks, dev, stream, ptr, ptr + 4 * num_ranks, in_rank.data_ptr())
    per_rank, per_expert = torch.split_with_sizes(counts, (num_ranks, num_experts))
    return per_rank, per_expert, in_rank


def dispatch_layout_torch(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    experts_per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)   # as the kernel: entries outside [0, E) select nothing
    per_expert = torch.bincount(topk_idx[valid].flatten(), minlength=num_experts).to(torch.int32)
    rank_of = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, num_ranks))
    in_rank = torch.zeros(topk_idx.size(0), num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, rank_of, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    per_rank = in_rank.sum(0, dtype=torch.int32)
    return per_rank, per_expert, in_rank


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    stream: Optional[torch.cuda.Stream]):
    """(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) of topk_idx, on its device."""
    if topk_idx.is_cuda:
        return dispatch_layout_cuda(topk_idx, num_experts, num_ranks, stream)
    return dispatch_layout_torch(topk_idx, num_experts, num_ranks)


# What `python -m deepep_portable precompile` and CI compile of this kernel.
jit.register_family("layout", LAYOUT_SOURCE, [LAYOUT_KERNEL], variants=[{}])
