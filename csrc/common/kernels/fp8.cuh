// The FP8 cast of the dispatch kernels: per token and per 128 channels, one float32 scale.
// Shared by every kernel that casts (low-latency dispatch; the internode dispatch to come), and compiled
// for the host by tests/test_low_latency_host.py to check it bit for bit against tests/oracle.py.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/kernels/common.cuh"

namespace deepep_portable::fp8 {

constexpr int kFp8Block = 128;         // channels per FP8 scale

// ---- FP8 cast (bit-exact with tests/oracle.py fp8_cast on the CPU) ------------------------------------
// amax = max |x| over 128 channels, clamped to >= 1e-4f; scale = amax / 448 (correctly rounded);
// round_scale: the smallest power of two >= scale (from the bits: scale is a positive normal float);
// data = e4m3(x / scale), round to nearest even. Saturation modes differ (torch's .to(float8_e4m3fn)
// gives NaN from 464 up, __NV_SATFINITE clamps to 448) but are never reached: |x| <= amax and scale >=
// amax / 448 correctly rounded, so |x / scale| <= 448 * (1 + 2^-23), which rounds to 448. Bit-exact for
// finite inputs; NaN/Inf inputs are outside the contract (fmaxf drops NaN, torch's amax keeps it).
DEEPEP_HOST_DEVICE float fp8_scale(float amax, bool round_scale) {
    amax = amax < 1e-4f ? 1e-4f : amax;
#ifdef __CUDA_ARCH__
    float scale = __fdiv_rn(amax, 448.0f);
#else
    float scale = amax / 448.0f;
#endif
    if (round_scale) {
        uint32_t bits;
        memcpy(&bits, &scale, 4);
        uint32_t e = (bits >> 23) & 0xffu;
        if (bits & 0x7fffffu)
            e += 1;
        bits = e << 23;
        memcpy(&scale, &bits, 4);
    }
    return scale;
}

// Two quotients as two e4m3 bytes (round to nearest even, saturating; see above).
DEEPEP_HOST_DEVICE uint16_t to_fp8x2(float2 q) {
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3));
}

// By division: the reference the tests compare div_by_scale with.
DEEPEP_HOST_DEVICE uint16_t fp8x2(float a, float b, float scale) {
#ifdef __CUDA_ARCH__
    return to_fp8x2(make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale)));
#else
    return to_fp8x2(make_float2(a / scale, b / scale));
#endif
}

// x / scale correctly rounded without a division per element (div.rn is a dozen instructions and the
// stage of the LL dispatch divides every channel): with inv = RN(1 / scale), q0 = RN(x * inv) is within
// one ulp of x / scale, the remainder x - q0 * scale is exact in one FMA, and RN(q0 + rem * inv) is then
// RN(x / scale) (Markstein's theorem) as long as nothing underflows (x and the quotient >= 2^-100 in
// magnitude here); otherwise the quotient is far below FP8's smallest step and casts to a zero of x's sign
// either way. A zero remainder keeps q0, which also keeps the sign of x = -0. tests/test_low_latency_host.py
// checks both for every bf16 x against every scale the cast can make (both scale modes).
DEEPEP_HOST_DEVICE float reciprocal(float scale) {
#ifdef __CUDA_ARCH__
    return __frcp_rn(scale);
#else
    return 1.0f / scale;
#endif
}

// A NaN remainder (outside the contract: an Inf in the block makes scale Inf, inv 0, and 0 * Inf NaN) also
// keeps q0, so the block's finite channels still cast to zero as x / Inf does, instead of all to NaN.
DEEPEP_HOST_DEVICE float div_by_scale(float x, float scale, float inv) {
#ifdef __CUDA_ARCH__
    const float q0 = __fmul_rn(x, inv);
    const float rem = __fmaf_rn(-q0, scale, x);
    return rem == 0.0f || rem != rem ? q0 : __fmaf_rn(rem, inv, q0);
#else
    const float q0 = x * inv;
    const float rem = std::fmaf(-q0, scale, x);
    return rem == 0.0f || rem != rem ? q0 : std::fmaf(rem, inv, q0);
#endif
}

// fp8x2 with the quotients from div_by_scale: the same bytes (the kernels' path).
DEEPEP_HOST_DEVICE uint16_t fp8x2_inv(float a, float b, float scale, float inv) {
    return to_fp8x2(make_float2(div_by_scale(a, scale, inv), div_by_scale(b, scale, inv)));
}

// FP8 cast of 128-channel blocks [b_begin, b_end) of one bf16 row by a warp (b_begin even): lanes
// 0-15 handle block b, lanes 16-31 block b+1; each lane 8 channels (one 16-byte word). Writes the
// blocks' fp8 bytes into `data` (the row's H bytes) and their float32 scales into `scales` (S).
// The loads of kBatch block pairs are issued together (the stores in between would otherwise keep
// the compiler from hoisting them: one memory round trip per pair).
DEEPEP_DEVICE void cast_row_fp8(const int4* __restrict__ row, char* __restrict__ data, float* __restrict__ scales,
                                bool round_scale, int lane, int b_begin, int b_end) {
    constexpr int kBatch = 8;
    const int half = lane / 16, l16 = lane % 16;
    for (int b0 = b_begin; b0 < b_end; b0 += 2 * kBatch) {
        int4 raw[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int b = b0 + 2 * u + half;
            raw[u] = b < b_end ? row[b * 16 + l16] : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            if (b0 + 2 * u >= b_end)
                break;   // uniform over the warp: the shuffles below stay converged
            const int b = b0 + 2 * u + half;
            const bool active = b < b_end;
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
            float f[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 v = __bfloat1622float2(h[i]);
                f[2 * i] = v.x;
                f[2 * i + 1] = v.y;
            }
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
            for (int off = 8; off >= 1; off /= 2)
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));   // stays within each 16-lane half
            const float scale = fp8_scale(amax, round_scale);
            const float inv = reciprocal(scale);
            if (active) {
                uint2 out;
                out.x = static_cast<uint32_t>(fp8x2_inv(f[0], f[1], scale, inv)) |
                        (static_cast<uint32_t>(fp8x2_inv(f[2], f[3], scale, inv)) << 16);
                out.y = static_cast<uint32_t>(fp8x2_inv(f[4], f[5], scale, inv)) |
                        (static_cast<uint32_t>(fp8x2_inv(f[6], f[7], scale, inv)) << 16);
                reinterpret_cast<uint2*>(data + b * kFp8Block)[l16] = out;
                if (l16 == 0)
                    scales[b] = scale;
            }
        }
    }
}

}  // namespace deepep_portable::fp8
