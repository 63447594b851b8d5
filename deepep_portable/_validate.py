"""Argument checks shared by every Buffer op.

Each check raises `TypeError` (wrong kind of object or dtype) or `ValueError` (wrong shape, device,
range or size) *before* anything is launched or exchanged, so a rejected call leaves the Buffer
usable and every peer untouched (peers only block inside a collective that was actually started).
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import Callable, Optional, Sequence, Tuple

import torch

from .config import Config
from .handles import DispatchHandle, LowLatencyHandle
from .device import device_index
from .layout import MAX_TOPK, NormalLayout, low_latency_rdma_size_hint

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)


def tensor(name: str, t: object, dtype: Optional[torch.dtype] = None, shape: Optional[Sequence[Optional[int]]] = None,
           device: Optional[torch.device] = None, contiguous: bool = True,
           dtypes: Optional[Sequence[torch.dtype]] = None) -> torch.Tensor:
    """Check one tensor argument. `None` entries in `shape` match any size. Every op checks several tensors before its
    first kernel, so the passing path is plain comparisons (no generators, no tuples built per call)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (bool(dtypes) and t.dtype not in dtypes) if dtypes is not None else (dtype is not None and t.dtype != dtype):
        allowed = tuple(dtypes) if dtypes is not None else (dtype,)
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)}, got {t.dtype}")
    if shape is not None:
        actual = t.shape
        ok = len(actual) == len(shape)
        if ok:
            for want, got in zip(shape, actual):
                if want is not None and want != got:
                    ok = False
                    break
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None:
        where = t.device
        if where != device and not _same_device(where, device):
            raise ValueError(f"{name} is on {where}, but this Buffer works on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    # Equal devices first: the C-level compare is what a hot path pays (device_index may ask torch for the
    # current device, when one side has no index).
    return a == b or (a.type == b.type and (a.type != "cuda" or device_index(a) == device_index(b)))


def positive_int(name: str, v: object, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def num_experts(v: object, num_ranks: int) -> int:
    positive_int("num_experts", v)
    if v >= 1 << 31:   # the kernels take it as int32
        raise ValueError(f"num_experts must be below 2^31, got {v}")
    if v % num_ranks != 0:
        raise ValueError(f"num_experts ({v}) must be divisible by the number of ranks ({num_ranks})")
    return v


def _range_check_enabled(t: torch.Tensor) -> bool:
    if os.environ.get("DEEPEP_PORTABLE_SKIP_RANGE_CHECK", "0") == "1":
        return False
    # A range check reads the tensor on the host: impossible while a CUDA graph is being captured.
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


_last_checked: list = [None, None]   # (weakref to the tensor object, key)


def _checked_key(topk_idx: torch.Tensor, num_experts: int) -> tuple:
    """What the range check's cache compares: an in-place write bumps the version, a new storage or shape changes
    the rest."""
    return topk_idx._version, topk_idx.data_ptr(), topk_idx.shape, num_experts


def range_checked(topk_idx: torch.Tensor, num_experts: int) -> bool:
    """Whether expert_indices already checked this unmodified tensor object for num_experts (its cache). An
    inference-mode tensor has no version counter: never taken as checked."""
    ref = _last_checked[0]
    return (ref is not None and ref() is topk_idx and not topk_idx.is_inference()
            and _last_checked[1] == _checked_key(topk_idx, num_experts))


def expert_indices(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every entry must be -1 (no expert) or a valid expert id. Costs one host sync on CUDA tensors,
    once per tensor: the usual get_dispatch_layout -> dispatch sequence checks the same unmodified
    tensor object (same object, same version counter) only once. Skipped during graph capture and when
    DEEPEP_PORTABLE_SKIP_RANGE_CHECK=1."""
    if range_checked(topk_idx, num_experts):   # checked, unmodified (an inference tensor: every time)
        return
    if topk_idx.numel() == 0 or not _range_check_enabled(topk_idx):
        return
    lo, hi = torch.aminmax(topk_idx)
    lo, hi = int(lo), int(hi)
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(f"{name} holds expert index {bad}, outside [-1, {num_experts}) (num_experts={num_experts})")
    if not topk_idx.is_inference():
        _last_checked[0], _last_checked[1] = weakref.ref(topk_idx), _checked_key(topk_idx, num_experts)


# ---- the Buffer's argument checks (ctx: the Buffer's contract.BufferContext) -------------------------
def hidden(h: int, fp8: bool) -> None:
    if h <= 0:
        raise ValueError(f"hidden must be positive, got {h}")
    if fp8 and h % 128 != 0:
        raise ValueError(f"FP8 dispatch needs hidden to be a multiple of 128 (one scale per 128 channels), got {h}")
    if not fp8 and h % 8 != 0:
        raise ValueError(f"BF16 hidden must be a multiple of 8 elements (16 bytes), got {h}")


def layout_args(topk_idx: torch.Tensor, dtype: torch.dtype, num_experts_: int, num_ranks: int,
                device: torch.device) -> None:
    """get_dispatch_layout's arguments: topk_idx a [N, K] tensor of `dtype` on `device`, K in range, its entries
    -1 or experts, num_experts_ a multiple of the rank count."""
    tensor("topk_idx", topk_idx, dtype, (None, None), device)
    num_experts(num_experts_, num_ranks)
    topk_width(topk_idx)
    expert_indices("topk_idx", topk_idx, num_experts_)


def topk_width(t: torch.Tensor) -> int:
    k = t.size(1)
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"top-k must be in [1, {MAX_TOPK}], got {k}")
    return k


def dispatch_x(x, device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(data, scales): a BF16 tensor, or an FP8 tuple (data, scales)."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError("FP8 x must be a tuple (data, scales)")
        data, scales = x
        tensor("x[0]", data, shape=(None, None), device=device, dtypes=FP8_DTYPES)
        hidden(data.size(1), fp8=True)
        # Any strides (e.g. column-major, `scales.T.contiguous().T`, what DeepGEMM consumes): the
        # kernels read them in place; received scales are row-major [rows, S], as DeepEP returns them.
        tensor("x[1] (scales)", scales, shape=(data.size(0), None), device=device,
               dtypes=(torch.float32, torch.int32), contiguous=False)
        return data, scales
    tensor("x", x, torch.bfloat16, (None, None), device)
    hidden(x.size(1), fp8=False)
    return x, None


def config(cfg: Optional[Config], default: Callable[[], Config]) -> Config:
    if cfg is None:
        return default()
    if not isinstance(cfg, Config):
        raise TypeError(f"config must be a deepep_portable.Config, got {type(cfg).__name__}")
    return cfg


def unpack_bias(bias) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, tuple) and len(bias) == 2:
        return bias
    raise TypeError("bias must be None, a tensor, or a tuple of two tensors")


def capacity(ctx, op: str, num_tokens: int, layout: NormalLayout) -> None:
    """The normal-mode buffer (num_nvl_bytes) holds `num_tokens` tokens per rank of this layout. Over several
    nodes the internode engine checks its own window (num_rdma_bytes) before launching; the reference needs none."""
    if ctx.num_nodes > 1:
        return
    most = room(layout, ctx.num_nvl_bytes)
    if most < num_tokens:
        need = layout.buffer_bytes(num_tokens)
        raise ValueError(f"{op} of {num_tokens} tokens needs a larger buffer: this Buffer has num_nvl_bytes="
                         f"{ctx.num_nvl_bytes}, room for {most} tokens per rank ({layout.bytes_per_token} bytes per "
                         f"token); create it with num_nvl_bytes >= {need} "
                         f"(Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, num_tokens))")


@functools.lru_cache(maxsize=256)
def room(layout: NormalLayout, num_nvl_bytes: int) -> int:
    """Tokens per rank a normal-mode buffer of num_nvl_bytes holds in this layout."""
    return layout.max_tokens_per_rank(num_nvl_bytes)


@functools.lru_cache(maxsize=256)
def _layout(num_ranks: int, hidden_: int, elem_bytes: int, num_scales: int, num_topk: int) -> NormalLayout:
    return NormalLayout(num_ranks, hidden_, elem_bytes, num_scales, num_topk)


def dispatch_capacity(ctx, x: torch.Tensor, x_scales: Optional[torch.Tensor], num_topk: int) -> None:
    capacity(ctx, "dispatch", x.size(0), _layout(ctx.num_ranks, x.size(1), x.element_size(),
                                                 0 if x_scales is None else x_scales.size(1), num_topk))


def combine_layout(num_ranks: int, hidden_: int, num_topk: int) -> NormalLayout:
    """The normal-mode layout of a BF16 combine (the layout its capacity check uses)."""
    return _layout(num_ranks, hidden_, 2, 0, num_topk)


def combine_capacity(ctx, num_tokens: int, hidden_: int, num_topk: int) -> None:
    capacity(ctx, "combine", num_tokens, combine_layout(ctx.num_ranks, hidden_, num_topk))


def combine_args(x, handle, topk_weights, bias, cfg, buffer_uid: int, device: torch.device,
                 default_num_sms: int) -> Tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Buffer.combine's arguments (the capacity apart): (num_sms, bias_0, bias_1), or raise with the reason."""
    dispatch_handle(handle, buffer_uid)
    tensor("x", x, torch.bfloat16, (handle.num_recv_rows, None), device)
    hidden(x.size(1), fp8=False)
    if topk_weights is not None:
        tensor("topk_weights", topk_weights, torch.float32, (handle.num_recv_rows, None), device)
        topk_width(topk_weights)
    bias_0, bias_1 = unpack_bias(bias)
    for name, b in (("bias[0]", bias_0), ("bias[1]", bias_1)):
        if b is not None:
            tensor(name, b, torch.bfloat16, (handle.num_tokens, x.size(1)), device)
    # The default config's only field the kernels use is num_sms: no Config built per call.
    return (default_num_sms if cfg is None else config(cfg, None).num_sms), bias_0, bias_1


def combine_eager(x, handle, topk_weights, bias, config, buffer_uid: int, device_index: int) -> bool:
    """Whether Buffer.combine's arguments are the common case that passes every check of its full path
    (dispatch_handle, tensor, hidden, topk_width, unpack_bias, config; the capacity is the engine's to check):
    a DispatchHandle of this Buffer, x a contiguous [handle.num_recv_rows, H] BF16 tensor on the Buffer's GPU with
    H a positive multiple of 8, top-k weights None or a contiguous [rows, K] float32 tensor there with K in
    [1, MAX_TOPK], no bias, config None or a Config. Plain comparisons (its eager path is bound by host time); False
    sends the call through the full checks, which raise with the reason."""
    return (bias is None and (config is None or type(config) is Config)
            and type(handle) is DispatchHandle and handle.buffer_uid == buffer_uid
            and type(x) is torch.Tensor and x.dtype is torch.bfloat16 and x.dim() == 2
            and x.size(0) == handle.num_recv_rows and x.size(1) > 0 and x.size(1) % 8 == 0
            and x.get_device() == device_index and x.is_contiguous()
            and (topk_weights is None
                 or (type(topk_weights) is torch.Tensor and topk_weights.dtype is torch.float32
                     and topk_weights.dim() == 2 and topk_weights.size(0) == handle.num_recv_rows
                     and 1 <= topk_weights.size(1) <= MAX_TOPK and topk_weights.get_device() == device_index
                     and topk_weights.is_contiguous())))


def dispatch_handle(handle, buffer_uid: int, num_tokens: Optional[int] = None) -> None:
    """A DispatchHandle of this Buffer (and, for a cached dispatch, of `num_tokens` tokens)."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError("handle must be the DispatchHandle returned by this Buffer's dispatch")
    if handle.buffer_uid != buffer_uid:
        raise ValueError("handle was produced by another Buffer; pass the handle from this Buffer's dispatch")
    if num_tokens is not None and handle.num_tokens != num_tokens:
        raise ValueError(f"x has {num_tokens} tokens, but the handle was made for {handle.num_tokens}")


def low_latency(ctx, num_max_dispatch_tokens_per_rank: int, h: int, num_experts_: int) -> None:
    """A low-latency call of this shape fits this Buffer (low_latency_mode, num_rdma_bytes)."""
    if not ctx.low_latency_mode:
        raise ValueError("low-latency ops need a Buffer created with low_latency_mode=True")
    positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    if num_max_dispatch_tokens_per_rank >= 1 << 24:   # a signal's count field (low_latency/protocol.cuh)
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be < {1 << 24}, got {num_max_dispatch_tokens_per_rank}")
    num_experts(num_experts_, ctx.num_ranks)
    if h % 128 != 0:
        raise ValueError(f"low-latency hidden must be a multiple of 128, got {h}")
    need = low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, h, ctx.num_ranks, num_experts_)
    if ctx.num_rdma_bytes < need:
        raise ValueError(f"num_rdma_bytes={ctx.num_rdma_bytes} is too small for {num_max_dispatch_tokens_per_rank} "
                         f"tokens x hidden {h} x {num_experts_} experts: need >= {need} "
                         f"(Buffer.get_low_latency_rdma_size_hint)")


def low_latency_handle(handle) -> LowLatencyHandle:
    """The handle of low_latency_dispatch (a plain 5-tuple of DeepEP's order is accepted too)."""
    if isinstance(handle, tuple) and not isinstance(handle, LowLatencyHandle) and len(handle) == 5:
        handle = LowLatencyHandle(*handle)
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError("handle must be the handle returned by low_latency_dispatch")
    return handle
