// Small helpers shared by every kernel family.
//
// Conventions (see deepep_portable/jit.py and engines/launch.py):
//  * sources are compiled with -I<csrc>, so include shared headers as "common/kernels/...";
//  * compile-time parameters arrive as -D macros (NUM_RANKS, NUM_TOPK, ...); a kernel turns
//    each into a constexpr, after `#ifndef NUM_RANKS / #error ...` so a missing one is named;
//  * each kernel is `__global__ void name(const __grid_constant__ Params p)` in a namespace under
//    `deepep_portable::` (so a profiler table says whose kernel it is; the host looks it up by its
//    mangled name, jit.kernel_symbol), with one plain struct parameter declared at global scope whose
//    host mirror is a ctypes.Structure (same field order, pointers as 64-bit integers, explicit widths).
//    Only the kernel that does an op's data movement carries the op's name (`dispatch`, `combine`):
//    users and DeepEP's tests find it in a profile by that word.
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
