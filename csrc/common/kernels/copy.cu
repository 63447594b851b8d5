// The benchmark's ceilings: one plain pass over the bytes (16-byte loads and stores, grid-stride),
// launched with the same number of blocks as the kernel it is compared with.
//   copy_int4:     one span, src -> dst on this device.
//   copy_segments: the op's traffic pattern: span s of this rank's source goes to dst[s], which may
//                  be a peer's memory mapped over CUDA IPC (NVLink between GPUs), all in one launch.
#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/signal.cuh"

// Every block walks the span grid-stride; four loads in flight per thread.
__device__ __forceinline__ void copy_span(const int4* src, int4* dst, int64_t num_int4) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < num_int4; i += 4 * stride) {
        const int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < num_int4; i += stride)
        dst[i] = src[i];
}

struct CopyParams {
    const int4* src;
    int4* dst;
    int64_t num_int4;
};

namespace deepep_portable::bench {

__global__ void __launch_bounds__(256) copy_int4(const __grid_constant__ CopyParams p) {
    copy_span(p.src, p.dst, p.num_int4);
}

}  // namespace deepep_portable::bench

struct CopySegmentsParams {
    const int4* src;             // this rank's source, the segments back to back
    const uint64_t* dst;         // [num_segments] destination addresses (device array)
    const int64_t* num_int4;     // [num_segments] lengths in 16-byte units (device array)
    int32_t num_segments;
};

// No block waits for another, so segments need no synchronization: a block that finishes its share
// of one segment moves on to its share of the next.
namespace deepep_portable::bench {

__global__ void __launch_bounds__(256) copy_segments(const __grid_constant__ CopySegmentsParams p) {
    const int4* src = p.src;
    for (int s = 0; s < p.num_segments; ++s) {
        const int64_t n = p.num_int4[s];
        copy_span(src, reinterpret_cast<int4*>(p.dst[s]), n);
        src += n;
    }
}

}  // namespace deepep_portable::bench

// The benchmark's GPU start line: every rank's stream runs this one-thread kernel before a timed
// sample, so the sample starts on every GPU stream at (nearly) the same moment instead of when each
// host left its barrier (host exit skew otherwise lands in the op's time: a rank that starts early
// waits inside its first call for the late ones). Each rank adds 1 to one shared counter (rank 0's
// word, mapped over CUDA IPC) and spins until it reaches `target` = ranks x crossings so far. A
// bounded wait: past the deadline the kernel sets *timed_out and returns (the bench then raises).
struct StartLineParams {
    unsigned long long* counter;   // rank 0's word, mapped here
    uint64_t target;
    int* timed_out;                // host-mapped word of this rank
    uint64_t timeout_ns;
    uint64_t* released;            // host-mapped: globaltimer when this rank's line opened (traces compare to it)
};

namespace deepep_portable::bench {

__global__ void start_line(const __grid_constant__ StartLineParams p) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    atomicAdd_system(p.counter, 1ull);
    const uint64_t deadline = deepep_portable::globaltimer_ns() + p.timeout_ns;
    while (deepep_portable::ld_acquire_sys(reinterpret_cast<const uint64_t*>(p.counter)) < p.target) {
        if (deepep_portable::globaltimer_ns() > deadline) {
            *p.timed_out = 1;
            return;
        }
    }
    *p.released = deepep_portable::globaltimer_ns();
}

}  // namespace deepep_portable::bench
