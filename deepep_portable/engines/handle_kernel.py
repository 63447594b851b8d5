"""V2's plain-layout handle fields in one kernel (csrc/common/kernels/elastic_handle.cu): what
`elastic_handle.handle_fields_torch` computes, for a CUDA dispatch without do_expand. One allocation and one
launch instead of some thirty tensor operations, whose host time bound a V2 dispatch.
"""
from __future__ import annotations

import ctypes
import struct
import torch

from .. import jit
from ..device import device_index
from ..elastic_handle import HandleFields
from .launch import current_stream_handle

SOURCE = "common/kernels/elastic_handle.cu"
KERNEL = jit.kernel_symbol("deepep_portable::handle::elastic_handle", "HandleParams")
THREADS = 256        # kThreads in elastic_handle.cu
MAX_BLOCKS = 264     # a grid stride past this: the kernel is a few microseconds at any size


class HandleParams(ctypes.Structure):
    """Mirror of `struct HandleParams` in elastic_handle.cu."""

    _fields_ = [
        ("rank_prefix_matrix", ctypes.c_uint64),
        ("recv_src_idx", ctypes.c_uint64),
        ("recv_topk_idx", ctypes.c_uint64),
        ("send_rows", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("metadata", ctypes.c_uint64),
        ("dst_slot", ctypes.c_uint64),
        ("counts", ctypes.c_uint64),
        ("psum_per_expert", ctypes.c_uint64),
        ("psum_per_scaleup", ctypes.c_uint64),
        ("done", ctypes.c_uint64),
        ("rows", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("num_max_tokens_per_rank", ctypes.c_int64),
        ("num_topk", ctypes.c_int32),
        ("num_ranks", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("num_scaleup_ranks", ctypes.c_int32),
        ("num_local_experts", ctypes.c_int32),
        ("expert_alignment", ctypes.c_int32),
    ]


# Packed without a ctypes object (the hot path); tests/test_mirrors.py checks the mirror against the C struct.
_PACK_STRUCT = struct.Struct("<11Qqqq6i")
_FIELD_NAMES = tuple(name for name, _ in HandleParams._fields_)
assert _PACK_STRUCT.size == ctypes.sizeof(HandleParams)
MAX_SHARED_BYTES = 48 * 1024   # the dynamic shared memory a launch gets without opting in


def pack_params(fields: dict) -> bytes:
    """HandleParams' bytes from its fields by name (the C struct's order comes from the mirror)."""
    return _PACK_STRUCT.pack(*(fields[name] for name in _FIELD_NAMES))


def _check(rank_prefix_matrix, recv_src_idx, recv_topk_idx, send_rows, topk_idx, num_scaleup_ranks: int,
           num_local_experts: int) -> None:
    """The shapes and types the kernel reads (its callers pass a V1 handle's tensors: a mismatch is a bug here,
    but one that would read out of bounds, so it raises instead)."""
    num_ranks = rank_prefix_matrix.size(0)
    rows, num_topk = recv_topk_idx.shape
    problems = []
    if rank_prefix_matrix.shape != (num_ranks, num_ranks):
        problems.append(f"rank_prefix_matrix {tuple(rank_prefix_matrix.shape)} is not square")
    if recv_topk_idx.dtype != torch.int64 or topk_idx.dtype != torch.int64:
        problems.append(f"top-k indices must be int64 (got {recv_topk_idx.dtype}, {topk_idx.dtype})")
    if recv_src_idx.shape != (rows,):
        problems.append(f"recv_src_idx {tuple(recv_src_idx.shape)} is not [{rows}]")
    if topk_idx.dim() != 2 or topk_idx.size(1) != num_topk:
        problems.append(f"topk_idx {tuple(topk_idx.shape)} is not [tokens, {num_topk}]")
    elif send_rows.shape != (topk_idx.size(0), num_ranks):
        problems.append(f"send_rows {tuple(send_rows.shape)} is not [{topk_idx.size(0)}, {num_ranks}]")
    if num_scaleup_ranks < 1 or num_ranks % num_scaleup_ranks:
        problems.append(f"{num_scaleup_ranks} scale-up ranks do not divide {num_ranks} ranks")
    if 4 * (num_ranks + num_local_experts) > MAX_SHARED_BYTES:
        problems.append(f"{num_ranks} ranks and {num_local_experts} local experts outgrow the kernel's shared memory")
    if problems:
        raise ValueError("handle kernel: " + "; ".join(problems))

_functions: dict = {}   # (device, forced arch) -> kernel (every shape is a run-time value)


def _kernel(dev: int):
    key = (dev, jit.forced_arch())
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = jit.load(SOURCE, KERNEL, {}, device=dev)
    return fn


def handle_fields(rank_prefix_matrix: torch.Tensor, recv_src_idx: torch.Tensor, recv_topk_idx: torch.Tensor,
                  send_rows: torch.Tensor, topk_idx: torch.Tensor, *, rank: int, num_scaleup_ranks: int,
                  num_local_experts: int, num_max_tokens_per_rank: int, expert_alignment: int) -> HandleFields:
    """handle_fields_torch's result for do_expand=False, on the current stream (inputs as the V1 handle holds them;
    the prefix matrix, source indices and send rows taken as int32)."""
    device = recv_topk_idx.device
    dev = device_index(recv_topk_idx)
    num_ranks = rank_prefix_matrix.size(0)
    rows, num_topk = recv_topk_idx.shape
    num_tokens = topk_idx.size(0)
    _check(rank_prefix_matrix, recv_src_idx, recv_topk_idx, send_rows, topk_idx, num_scaleup_ranks, num_local_experts)
    prefix = rank_prefix_matrix.to(torch.int32).contiguous()
    src_idx = recv_src_idx.to(torch.int32).contiguous()
    recv_idx = recv_topk_idx.contiguous()
    slots = send_rows.to(torch.int32).contiguous()
    idx = topk_idx.contiguous()
    metadata = torch.empty((rows, num_topk + 2), dtype=torch.int32, device=device)
    dst_slot = torch.empty((num_tokens, num_topk), dtype=torch.int32, device=device)
    # counts (zeroed: the blocks add to it), the two prefix sums, and the last-block counter (zeroed)
    small = torch.zeros(2 * num_local_experts + num_scaleup_ranks + 1, dtype=torch.int32, device=device)
    base = small.data_ptr()
    blocks = max(1, min(MAX_BLOCKS, -(-max(rows, num_tokens) // THREADS)))
    shared = 4 * (num_ranks + num_local_experts)
    fields = dict(
        rank_prefix_matrix=prefix.data_ptr(), recv_src_idx=src_idx.data_ptr(), recv_topk_idx=recv_idx.data_ptr(),
        send_rows=slots.data_ptr(), topk_idx=idx.data_ptr(), metadata=metadata.data_ptr(),
        dst_slot=dst_slot.data_ptr(), counts=base, psum_per_expert=base + 4 * num_local_experts,
        psum_per_scaleup=base + 8 * num_local_experts, done=base + 4 * (2 * num_local_experts + num_scaleup_ranks),
        rows=rows, num_tokens=num_tokens, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
        num_ranks=num_ranks, rank=rank, num_scaleup_ranks=num_scaleup_ranks, num_local_experts=num_local_experts,
        expert_alignment=expert_alignment)
    params = pack_params(fields)
    _kernel(dev).launch(blocks, THREADS, shared, current_stream_handle(dev), params)
    counts, psum_expert, psum_scaleup, _ = torch.split_with_sizes(
        small, (num_local_experts, num_local_experts, num_scaleup_ranks, 1))
    return HandleFields(metadata, dst_slot, counts, psum_expert, psum_scaleup)


# What `python -m deepep_portable precompile` and CI compile of this kernel.
jit.register_family("elastic_handle", SOURCE, [KERNEL], variants=[{}])
