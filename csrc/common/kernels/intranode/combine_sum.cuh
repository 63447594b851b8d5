// What both intranode combine forms share (combine.cu: stage, then pull; combine_streamed.cu: stage and
// pull in one launch): the parameters, and the sum of one of my tokens over the ranks it was sent to.
//
// The sum is in float32 in a fixed order: 0, + bias_0, + bias_1, + rows of ranks 0..R-1. Plain adds (no
// multiply, so no FMA contraction): bit-identical to the torch oracle.
//
// Compile-time (-D): NUM_RANKS, HIDDEN (bf16 elements, multiple of 8), NUM_TOPK (0 for none).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/kernels/bf16.cuh"
#include "common/kernels/common.cuh"
#include "common/kernels/intranode/protocol.cuh"
#include "common/kernels/signal.cuh"

#ifndef NUM_RANKS
#error "the intranode combine needs -DNUM_RANKS"
#endif
#ifndef HIDDEN
#error "the intranode combine needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "the intranode combine needs -DNUM_TOPK (0 for none)"
#endif

namespace deepep_portable::intranode {

constexpr int kNumRanks = NUM_RANKS;
constexpr int kHiddenInt4 = HIDDEN / 8;   // 8 bf16 per 16-byte word
constexpr int kNumTopk = NUM_TOPK;
static_assert(HIDDEN % 8 == 0, "hidden must be a multiple of 8 bf16");
constexpr int kRankGroup = kNumRanks < 8 ? kNumRanks : 8;   // ranks read together
constexpr int kColumns = kRankGroup >= 8 ? 2 : (kRankGroup >= 4 ? 3 : 4);   // columns per lane at a time (fits registers)
constexpr int kTopkPerLane = (kNumTopk + 31) / 32;

}  // namespace deepep_portable::intranode

struct CombineParams {
    const uint64_t* peer_bases;
    int64_t rank;
    deepep_portable::intranode::ControlLayout ctrl;
    int64_t send_area_offset;        // the expert outputs: [rows, HIDDEN] bf16, contiguous
    int64_t weights_area_offset;     // their top-k weights: [rows, NUM_TOPK] f32, contiguous
    // stage inputs
    const int4* x;                   // [num_rows, HIDDEN] bf16: the rows this rank received; null: already
                                     // in my send area (written there by the caller, zero-copy)
    const float* topk_weights;       // [num_rows, NUM_TOPK], or null
    const int* num_rows;             // device count of real rows (padding rows are not staged)
    // pull
    const int* send_rows;            // [num_tokens, R]: row of my token at rank r, -1 = not sent
    const int4* bias_0;              // [num_tokens, HIDDEN] bf16, or null
    const int4* bias_1;
    int4* out;                       // [num_tokens, HIDDEN] bf16
    float* out_topk_weights;         // [num_tokens, NUM_TOPK], or null
    int64_t num_tokens;
    // streamed form only (combine_streamed.cu)
    const int* recv_src_idx;         // [num_rows]: the source's token index of each row I received
    const int* rank_prefix_matrix;   // [R, R]: [s][r] = rows rank r received from ranks 0..s
    int* row_of;                     // scratch [R, capacity]: my row holding source s's token b (-1: none)
    int64_t flags_offset;            // my staged-row flags: u32 [R, capacity], [s][b] = 1 once staged
    int64_t capacity;                // tokens per rank the buffer holds (every source's token count is below)
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
};

namespace deepep_portable::intranode {

DEEPEP_DEVICE PeerBuffers bufs_of(const CombineParams& p) {
    return PeerBuffers{p.peer_bases, static_cast<int>(p.rank), kNumRanks};
}

// send_rows[t][lane] for lanes < R (ranks beyond 32 are read directly by sum_token).
DEEPEP_DEVICE int load_send_row(const CombineParams& p, int64_t t, int lane) {
    return lane < kNumRanks && lane < 32 ? p.send_rows[t * kNumRanks + lane] : -1;
}

// One warp: out[t] = the sum of my token t's rows at the ranks it went to (my_row: lane r holds its row
// at rank r, -1 = not sent), and its top-k weights likewise.
DEEPEP_DEVICE void sum_token(const CombineParams& p, const PeerBuffers& bufs, int64_t t, int my_row, int lane) {
    const int4* src[kNumRanks];
    int rows_at[kNumRanks];
#pragma unroll
    for (int r = 0; r < kNumRanks; ++r) {
        const int row = kNumRanks <= 32 ? __shfl_sync(0xffffffffu, my_row, r) : p.send_rows[t * kNumRanks + r];
        rows_at[r] = row;
        src[r] = row >= 0 ? bufs.at<const int4>(r, p.send_area_offset) + static_cast<int64_t>(row) * kHiddenInt4
                          : nullptr;
    }
    // kColumns 16-byte columns per lane at a time, each read from a group of ranks: up to 16 loads in
    // flight per lane; ranks are still added in ascending order for every element.
    for (int c0 = lane; c0 < kHiddenInt4; c0 += 32 * kColumns) {
        float acc[kColumns][8];
#pragma unroll
        for (int u = 0; u < kColumns; ++u) {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                acc[u][e] = 0.0f;
            const int c = c0 + 32 * u;
            if (c < kHiddenInt4) {
                if (p.bias_0 != nullptr)
                    add_bf16x8(acc[u], p.bias_0[t * kHiddenInt4 + c]);
                if (p.bias_1 != nullptr)
                    add_bf16x8(acc[u], p.bias_1[t * kHiddenInt4 + c]);
            }
        }
#pragma unroll
        for (int r0 = 0; r0 < kNumRanks; r0 += kRankGroup) {
            int4 v[kRankGroup][kColumns];
#pragma unroll
            for (int g = 0; g < kRankGroup; ++g)
#pragma unroll
                for (int u = 0; u < kColumns; ++u)
                    if (r0 + g < kNumRanks && src[r0 + g] != nullptr && c0 + 32 * u < kHiddenInt4)
                        v[g][u] = src[r0 + g][c0 + 32 * u];
#pragma unroll
            for (int g = 0; g < kRankGroup; ++g)
#pragma unroll
                for (int u = 0; u < kColumns; ++u)
                    if (r0 + g < kNumRanks && src[r0 + g] != nullptr && c0 + 32 * u < kHiddenInt4)
                        add_bf16x8(acc[u], v[g][u]);
        }
#pragma unroll
        for (int u = 0; u < kColumns; ++u)
            if (c0 + 32 * u < kHiddenInt4)
                p.out[t * kHiddenInt4 + c0 + 32 * u] = pack_bf16x8(acc[u]);
    }
    if constexpr (kNumTopk > 0) {
        if (p.out_topk_weights != nullptr) {
            for (int k = lane; k < kNumTopk; k += 32) {
                float w = 0.0f;
#pragma unroll
                for (int r = 0; r < kNumRanks; ++r)
                    if (rows_at[r] >= 0)
                        w = __fadd_rn(w, bufs.at<const float>(r, p.weights_area_offset)[
                                             static_cast<int64_t>(rows_at[r]) * kNumTopk + k]);
                p.out_topk_weights[t * kNumTopk + k] = w;
            }
        }
    }
}

}  // namespace deepep_portable::intranode
