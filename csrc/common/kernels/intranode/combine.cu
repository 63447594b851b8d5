// Intranode combine, pull-based (see protocol.cuh for the round protocol).
//
// My send area holds, for the combine, two arrays: the expert outputs [rows, HIDDEN] bf16 (row i =
// the i-th row I received in the dispatch) and after them their top-k weights [rows, NUM_TOPK] f32.
//   stage_expert_rows: copy the rows I received in the dispatch (now expert outputs) and their top-k
//                      weights once into my send area (the rows only when x is not already there:
//                      x == nullptr, a zero-copy combine whose round open_round.cu opened for
//                      Buffer.get_next_combine_buffer; begin_round runs again at no cost).
//   combine:           for each of my tokens, read its row from every rank it was sent to (row index
//                      from the dispatch handle) and sum them (combine_sum.cuh: sum_token).
// Every combine runs both in one launch instead (combine_streamed.cu) unless DEEPEP_PORTABLE_STREAMED_COMBINE=0,
// or when a CUDA graph captures it before any eager combine of its size (the same on every rank).
//
// Compile-time (-D): NUM_RANKS, HIDDEN (bf16 elements, multiple of 8), NUM_TOPK (0 for none).
#include <cstdint>

#include "common/kernels/intranode/combine_sum.cuh"

using namespace deepep_portable;
using namespace deepep_portable::intranode;

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) stage_expert_rows(const __grid_constant__ CombineParams p) {
    const PeerBuffers bufs = bufs_of(p);
    const uint64_t n = begin_round(bufs, p.ctrl, p.timeout_ns,
                                   ErrorSink{p.error_claim, p.error_host, kOpCombine, static_cast<int>(p.rank)});
    if (n == 0)
        return;
    int4* rows = bufs.at<int4>(bufs.rank, p.send_area_offset);
    float* weights = bufs.at<float>(bufs.rank, p.weights_area_offset);
    const int num_rows = *p.num_rows;
    const bool has_weights = kNumTopk > 0 && p.topk_weights != nullptr;
    if (p.x == nullptr && !has_weights)
        return;   // zero-copy and no weights: nothing to stage
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    for (int64_t i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < num_rows; i += warps) {
        RowCopy<kHiddenInt4> row;
        const int4* src = p.x == nullptr ? nullptr : p.x + i * kHiddenInt4;
        if (src != nullptr)
            row.load(src, 0, lane);
        float weight[kTopkPerLane > 0 ? kTopkPerLane : 1];
#pragma unroll
        for (int u = 0; u < kTopkPerLane; ++u)
            if (has_weights && lane + 32 * u < kNumTopk)
                weight[u] = p.topk_weights[i * kNumTopk + lane + 32 * u];
        if (src != nullptr) {
            row.store(rows + i * kHiddenInt4, 0, lane);
            row.copy_rest(rows + i * kHiddenInt4, src, lane);
        }
#pragma unroll
        for (int u = 0; u < kTopkPerLane; ++u)
            if (has_weights && lane + 32 * u < kNumTopk)
                weights[i * kNumTopk + lane + 32 * u] = weight[u];
    }
}

}  // namespace deepep_portable::intranode

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) combine(const __grid_constant__ CombineParams p) {
    const PeerBuffers bufs = bufs_of(p);
    const uint64_t n = await_peers_ready(bufs, p.ctrl, p.timeout_ns,
                                         ErrorSink{p.error_claim, p.error_host, kOpCombine, static_cast<int>(p.rank)});
    if (n == 0)
        return;
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int64_t first = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    // Where a token sits on each rank: lanes r < R load send_rows[t][r] together (one coalesced load,
    // issued one token ahead so its latency hides behind the previous token's rows).
    int next_row = first < p.num_tokens ? load_send_row(p, first, lane) : -1;
    for (int64_t t = first; t < p.num_tokens; t += warps) {
        const int my_row = next_row;
        if (t + warps < p.num_tokens)
            next_row = load_send_row(p, t + warps, lane);
        sum_token(p, bufs, t, my_row, lane);
    }
    end_round(bufs, p.ctrl, n);
}

}  // namespace deepep_portable::intranode
