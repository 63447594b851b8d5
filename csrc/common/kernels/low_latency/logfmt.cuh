// LogFMT-10: the compressed row format of low_latency_combine(use_logfmt=True), with DeepEP V1's
// numerics (the format its `use_logfmt` sends; the arithmetic below follows the same formulas and the
// same approximate log2 / exp2 instructions, so both libraries round a value to the same code).
//
// A bf16 row of H channels (H % 512 == 0) is cut into chunks of kChunk channels (1024 when H % 1024 ==
// 0, else 512) and divisions of 128 channels. Per division: amax and amin of |x| (bf16, exact), kept
// as a bf16 pair in the row's head (the meta). A chunk is cast when every division in it has
//   log_amax = log2(amax) < 0   and   log_amin = max(log2(amin), log_amax - 32) < log_amax,
// otherwise it travels as bf16. In a cast chunk each channel becomes a sign bit and a 9-bit code:
//   step = (log_amax - log_amin) / 510,   code = floor(max(log2|x| / step + rounding, 0)),
//   rounding = 2 - log2((1 + 2^step) / 2) / step - log_amin / step,
// so code 0 is zero and code k >= 1 is 2^(log_amin + (k - 1) step), each |x| going to the nearer of
// its two neighbouring levels in linear terms (the midpoint test folded into `rounding`). 16 channels
// (256 bits of bf16) pack into 160 bits: 16 codes of 9 bits, little-endian from bit 0 of the first
// word, then the 16 sign bits in the top half of the fifth word.
//
// Encoded row: [meta: H / 128 bf16 pairs (amax, amin)] [chunk 0] [chunk 1] ..., a chunk taking
// kChunk * 10 / 8 bytes when cast, kChunk * 2 when not; the receiver finds the chunks from the meta.
// In a chunk, lane l of a warp owns channels [l * kLaneChannels, (l + 1) * kLaneChannels).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/kernels/common.cuh"

namespace deepep_portable::low_latency::logfmt {

DEEPEP_DEVICE float log2_approx(float x) {
    float y;
    asm volatile("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

DEEPEP_DEVICE float exp2_approx(float x) {
    float y;
    asm volatile("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

constexpr float kMinClip = 32.0f;      // log_amin >= log_amax - 32
constexpr int kMaxCode = 511;          // 9-bit codes; 510 steps between log_amin and log_amax

template <int kHidden>
struct Format {
    static_assert(kHidden % 512 == 0, "LogFMT needs hidden % 512 == 0");
    static constexpr int kChunk = kHidden % 1024 == 0 ? 1024 : 512;
    static constexpr int kChunks = kHidden / kChunk;
    static constexpr int kLaneChannels = kChunk / 32;          // 32 or 16
    static constexpr int kLaneWords = kLaneChannels / 8;       // bf16 int4 words per lane: 4 or 2
    static constexpr int kLaneGroups = kLaneChannels / 16;     // 160-bit groups per lane: 2 or 1
    static constexpr int kLanesPerDivision = 128 / kLaneChannels;
    static constexpr int kDivisions = kHidden / 128;
    static constexpr int kMetaBytes = kDivisions * 4;
    static constexpr int kCastChunkBytes = kChunk * 10 / 8;
    static constexpr int kRawChunkBytes = kChunk * 2;
    static constexpr int kRowBytes = kMetaBytes + kHidden * 2;   // the most a row can take
    static_assert(kDivisions <= 64, "LogFMT meta is read by one warp, two divisions per lane");
};

// The step and the encoder's rounding term of one division (the same float operations on both sides).
DEEPEP_DEVICE float step_of(float log_amax, float log_amin) {
    return (log_amax - log_amin) / static_cast<float>(kMaxCode - 1);
}

DEEPEP_DEVICE bool castable(float log_amax, float log_amin) {
    return log_amax < 0.0f && log_amin < log_amax;
}

DEEPEP_DEVICE float clipped_log_amin(float amin, float log_amax) {
    return fmaxf(log2_approx(amin), log_amax - kMinClip);   // lg2(0) = -inf: clipped too
}

// Encode one bf16 row (`src`, 16-byte aligned) with a whole warp into `dst` (4-byte aligned, here or
// in a peer's memory); returns the encoded row's bytes (the same value on every lane).
template <int kHidden>
DEEPEP_DEVICE int encode_row(const int4* src, char* dst, int lane) {
    using F = Format<kHidden>;
    int offset = F::kMetaBytes;
#pragma unroll 1
    for (int chunk = 0; chunk < F::kChunks; ++chunk) {
        int4 v[F::kLaneWords];
        const int4* in = src + (chunk * F::kChunk + lane * F::kLaneChannels) / 8;
#pragma unroll
        for (int u = 0; u < F::kLaneWords; ++u)
            v[u] = in[u];
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(v);   // two bf16 per word
        float amax = 0.0f, amin = __int_as_float(0x7f800000);
#pragma unroll
        for (int i = 0; i < F::kLaneChannels / 2; ++i) {
            const uint32_t magnitudes = bits[i] & 0x7fff7fffu;   // sign bits cleared
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&magnitudes));
            amax = fmaxf(amax, fmaxf(f.x, f.y));
            amin = fminf(amin, fminf(f.x, f.y));
        }
#pragma unroll
        for (int m = 1; m < F::kLanesPerDivision; m *= 2) {   // over the lanes of my division
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
            amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, m));
        }
        const float log_amax = log2_approx(amax);
        const float log_amin = clipped_log_amin(amin, log_amax);
        const bool cast = __all_sync(0xffffffffu, castable(log_amax, log_amin));
        if (lane % F::kLanesPerDivision == 0) {
            const int division = (chunk * F::kChunk + lane * F::kLaneChannels) / 128;
            *reinterpret_cast<__nv_bfloat162*>(dst + 4 * division) = __floats2bfloat162_rn(amax, amin);
        }
        if (cast) {
            const float step = step_of(log_amax, log_amin);
            const float step_inv = 1.0f / step;
            const float rounding = __fmaf_rn(-log2_approx((1.0f + exp2_approx(step)) * 0.5f), step_inv, 2.0f);
            const float fused = __fmaf_rn(-log_amin, step_inv, rounding);
            uint32_t* out = reinterpret_cast<uint32_t*>(dst + offset + lane * F::kLaneGroups * 20);
#pragma unroll
            for (int grp = 0; grp < F::kLaneGroups; ++grp) {
                uint32_t word[5] = {0, 0, 0, 0, 0};
                uint32_t signs = 0;
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    const uint32_t b = (bits[grp * 8 + i / 2] >> (16 * (i % 2))) & 0xffffu;
                    signs |= (b >> 15) << i;
                    const float x = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b & 0x7fffu)));
                    const uint32_t code = __float2uint_rd(fmaxf(__fmaf_rn(log2_approx(x), step_inv, fused), 0.0f));
                    const int at = 9 * i;   // bits [at, at + 9) of the group's 144 code bits
                    word[at / 32] |= code << (at % 32);
                    if (at % 32 > 23)
                        word[at / 32 + 1] |= code >> (32 - at % 32);
                }
                word[4] |= signs << 16;
#pragma unroll
                for (int k = 0; k < 5; ++k)
                    out[grp * 5 + k] = word[k];
            }
            offset += F::kCastChunkBytes;
        } else {
            int4* out = reinterpret_cast<int4*>(dst + offset) + lane * F::kLaneWords;
#pragma unroll
            for (int u = 0; u < F::kLaneWords; ++u)
                out[u] = v[u];
            offset += F::kRawChunkBytes;
        }
    }
    return offset;
}

