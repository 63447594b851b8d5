"""Argument checks shared by every Buffer op.

Each check raises `TypeError` (wrong kind of object or dtype) or `ValueError` (wrong shape, device,
range or size) *before* anything is launched or exchanged, so a rejected call leaves the Buffer
usable and every peer untouched (peers only block inside a collective that was actually started).
"""
from __future__ import annotations

import os
import weakref
from typing import Optional, Sequence

import torch

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)


def tensor(name: str, t: object, dtype: Optional[torch.dtype] = None, shape: Optional[Sequence[Optional[int]]] = None,
           device: Optional[torch.device] = None, contiguous: bool = True,
           dtypes: Optional[Sequence[torch.dtype]] = None) -> torch.Tensor:
    """Check one tensor argument. `None` entries in `shape` match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = tuple(dtypes) if dtypes is not None else ((dtype,) if dtype is not None else ())
    if allowed and t.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and not _same_device(t.device, device):
        raise ValueError(f"{name} is on {t.device}, but this Buffer works on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ai = a.index if a.index is not None else torch.cuda.current_device()
        bi = b.index if b.index is not None else torch.cuda.current_device()
        return ai == bi
    return True


def positive_int(name: str, v: object, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def num_experts(v: object, num_ranks: int) -> int:
    positive_int("num_experts", v)
    if v % num_ranks != 0:
        raise ValueError(f"num_experts ({v}) must be divisible by the number of ranks ({num_ranks})")
    return v


def _range_check_enabled(t: torch.Tensor) -> bool:
    if os.environ.get("DEEPEP_PORTABLE_SKIP_RANGE_CHECK", "0") == "1":
        return False
    # A range check reads the tensor on the host: impossible while a CUDA graph is being captured.
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


_last_checked: list = [None, None]   # (weakref to the tensor object, key)


def expert_indices(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every entry must be -1 (no expert) or a valid expert id. Costs one host sync on CUDA tensors,
    once per tensor: the usual get_dispatch_layout -> dispatch sequence checks the same unmodified
    tensor object (same object, same version counter) only once. Skipped during graph capture and when
    DEEPEP_PORTABLE_SKIP_RANGE_CHECK=1."""
    if topk_idx.numel() == 0 or not _range_check_enabled(topk_idx):
        return
    key = (topk_idx._version, topk_idx.data_ptr(), tuple(topk_idx.shape), num_experts)
    ref = _last_checked[0]
    if ref is not None and ref() is topk_idx and _last_checked[1] == key:
        return
    lo, hi = torch.aminmax(topk_idx)
    lo, hi = int(lo), int(hi)
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(f"{name} holds expert index {bad}, outside [-1, {num_experts}) (num_experts={num_experts})")
    _last_checked[0], _last_checked[1] = weakref.ref(topk_idx), key
