// The internode dispatch's slot layout and kernel parameters (one struct for its four kernels), shared by
// dispatch.cu and the host mirror's checks (tests/test_mirrors.py).
//
// Compile-time (-D): NUM_RANKS, RANKS_PER_NODE (protocol.cuh), HIDDEN_BYTES (payload bytes per token,
// multiple of 16), NUM_SCALES (4-byte scale words, 0 for BF16), NUM_TOPK (0: no top-k, e.g. a cached dispatch).
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/internode/protocol.cuh"

#ifndef HIDDEN_BYTES
#error "internode/dispatch.cu needs -DHIDDEN_BYTES"
#endif
#ifndef NUM_SCALES
#error "internode/dispatch.cu needs -DNUM_SCALES (4-byte scale words per token, 0 for none)"
#endif
#ifndef NUM_TOPK
#error "internode/dispatch.cu needs -DNUM_TOPK (0 for none)"
#endif

namespace deepep_portable::internode {

// A landing slot: body (payload | scales | top-k ids as int32 | top-k weights) | meta (int32 [P]
// positions of the token among the source's tokens to each rank of the node, -1 = not sent; source
// token). Host mirror: internode_layout.InternodeDispatchLayout (tests/test_mirrors.py checks these constants).
constexpr int64_t kHiddenBytes = HIDDEN_BYTES;
constexpr int kNumScales = NUM_SCALES;
constexpr int kNumTopk = NUM_TOPK;
constexpr int64_t kScalesAt = align_up<int64_t>(kHiddenBytes, 16);
constexpr int64_t kTopkIdxAt = kScalesAt + align_up<int64_t>(4 * kNumScales, 16);
constexpr int64_t kTopkWeightsAt = kTopkIdxAt + align_up<int64_t>(4 * kNumTopk, 16);
constexpr int64_t kBodyBytes = kTopkWeightsAt + align_up<int64_t>(4 * kNumTopk, 16);
constexpr int kMetaWords = kRanksPerNode + 1;
constexpr int64_t kMetaBytes = align_up<int64_t>(4 * kMetaWords, 16);
constexpr int64_t kSlotBytes = kBodyBytes + kMetaBytes;
static_assert(kHiddenBytes % 16 == 0, "payload rows must be 16-byte multiples");
static_assert(kNumTopk >= 0 && kNumTopk <= 128, "bad top-k");

}  // namespace deepep_portable::internode

// All fields 64-bit words after `common`, so the ctypes mirror (engines/internode.py) needs no padding rules.
struct InternodeDispatchParams {
    deepep_portable::internode::Common common;
    int64_t landing_offset;         // [M][N] slots (network destination)
    int64_t staging_offset;         // [N] bodies (my rows, a put's source)
    int64_t meta_staging_offset;    // [N][M] metas (a put's source)
    int64_t num_experts;
    int64_t expert_alignment;
    // inputs
    const int4* x;                  // [T, HIDDEN_BYTES]
    const int* x_scales;            // [T, NUM_SCALES] 4-byte words, any strides, or null
    int64_t scale_token_stride;
    int64_t scale_hidden_stride;
    const int64_t* topk_idx;        // [T, NUM_TOPK] global expert ids (-1: none), or null
    const float* topk_weights;      // [T, NUM_TOPK], or null
    const bool* is_token_in_rank;   // [T, R]
    const int* num_tokens_per_expert;  // [num_experts], or null (cached dispatch)
    int64_t num_tokens;             // T
    int64_t call_tokens;            // my tokens in the whole call: T, or more when the call runs in rounds of T
    // handle outputs
    int* send_pos;                  // [T, R]: index of token t among my tokens to rank r, -1 = not sent
    int* node_pos;                  // [T, M]: index of token t among my tokens to node m, -1 = none there
    int* chunk_end;                 // [chunks(T), M]: my tokens to node m through the end of chunk k
    int* rank_prefix_matrix;        // [R, R]: [i][j] = rows ranks 0..i send to rank j
    int* num_recv_out;              // [1]
    int* landed_meta;               // [M, N, P + 1]: the meta of every slot that landed here
    int64_t* landed_range;          // [M, kMaxChunks]: (lo << 32) | hi of each chunk that landed here
    int* landed_chunks;             // [M]: chunks of the source of each node whose tokens land here
    int* send_rows;                 // [T, R]: row of my token t at rank r, -1 = not sent (or null)
    int* host_out;                  // mapped: [0] ready, [1] receive count, [2] the most call_tokens of any
                                    // rank, [3..] expert counts (or null)
    // receive outputs
    int4* recv_x;                   // [max_recv_rows, HIDDEN_BYTES]
    int* recv_scales;               // [max_recv_rows, NUM_SCALES], or null
    int64_t* recv_topk_idx;         // [max_recv_rows, NUM_TOPK] local expert ids (-1 elsewhere), or null
    float* recv_topk_weights;       // [max_recv_rows, NUM_TOPK]
    int* recv_src_idx;              // [max_recv_rows]: source token (-1: padding)
    int64_t max_recv_rows;          // the outputs' rows; 0 in the first kernels when the host learns them
};
