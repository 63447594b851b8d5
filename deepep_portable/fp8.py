"""FP8 per-token cast as DeepEP defines it: bf16 [N, H] -> float8_e4m3fn data and one float32 scale per 128
channels of a token, correctly rounded on any device (the kernels compute the same bits; `tests/oracle.py`
states the same definition independently). The reference transport quantizes low-latency dispatches with it,
and the bench tools make their FP8 inputs with it."""
from __future__ import annotations

from typing import Tuple

import torch

FP8_MAX = 448.0          # largest finite float8_e4m3fn
FP8_AMAX_MIN = 1e-4      # per-128-channel amax is clamped to at least this before computing the scale
FP8_BLOCK = 128          # channels sharing one scale


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """Exponent of the smallest power of two >= x, for positive normal float32 x (exact, from the bits)."""
    bits = x.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def cast(x: torch.Tensor, round_scale: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel cast of bf16 [N, H] -> (float8_e4m3fn [N, H], float32 scales [N, H/128]).

    scale = max(amax, 1e-4) / 448 (rounded up to a power of two with `round_scale`);
    data = float8(x / scale), round to nearest even.
    """
    n, h = x.shape
    xf = x.float().reshape(n, h // FP8_BLOCK, FP8_BLOCK)
    amax = xf.abs().amax(dim=-1).clamp(min=FP8_AMAX_MIN)
    # A tensor divisor, not the Python scalar: on CUDA, torch divides by a CPU scalar as a multiplication by
    # its reciprocal, one ulp off the correctly rounded quotient the kernels compute (e.g. amax 3.28125).
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale = ((ceil_pow2(scale) + 127) << 23).view(torch.float32)
    data = (xf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, h)
    return data, scale


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [M, S] -> int32 [M, S/4]: byte j%4 of int j = biased exponent of scale j."""
    exponent_bytes = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exponent_bytes.contiguous().view(torch.int32)
