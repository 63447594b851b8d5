// The benchmark's ceiling: one plain pass over the bytes (16-byte loads and stores, grid-stride),
// launched with the same number of blocks as the kernel it is compared with.
#include <cstdint>

#include "common/kernels/common.cuh"

struct CopyParams {
    const int4* src;
    int4* dst;
    int64_t num_int4;
};

extern "C" __global__ void __launch_bounds__(256) copy_int4(const __grid_constant__ CopyParams p) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < p.num_int4; i += 4 * stride) {   // four loads in flight per thread
        const int4 a = p.src[i], b = p.src[i + stride], c = p.src[i + 2 * stride], d = p.src[i + 3 * stride];
        p.dst[i] = a;
        p.dst[i + stride] = b;
        p.dst[i + 2 * stride] = c;
        p.dst[i + 3 * stride] = d;
    }
    for (; i < p.num_int4; i += stride)
        p.dst[i] = p.src[i];
}
