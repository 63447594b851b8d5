// Intranode combine, pull-based (see protocol.cuh for the round protocol).
//
// My send area holds, for the combine, two arrays: the expert outputs [rows, HIDDEN] bf16 (row i =
// the i-th row I received in the dispatch) and after them their top-k weights [rows, NUM_TOPK] f32.
//   stage_expert_rows: copy the rows I received in the dispatch (now expert outputs) and their top-k
//                      weights once into my send area (the rows only when x is not already there:
//                      x == nullptr, a zero-copy combine whose round open_round.cu opened for
//                      Buffer.get_next_combine_buffer; begin_round runs again at no cost). The rows
//                      I received from myself are not staged when x is given: only I read them, and
//                      I read them from x (an eighth of the stage's bytes at 8 ranks, top-8 of 256).
//   combine:           for each of my tokens, read its row from every rank it was sent to (row index
//                      from the dispatch handle; my own row from x when x is given) and sum in float32
//                      in a fixed order: 0, + bias_0, + bias_1, + rows of ranks 0..R-1. Plain adds (no
//                      multiply, so no FMA contraction): bit-identical to the torch oracle. Warps
//                      draw tokens from a counter (issue_draw, protocol.cuh).
//
// Compile-time (-D): NUM_RANKS, HIDDEN (bf16 elements, multiple of 8), NUM_TOPK (0 for none).
#include <cuda_bf16.h>

#include <cstdint>

#include "common/kernels/bf16.cuh"
#include "common/kernels/common.cuh"
#include "common/kernels/intranode/protocol.cuh"
#include "common/kernels/signal.cuh"

#ifndef NUM_RANKS
#error "intranode/combine.cu needs -DNUM_RANKS"
#endif
#ifndef HIDDEN
#error "intranode/combine.cu needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "intranode/combine.cu needs -DNUM_TOPK (0 for none)"
#endif

using namespace deepep_portable;
using namespace deepep_portable::intranode;

namespace {
constexpr int kNumRanks = NUM_RANKS;
constexpr int kHiddenInt4 = HIDDEN / 8;   // 8 bf16 per 16-byte word
constexpr int kNumTopk = NUM_TOPK;
static_assert(HIDDEN % 8 == 0, "hidden must be a multiple of 8 bf16");
constexpr int kRankGroup = kNumRanks < 8 ? kNumRanks : 8;   // ranks read together
constexpr int kColumns = kRankGroup >= 8 ? 2 : (kRankGroup >= 4 ? 3 : 4);   // columns per lane at a time (fits registers)
constexpr int kTopkPerLane = (kNumTopk + 31) / 32;
}  // namespace

struct CombineParams {
    const uint64_t* peer_bases;
    int64_t rank;
    ControlLayout ctrl;
    int64_t send_area_offset;        // the expert outputs: [rows, HIDDEN] bf16, contiguous
    int64_t weights_area_offset;     // their top-k weights: [rows, NUM_TOPK] f32, contiguous
    // stage inputs
    const int4* x;                   // [x_rows, HIDDEN] bf16: the rows this rank received; null: already
                                     // in my send area (written there by the caller, zero-copy)
    const float* topk_weights;       // [x_rows, NUM_TOPK], or null
    int64_t x_rows;                  // rows of x (the handle's num_recv_rows): no row past them is read in x or
                                     // topk_weights, even when the dispatch overflowed num_worst_tokens
    const int* rank_prefix_matrix;   // [R, R]: [i][j] = tokens ranks 0..i sent rank j (the dispatch handle's):
                                     // my rows are [0, [R-1][me]), those from source s start at [s-1][me]
    // pull
    const int* send_rows;            // [num_tokens, R]: row of my token at rank r, -1 = not sent
    const int4* bias_0;              // [num_tokens, HIDDEN] bf16, or null
    const int4* bias_1;
    int4* out;                       // [num_tokens, HIDDEN] bf16
    float* out_topk_weights;         // [num_tokens, NUM_TOPK], or null
    int64_t num_tokens;
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
};

