// A block-wide running count in thread order, one step of blockDim.x items at a time: how the dispatch
// kernels turn a token mask column into send positions (the k-th token of the column gets position k).
#pragma once

#include "common/kernels/common.cuh"

namespace deepep_portable {

// Every thread of the block calls this with its item's flag (it synchronizes the block twice). Returns how
// many flagged items come before mine: those of earlier steps (`carry`) and of lower threads in this step;
// adds this step's flagged items to `carry`. Within a warp by ballot + popc, warp totals through shared memory.
template <int kWarps>
DEEPEP_DEVICE int block_running_count(bool flag, int& carry) {
    __shared__ int warp_total[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned int ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0)
        warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = carry, step_total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        before += w < warp ? warp_total[w] : 0;
        step_total += warp_total[w];
    }
    carry += step_total;
    __syncthreads();   // warp_total is rewritten by the next step
    return before + __popc(ballot & ((1u << lane) - 1u));
}

}  // namespace deepep_portable
