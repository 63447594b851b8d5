// Float32 accumulation of bf16 rows, shared by the combine kernels: plain round-to-nearest adds (no
// multiply, so no FMA contraction can change a bit against the torch oracle) and one rounding back.
#pragma once

#include <cuda_bf16.h>

#include "common/kernels/common.cuh"

namespace deepep_portable {

// acc[e] += the 8 bf16 of v, element by element.
DEEPEP_DEVICE void add_bf16x8(float (&acc)[8], const int4& v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
    }
}

// 8 floats rounded to bf16 (nearest even), packed in one 16-byte word.
DEEPEP_DEVICE int4 pack_bf16x8(const float (&acc)[8]) {
    int4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return v;
}

}  // namespace deepep_portable