namespace {

DEEPEP_DEVICE PeerBuffers bufs_of(const CombineParams& p) {
    return PeerBuffers{p.peer_bases, static_cast<int>(p.rank), kNumRanks};
}

// My received rows from source s start at row_begin(p, s) (s = R: the count of real rows; padding rows,
// past it, are neither staged nor read).
DEEPEP_DEVICE int row_begin(const CombineParams& p, int s) {
    return s == 0 ? 0 : p.rank_prefix_matrix[(s - 1) * kNumRanks + p.rank];
}

// Whether the pull reads rank r's rows in x: my own rows when x is given (only I read them, so they are not staged).
DEEPEP_DEVICE bool reads_in_x(const CombineParams& p, const PeerBuffers& bufs, int r) {
    return r == bufs.rank && p.x != nullptr;
}

// send_rows[t][lane] for lanes < R (ranks beyond 32 are read directly by the caller).
DEEPEP_DEVICE int load_send_row(const CombineParams& p, int64_t t, int lane) {
    return lane < kNumRanks && lane < 32 ? p.send_rows[t * kNumRanks + lane] : -1;
}

// One token of the pull: `my_row` holds, in lane r < R, the token's row at rank r (-1: not sent there).
DEEPEP_DEVICE void combine_token(const CombineParams& p, const PeerBuffers& bufs, int64_t t, int my_row, int lane) {
    const int4* src[kNumRanks];
    int rows_at[kNumRanks];
#pragma unroll
    for (int r = 0; r < kNumRanks; ++r) {
        const int row = kNumRanks <= 32 ? __shfl_sync(0xffffffffu, my_row, r) : p.send_rows[t * kNumRanks + r];
        // one past x's rows exists only after a num_worst_tokens overflow (reported)
        const bool in_x = reads_in_x(p, bufs, r);
        rows_at[r] = in_x && row >= p.x_rows ? -1 : row;
        const int4* rows = in_x ? p.x : bufs.at<const int4>(r, p.send_area_offset);
        src[r] = rows_at[r] >= 0 ? rows + static_cast<int64_t>(rows_at[r]) * kHiddenInt4 : nullptr;
    }
    // kColumns 16-byte columns per lane at a time, each read from a group of ranks: up to 16
    // loads in flight per lane; ranks are still added in ascending order for every element.
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
                for (int r = 0; r < kNumRanks; ++r) {
                    const float* weights = reads_in_x(p, bufs, r) ? p.topk_weights
                                                            : bufs.at<const float>(r, p.weights_area_offset);
                    if (rows_at[r] >= 0)
                        w = __fadd_rn(w, weights[static_cast<int64_t>(rows_at[r]) * kNumTopk + k]);
                }
                p.out_topk_weights[t * kNumTopk + k] = w;
            }
        }
    }
}

}  // namespace

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) stage_expert_rows(const __grid_constant__ CombineParams p) {
    const PeerBuffers bufs = bufs_of(p);
    const uint64_t n = begin_round(bufs, p.ctrl, p.timeout_ns,
                                   ErrorSink{p.error_claim, p.error_host, kOpCombine, static_cast<int>(p.rank)});
    if (n == 0)
        return;
    int4* rows = bufs.at<int4>(bufs.rank, p.send_area_offset);
    float* weights = bufs.at<float>(bufs.rank, p.weights_area_offset);
    const int num_rows = min(static_cast<int64_t>(row_begin(p, kNumRanks)), p.x_rows);
    const bool has_weights = kNumTopk > 0 && p.topk_weights != nullptr;
    if (p.x == nullptr && !has_weights)
        return;   // zero-copy and no weights: nothing to stage
    // With x given, my rows from myself [own_begin, own_begin + own) are skipped: combine reads them in x.
    const int own_begin = min(row_begin(p, static_cast<int>(p.rank)), num_rows);
    const int own = p.x == nullptr ? 0 : min(row_begin(p, static_cast<int>(p.rank) + 1), num_rows) - own_begin;
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    for (int64_t j = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; j < num_rows - own; j += warps) {
        const int64_t i = j < own_begin ? j : j + own;
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
    // Tokens come from my TOKEN_TICKET (protocol.cuh), not a grid stride: a token's cost is the number of
    // ranks it went to (1-8 rows), so fixed shares of 16 tokens a warp differ by several rows and the
    // grid's last sweep runs on the unlucky warps alone. The draw and the token's rows (lanes r < R load
    // send_rows[t][r], one coalesced load) are both issued one token ahead, behind the current token's reads.
    const int lane = threadIdx.x % 32;
    unsigned int* ticket = bufs.at<unsigned int>(bufs.rank, p.ctrl.token_ticket);
    int64_t t = take_draw(ticket, issue_draw(ticket, lane), p.num_tokens, lane);
    int my_row = t < p.num_tokens ? load_send_row(p, t, lane) : -1;
    unsigned int pending = t < p.num_tokens ? issue_draw(ticket, lane) : 0u;
    while (t < p.num_tokens) {
        const int64_t next = take_draw(ticket, pending, p.num_tokens, lane);
        const int next_row = next < p.num_tokens ? load_send_row(p, next, lane) : -1;
        if (next < p.num_tokens)
            pending = issue_draw(ticket, lane);
        combine_token(p, bufs, t, my_row, lane);
        t = next;
        my_row = next_row;
    }
    end_round(bufs, p.ctrl, n);
}

}  // namespace deepep_portable::intranode
