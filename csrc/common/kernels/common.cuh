// Small helpers shared by every kernel family.
//
// Conventions (see deepep_portable/jit.py and engines/launch.py):
//  * sources are compiled with -I<csrc>, so include shared headers as "common/kernels/...";
//  * compile-time parameters arrive as -D macros (NUM_RANKS, NUM_TOPK, ...); a kernel turns
//    each into a constexpr, after `#ifndef NUM_RANKS / #error ...` so a missing one is named;
//  * each kernel is `extern "C" __global__ void name(const __grid_constant__ Params p)` with one
//    plain struct parameter whose host mirror is a ctypes.Structure (same field order, pointers
//    as 64-bit integers, explicit widths).
#pragma once

#include <cstdint>

#define DEEPEP_DEVICE __device__ __forceinline__
#define DEEPEP_HOST_DEVICE __host__ __device__ __forceinline__

namespace deepep_portable {

template <typename T>
DEEPEP_HOST_DEVICE constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

template <typename T>
DEEPEP_HOST_DEVICE constexpr T align_up(T a, T b) {
    return ceil_div(a, b) * b;
}

}  // namespace deepep_portable
