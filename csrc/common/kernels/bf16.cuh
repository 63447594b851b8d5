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

// acc[u] += row r's 16-byte column c0 + 32 u (u < kColumns, columns < kWords) for r = 0 .. num_rows - 1 in
// order, row_of(r) giving the row (nullptr: skipped). The loads of kGroup rows x kColumns columns are issued
// before their adds, so a lane has up to kGroup * kColumns loads in flight, while every element still adds
// its rows in ascending order (bit-exact against the oracle's order).
template <int kWords, int kColumns, int kGroup, typename RowOf>
DEEPEP_DEVICE void add_rows_bf16(float (&acc)[kColumns][8], int num_rows, const RowOf& row_of, int c0) {
#pragma unroll 1
    for (int r0 = 0; r0 < num_rows; r0 += kGroup) {
        const int4* rows[kGroup];
        int4 v[kGroup][kColumns];
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
            rows[g] = r0 + g < num_rows ? row_of(r0 + g) : nullptr;
#pragma unroll
            for (int u = 0; u < kColumns; ++u)
                if (rows[g] != nullptr && c0 + 32 * u < kWords)
                    v[g][u] = rows[g][c0 + 32 * u];
        }
#pragma unroll
        for (int g = 0; g < kGroup; ++g)
#pragma unroll
            for (int u = 0; u < kColumns; ++u)
                if (rows[g] != nullptr && c0 + 32 * u < kWords)
                    add_bf16x8(acc[u], v[g][u]);
    }
}

}  // namespace deepep_portable
