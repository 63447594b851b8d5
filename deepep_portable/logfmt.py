"""LogFMT-10 in torch: what `low_latency_combine(use_logfmt=True)` does to each expert-output row.

The GPU format and its numerics are described in csrc/common/kernels/low_latency/logfmt.cuh (DeepEP
V1's LogFMT: per 128 channels an amax / amin pair, per 512- or 1024-channel chunk either bf16 or a sign
and a 9-bit log code per channel). `roundtrip` returns the values a receiver decodes. It uses exact
log2 / exp2 where the kernels use the GPU's approximate instructions, so a value within a rounding
error of a code boundary may decode one code away (relative difference at most 2^step - 1, step <=
32 / 510); the reference transport uses it, and the tests compare the kernels against it with that
tolerance.
"""
from __future__ import annotations

import torch

MAX_CODE = 511
MIN_CLIP = 32.0


def chunk_channels(hidden: int) -> int:
    """Channels per cast decision: 1024 when hidden % 1024 == 0, else 512 (hidden % 512 == 0)."""
    if hidden % 512 or hidden > 8192:
        raise ValueError(f"use_logfmt needs hidden % 512 == 0 and hidden <= 8192, got {hidden}")
    return 1024 if hidden % 1024 == 0 else 512


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """bf16 [..., H] -> float32 [..., H]: each row encoded to LogFMT-10 and decoded."""
    hidden = x.shape[-1]
    chunk = chunk_channels(hidden)
    lead = x.shape[:-1]
    xf = x.float()
    mag = xf.abs().reshape(*lead, hidden // 128, 128)
    amax, amin = mag.amax(-1), mag.amin(-1)
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - MIN_CLIP)
    ok = (log_amax < 0) & (log_amin < log_amax)
    per_chunk = chunk // 128
    cast = ok.reshape(*lead, hidden // chunk, per_chunk).all(-1, keepdim=True).expand(*lead, hidden // chunk, per_chunk)
    cast = cast.reshape(*lead, hidden // 128, 1)
    step = ((log_amax - log_amin) / (MAX_CODE - 1)).unsqueeze(-1)
    lo = log_amin.unsqueeze(-1)
    safe_step = torch.where(cast, step, torch.ones_like(step))   # never divide by a non-cast division's step
    step_inv = 1.0 / safe_step
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(safe_step)) * 0.5) * step_inv
    fused = rounding - torch.where(cast, lo, torch.zeros_like(lo)) * step_inv
    code = torch.floor(torch.clamp(torch.log2(mag) * step_inv + fused, min=0.0)).clamp(max=MAX_CODE)
    decoded = torch.where(code == 0, torch.zeros_like(mag), torch.exp2((code - 1) * safe_step + lo))
    decoded = torch.where(xf.reshape(mag.shape).signbit(), -decoded, decoded)
    return torch.where(cast, decoded, xf.reshape(mag.shape)).reshape(*lead, hidden)