// The receiving side of one encoded row for one chunk: where the chunk starts, whether it is cast,
// and this lane's division's log_amax / log_amin. Reads the row's meta (one or two words per lane).
struct ChunkView {
    int offset;
    bool cast;
    float log_amax;
    float log_amin;
};

template <int kHidden>
DEEPEP_DEVICE ChunkView view_chunk(const char* row, int chunk, int lane) {
    using F = Format<kHidden>;
    float lmax[2], lmin[2];
    uint64_t ok = 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int d = lane + 32 * half;
        bool good = false;
        lmax[half] = lmin[half] = 0.0f;
        if (d < F::kDivisions) {
            const float2 mm = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + 4 * d));
            lmax[half] = log2_approx(mm.x);
            lmin[half] = clipped_log_amin(mm.y, lmax[half]);
            good = castable(lmax[half], lmin[half]);
        }
        ok |= static_cast<uint64_t>(__ballot_sync(0xffffffffu, good)) << (32 * half);
    }
    constexpr uint64_t kChunkMask = (1ull << (F::kChunk / 128)) - 1;
    ChunkView view{F::kMetaBytes, false, 0.0f, 0.0f};
    for (int c = 0; c < chunk; ++c)
        view.offset += ((ok >> (c * (F::kChunk / 128))) & kChunkMask) == kChunkMask ? F::kCastChunkBytes : F::kRawChunkBytes;
    view.cast = ((ok >> (chunk * (F::kChunk / 128))) & kChunkMask) == kChunkMask;
    const int d = (chunk * F::kChunk + lane * F::kLaneChannels) / 128;
    view.log_amax = __shfl_sync(0xffffffffu, d < 32 ? lmax[0] : lmax[1], d % 32);
    view.log_amin = __shfl_sync(0xffffffffu, d < 32 ? lmin[0] : lmin[1], d % 32);
    return view;
}

// This lane's kLaneChannels values of one chunk of an encoded row (`row`: its first byte), as floats.
template <int kHidden>
DEEPEP_DEVICE void decode_lane(const char* row, const ChunkView& view, int lane, float* out) {
    using F = Format<kHidden>;
    if (view.cast) {
        const uint32_t* in = reinterpret_cast<const uint32_t*>(row + view.offset + lane * F::kLaneGroups * 20);
        const float step = step_of(view.log_amax, view.log_amin);
#pragma unroll
        for (int grp = 0; grp < F::kLaneGroups; ++grp) {
            uint32_t word[5];
#pragma unroll
            for (int k = 0; k < 5; ++k)
                word[k] = in[grp * 5 + k];
            const uint32_t signs = word[4] >> 16;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int at = 9 * i;
                uint32_t code = word[at / 32] >> (at % 32);
                if (at % 32 > 23)
                    code |= word[at / 32 + 1] << (32 - at % 32);
                code &= 0x1ffu;
                const float mag = code == 0 ? 0.0f : exp2_approx(__fmaf_rn(static_cast<float>(code - 1), step, view.log_amin));
                out[grp * 16 + i] = (signs >> i) & 1u ? -mag : mag;
            }
        }
    } else {
        const int4* in = reinterpret_cast<const int4*>(row + view.offset) + lane * F::kLaneWords;
#pragma unroll
        for (int u = 0; u < F::kLaneWords; ++u) {
            const int4 w = in[u];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = __bfloat1622float2(h[i]);
                out[u * 8 + 2 * i] = f.x;
                out[u * 8 + 2 * i + 1] = f.y;
            }
        }
    }
}

}  // namespace deepep_portable::low_latency::logfmt
