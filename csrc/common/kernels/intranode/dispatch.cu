// Intranode dispatch, pull-based (see protocol.cuh for the round protocol).
//
//   stage_tokens:              copy my tokens once into my send area (payload rows, and each token's
//                              meta slot: scales, top-k; warps draw tokens from a counter, see
//                              issue_draw); the meta slots alone when x is already there (x == nullptr:
//                              a zero-copy dispatch, its round opened by open_round.cu for
//                              Buffer.get_next_dispatch_buffer; see stage_meta),
//                              write the per-destination send lists and my counts. The send
//                              positions (index of token t among my tokens for rank r) are scanned
//                              here, one block per destination rank, while the other warps copy rows.
//                              With host_out, block 0 first publishes my counts, waits for every
//                              peer's, and reports my receive count to the host, so the host
//                              allocates the outputs and launches the pull while the copy runs.
//   dispatch:                  wait for every peer's READY, derive the receive layout from the
//                              peers' counts (rows ordered by source rank, then source token),
//                              and copy my rows straight from the peers' send areas into recv_x;
//                              it also writes the handle's send_rows (where each of my tokens lands).
//
// Compile-time (-D): NUM_RANKS, HIDDEN_BYTES (payload bytes per token, multiple of 16),
// NUM_TOPK (0 when the call has no top-k), NUM_SCALES (0 for BF16). Everything else is a run-time
// parameter.
#include <cstdint>

#include "common/kernels/block_scan.cuh"
#include "common/kernels/common.cuh"
#include "common/kernels/intranode/protocol.cuh"
#include "common/kernels/signal.cuh"

#ifndef NUM_RANKS
#error "intranode/dispatch.cu needs -DNUM_RANKS"
#endif
#ifndef HIDDEN_BYTES
#error "intranode/dispatch.cu needs -DHIDDEN_BYTES"
#endif
#ifndef NUM_TOPK
#error "intranode/dispatch.cu needs -DNUM_TOPK (0 for none)"
#endif
#ifndef NUM_SCALES
#error "intranode/dispatch.cu needs -DNUM_SCALES (4-byte scale words per token, 0 for none)"
#endif

using namespace deepep_portable;
using namespace deepep_portable::intranode;

namespace {
constexpr int kNumRanks = NUM_RANKS;
constexpr int kHiddenInt4 = HIDDEN_BYTES / 16;
constexpr int kNumTopk = NUM_TOPK;
constexpr int kNumScales = NUM_SCALES;
constexpr int kScalesPerLane = (kNumScales + 31) / 32;
constexpr int kTopkPerLane = (kNumTopk + 31) / 32;
// Rows a warp of the pull kernel takes at a time; the chunks are strided over the warps, so the
// grid works in a window of warps * kPullRows rows of the output at a time. Swept on the H200
// emulation (8 ranks, 16 blocks, 4096 / 16384 tokens): 8 rows pulled in 909 / 3936 us, 16 in
// 892 / 4015, 32 in 967 / 4233; an even contiguous split per warp was slower still (PERFORMANCE.md).
constexpr int kPullRows = 8;
static_assert(kPullRows >= 1 && kPullRows <= 32, "a lane resolves one row of a chunk");
static_assert(HIDDEN_BYTES % 16 == 0, "payload rows must be 16-byte multiples");
static_assert(kNumRanks >= 1 && kNumTopk >= 0 && kNumTopk <= 128, "bad compile-time shape");
}  // namespace

// All fields 64-bit so the ctypes mirror (deepep_portable/engines/intranode.py) needs no padding rules.
struct DispatchParams {
    const uint64_t* peer_bases;
    int64_t rank;
    ControlLayout ctrl;
    int64_t send_list_offset;       // int32 [R][capacity]
    int64_t rows_offset;            // payload rows [capacity, HIDDEN_BYTES], contiguous (layout.py)
    int64_t meta_offset;            // meta slots [capacity, meta_bytes]
    int64_t meta_bytes;
    int64_t capacity;               // send-list stride (tokens)
    int64_t scales_offset;          // byte offsets inside a meta slot
    int64_t topk_idx_offset;
    int64_t topk_weights_offset;
    // stage inputs
    const int4* x;                  // [num_tokens, HIDDEN_BYTES], or null: already in my payload rows
    const int* x_scales;            // [num_tokens, num_scales] (4-byte words, any strides), or null
    const int64_t* topk_idx;        // [num_tokens, NUM_TOPK] global expert ids, or null
    const float* topk_weights;      // [num_tokens, NUM_TOPK], or null
    const bool* is_token_in_rank;   // [num_tokens, R]: the stage kernel scans it into send_pos (null: cached)
    int* send_pos;                  // [num_tokens, R]: index in my send list to rank r, -1 = not sent
                                    // (written by the stage kernel, or given by a cached handle)
    const int* num_tokens_per_rank; // [R]
    const int* num_tokens_per_expert;  // [num_experts], or null (cached dispatch)
    int64_t num_tokens;
    int64_t num_scales;
    int64_t scale_token_stride;     // x_scales strides in elements (e.g. column-major scales, what
    int64_t scale_hidden_stride;    // DeepGEMM consumes: read in place, never copied first)
    int64_t num_experts;
    // pull outputs
    int4* recv_x;                   // [max_recv_rows, HIDDEN_BYTES]
    int* recv_scales;               // [max_recv_rows, num_scales], or null
    int64_t* recv_topk_idx;         // [max_recv_rows, NUM_TOPK] local expert ids, -1 elsewhere
    float* recv_topk_weights;       // [max_recv_rows, NUM_TOPK]
    int* recv_src_idx;              // [max_recv_rows]
    int* rank_prefix_matrix;        // [R, R]: [i][j] = rows ranks 0..i send to rank j (or null)
    int* send_rows;                 // [num_tokens, R]: row of my token t at rank j, -1 = not sent (or null)
    int* num_recv_out;              // [1] (or null)
    int* expert_counts_out;         // [num_experts / R], aligned to expert_alignment (or null)
    int* host_out;                  // stage: mapped [0] = ready flag, [1] = num_recv, [2..] expert counts (or null)
    int64_t max_recv_rows;
    int64_t speculative;            // 1: the outputs' size is the host's guess, made before it knew the count
    int64_t expert_alignment;
    // errors
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
};

namespace {

DEEPEP_DEVICE ErrorSink sink_of(const DispatchParams& p, int op) {
    return ErrorSink{p.error_claim, p.error_host, op, static_cast<int>(p.rank)};
}

DEEPEP_DEVICE PeerBuffers bufs_of(const DispatchParams& p) {
    return PeerBuffers{p.peer_bases, static_cast<int>(p.rank), kNumRanks};
}

constexpr int kWarps = kThreads / 32;

// Send positions for destination ranks blockIdx.x, blockIdx.x + gridDim.x, ...: the k-th of my tokens
// (in source order) that goes to rank r gets slot k of my send list to r (a block-wide scan over the mask
// column, 512 tokens per step).
DEEPEP_DEVICE void scan_send_positions(const DispatchParams& p, int* send_list) {
    for (int r = blockIdx.x; r < kNumRanks; r += gridDim.x) {
        int carry = 0;   // my tokens before this step that go to r
        for (int64_t base = 0; base < p.num_tokens; base += blockDim.x) {
            const int64_t t = base + threadIdx.x;
            const bool sent = t < p.num_tokens && p.is_token_in_rank[t * kNumRanks + r];
            const int pos = block_running_count<kWarps>(sent, carry);
            if (t < p.num_tokens) {
                p.send_pos[t * kNumRanks + r] = sent ? pos : -1;
                if (sent)
                    send_list[r * p.capacity + pos] = static_cast<int>(t);
            }
        }
    }
}

// My local experts' receive counts (summed over sources, aligned to expert_alignment).
DEEPEP_DEVICE int local_expert_count(const DispatchParams& p, const PeerBuffers& bufs, int e) {
    const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
    int count = 0;
    for (int s = 0; s < kNumRanks; ++s)
        count += bufs.at<const volatile int>(s, p.ctrl.expert_count)[bufs.rank * experts_per_rank + e];
    return align_up<int>(count, static_cast<int>(p.expert_alignment));
}

// Block 0 of the stage kernel, after writing my counts: COUNTED = n (release), wait for every
// peer's COUNTED >= n, then hand the host my receive count and expert counts. Peers publish their
// counts before any wait of theirs but begin_round's (which needs only the previous round), so
// this wait cannot deadlock; peers rewrite their counts only in round n+1, whose begin_round
// waits for my DONE = n, given at the end of my pull of round n (after this kernel on my stream).
DEEPEP_DEVICE void notify_host(const DispatchParams& p, const PeerBuffers& bufs, uint64_t n, const ErrorSink& sink) {
    __shared__ int s_ok;
    __syncthreads();   // every thread's count writes precede the release
    if (threadIdx.x == 0) {
        s_ok = 1;
        __threadfence_system();
        st_release_sys(bufs.at<uint64_t>(bufs.rank, p.ctrl.counted), n);
    }
    __syncthreads();
    if (p.host_out == nullptr)
        return;
    const uint64_t deadline = globaltimer_ns() + p.timeout_ns;
    for (int q = threadIdx.x; q < kNumRanks; q += blockDim.x)
        if (!wait_ge(bufs.at<const uint64_t>(q, p.ctrl.counted), n, deadline, sink, q))
            s_ok = 0;
    __syncthreads();
    if (!s_ok)
        return;   // reported; the host raises it
    __threadfence_system();   // the counts are read after the acquires
    volatile int* host = p.host_out;
    const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x)
        host[2 + e] = local_expert_count(p, bufs, e);
    __syncthreads();
    if (threadIdx.x == 0) {
        int num_recv = 0;
        for (int s = 0; s < kNumRanks; ++s)
            num_recv += bufs.at<const volatile int>(s, p.ctrl.count_to)[bufs.rank];
        host[1] = num_recv;
        __threadfence_system();
        host[0] = 1;   // the host reset it to 0 before the launch
        __threadfence_system();
    }
}

// The stage kernel hands my tokens out in tickets (one token each, issue_draw / take_draw in
// protocol.cuh) instead of striding them over the grid: block 0 (which first waits for every peer's
// counts) and the blocks that scan send positions start copying late, and with a fixed share they
// would finish last.

// A zero-copy dispatch's stage (x == nullptr: the payload is in place): the meta slots alone, one 4-byte
// word per thread at a time over the grid, several loads in flight per thread. A warp per token would
// wait one memory round trip per token for a few hundred bytes (the meta-only stage then took 100-190 us
// of the op on the emulation). kMetaWords: scales, top-k ids, top-k weights.
constexpr int kMetaWords = kNumScales + 2 * kNumTopk;
constexpr int kMetaUnroll = 4;

DEEPEP_DEVICE int meta_word(const DispatchParams& p, int64_t t, int w) {
    if (w < kNumScales)
        return p.x_scales[t * p.scale_token_stride + w * p.scale_hidden_stride];
    if (w < kNumScales + kNumTopk)
        return static_cast<int>(p.topk_idx[t * kNumTopk + (w - kNumScales)]);
    return __float_as_int(p.topk_weights[t * kNumTopk + (w - kNumScales - kNumTopk)]);
}

DEEPEP_DEVICE int64_t meta_word_offset(const DispatchParams& p, int w) {
    if (w < kNumScales)
        return p.scales_offset + 4 * w;
    if (w < kNumScales + kNumTopk)
        return p.topk_idx_offset + 4 * (w - kNumScales);
    return p.topk_weights_offset + 4 * (w - kNumScales - kNumTopk);
}

DEEPEP_DEVICE void stage_meta(const DispatchParams& p, char* meta_area, int* send_list, bool scan) {
    // Cached dispatch (or no top-k): only the scales are meta words.
    const int meta_words = kNumTopk > 0 && p.topk_idx != nullptr ? kMetaWords : kNumScales;
    const int64_t total = p.num_tokens * meta_words;
    const int words = meta_words > 0 ? meta_words : 1;   // the divisor (no words: total is 0, nothing runs)
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
         base += stride * kMetaUnroll) {
        int v[kMetaUnroll];
#pragma unroll
        for (int u = 0; u < kMetaUnroll; ++u) {
            const int64_t e = base + u * stride;
            if (e < total)
                v[u] = meta_word(p, e / words, static_cast<int>(e % words));
        }
#pragma unroll
        for (int u = 0; u < kMetaUnroll; ++u) {
            const int64_t e = base + u * stride;
            if (e < total)
                *reinterpret_cast<int*>(meta_area + (e / words) * p.meta_bytes +
                                        meta_word_offset(p, static_cast<int>(e % words))) = v[u];
        }
    }
    if (scan)
        return;
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < p.num_tokens * kNumRanks;
         e += stride) {   // cached dispatch: positions given
        const int pos = p.send_pos[e];
        if (pos >= 0)
            send_list[(e % kNumRanks) * p.capacity + pos] = static_cast<int>(e / kNumRanks);
    }
}

// One warp stages token t: its payload row and its meta slot.
// The row's first chunk is loaded before the meta parts, and stored after them (RowCopy).
DEEPEP_DEVICE void stage_token(const DispatchParams& p, int4* rows, char* meta_area, int* send_list, bool scan,
                               int64_t t, int lane) {
    char* meta = meta_area + t * p.meta_bytes;
    const int4* src = p.x + t * kHiddenInt4;
    RowCopy<kHiddenInt4> row;
    row.load(src, 0, lane);
    int scale[kScalesPerLane > 0 ? kScalesPerLane : 1];
#pragma unroll
    for (int u = 0; u < kScalesPerLane; ++u)
        if (lane + 32 * u < kNumScales)
            scale[u] = p.x_scales[t * p.scale_token_stride + (lane + 32 * u) * p.scale_hidden_stride];
    int id[kTopkPerLane > 0 ? kTopkPerLane : 1];
    float weight[kTopkPerLane > 0 ? kTopkPerLane : 1];
    const bool has_topk = kNumTopk > 0 && p.topk_idx != nullptr;
#pragma unroll
    for (int u = 0; u < kTopkPerLane; ++u)
        if (has_topk && lane + 32 * u < kNumTopk) {
            id[u] = static_cast<int>(p.topk_idx[t * kNumTopk + lane + 32 * u]);
            weight[u] = p.topk_weights[t * kNumTopk + lane + 32 * u];
        }
    row.store(rows + t * kHiddenInt4, 0, lane);
    row.copy_rest(rows + t * kHiddenInt4, src, lane);
#pragma unroll
    for (int u = 0; u < kScalesPerLane; ++u)
        if (lane + 32 * u < kNumScales)
            reinterpret_cast<int*>(meta + p.scales_offset)[lane + 32 * u] = scale[u];
#pragma unroll
    for (int u = 0; u < kTopkPerLane; ++u)
        if (has_topk && lane + 32 * u < kNumTopk) {
            reinterpret_cast<int*>(meta + p.topk_idx_offset)[lane + 32 * u] = id[u];
            reinterpret_cast<float*>(meta + p.topk_weights_offset)[lane + 32 * u] = weight[u];
        }
    for (int r = lane; r < kNumRanks && !scan; r += 32) {   // cached dispatch: positions given
        const int pos = p.send_pos[t * kNumRanks + r];
        if (pos >= 0)
            send_list[r * p.capacity + pos] = static_cast<int>(t);
    }
}

}  // namespace

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) stage_tokens(const __grid_constant__ DispatchParams p) {
    const PeerBuffers bufs = bufs_of(p);
    const ErrorSink sink = sink_of(p, kOpDispatch);
    const uint64_t n = begin_round(bufs, p.ctrl, p.timeout_ns, sink);
    if (n == 0)
        return;
    if (blockIdx.x == 0) {
        int* count_to = bufs.at<int>(bufs.rank, p.ctrl.count_to);
        for (int r = threadIdx.x; r < kNumRanks; r += blockDim.x)
            count_to[r] = p.num_tokens_per_rank[r];
        int* expert_count = bufs.at<int>(bufs.rank, p.ctrl.expert_count);
        for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
            expert_count[e] = p.num_tokens_per_expert != nullptr ? p.num_tokens_per_expert[e] : 0;
        notify_host(p, bufs, n, sink);
    }
    int* send_list = bufs.at<int>(bufs.rank, p.send_list_offset);
    int4* rows = bufs.at<int4>(bufs.rank, p.rows_offset);
    char* meta_area = bufs.at<char>(bufs.rank, p.meta_offset);
    const bool scan = p.is_token_in_rank != nullptr;
    if (scan)
        scan_send_positions(p, send_list);   // after begin_round: no peer reads my send lists any more
    if (p.x == nullptr) {
        stage_meta(p, meta_area, send_list, scan);
        return;
    }
    const int lane = threadIdx.x % 32;
    unsigned int* ticket = bufs.at<unsigned int>(bufs.rank, p.ctrl.token_ticket);
    int64_t t = take_draw(ticket, issue_draw(ticket, lane), p.num_tokens, lane);
    while (t < p.num_tokens) {
        const unsigned int next = issue_draw(ticket, lane);
        stage_token(p, rows, meta_area, send_list, scan, t, lane);
        t = take_draw(ticket, next, p.num_tokens, lane);
    }
}

}  // namespace deepep_portable::intranode

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) dispatch(const __grid_constant__ DispatchParams p) {
    const PeerBuffers bufs = bufs_of(p);
    const ErrorSink sink = sink_of(p, kOpDispatch);
    const uint64_t n = await_peers_ready(bufs, p.ctrl, p.timeout_ns, sink);
    if (n == 0)
        return;
    const int me = bufs.rank;

    // Receive layout: my rows from source s start at src_offset[s].
    __shared__ int src_offset[kNumRanks + 1];
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            src_offset[s] = acc;
            acc += bufs.at<const volatile int>(s, p.ctrl.count_to)[me];
        }
        src_offset[kNumRanks] = acc;
    }
    __syncthreads();
    const int num_recv_all = src_offset[kNumRanks];
    if (p.speculative && num_recv_all > p.max_recv_rows)
        return;   // the host's guess was too small: it pulls again into outputs that fit (the round stays open)
    const int num_recv = num_recv_all <= p.max_recv_rows ? num_recv_all : static_cast<int>(p.max_recv_rows);
    // Rows to write: the received ones, and with num_worst_tokens the padding rows up to the outputs' end.
    const int64_t out_rows = p.speculative ? num_recv : p.max_recv_rows;

    if (blockIdx.x == 0) {
        if (threadIdx.x == 0 && num_recv_all > p.max_recv_rows)
            report_error(sink, kErrorCapacity, -1, num_recv_all);
        if (p.rank_prefix_matrix != nullptr) {
            for (int j = threadIdx.x; j < kNumRanks; j += blockDim.x) {
                int acc = 0;
                for (int i = 0; i < kNumRanks; ++i) {
                    acc += bufs.at<const volatile int>(i, p.ctrl.count_to)[j];
                    p.rank_prefix_matrix[i * kNumRanks + j] = acc;
                }
            }
        }
        const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
        for (int e = threadIdx.x; e < experts_per_rank && p.expert_counts_out != nullptr; e += blockDim.x)
            p.expert_counts_out[e] = local_expert_count(p, bufs, e);
        if (threadIdx.x == 0 && p.num_recv_out != nullptr)
            *p.num_recv_out = num_recv;
    }

    if (p.send_rows != nullptr) {
        // My rows at rank j start after the rows of ranks 0..me-1 there.
        __shared__ int my_offset_at[kNumRanks];
        for (int j = threadIdx.x; j < kNumRanks; j += blockDim.x) {
            int acc = 0;
            for (int i = 0; i < me; ++i)
                acc += bufs.at<const volatile int>(i, p.ctrl.count_to)[j];
            my_offset_at[j] = acc;
        }
        __syncthreads();
        const int64_t n = p.num_tokens * kNumRanks;
        for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
             k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            const int pos = p.send_pos[k];
            p.send_rows[k] = pos >= 0 ? pos + my_offset_at[k % kNumRanks] : -1;
        }
    }

    // Each warp takes kPullRows consecutive rows; lane k first resolves row base+k (its source rank and
    // source token: one remote index load per lane, all in flight together), then the warp copies
    // the rows one after another, taking (source, token) from lane k.
    const int lane = threadIdx.x % 32;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
    const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
    for (int64_t base = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * kPullRows; base < out_rows;
         base += warps * kPullRows) {
        int my_src = 0, my_token = -1;
        if (lane < kPullRows && base + lane < num_recv) {
            const int i = static_cast<int>(base + lane);
            while (src_offset[my_src + 1] <= i)
                ++my_src;
            my_token = bufs.at<const int>(my_src, p.send_list_offset)[me * p.capacity + (i - src_offset[my_src])];
        }
        const int rows = static_cast<int>(out_rows - base < kPullRows ? out_rows - base : kPullRows);
        for (int k = 0; k < rows; ++k) {
            const int64_t i = base + k;
            const int s = __shfl_sync(0xffffffffu, my_src, k);
            const int t = __shfl_sync(0xffffffffu, my_token, k);
            int4* out = p.recv_x + i * kHiddenInt4;
            if (i >= num_recv) {   // padding row of num_worst_tokens mode
                for (int c = lane; c < kHiddenInt4; c += 32)
                    out[c] = make_int4(0, 0, 0, 0);
                for (int c = lane; c < p.num_scales && p.recv_scales != nullptr; c += 32)
                    p.recv_scales[i * p.num_scales + c] = 0;
                if constexpr (kNumTopk > 0) {
                    for (int k2 = lane; k2 < kNumTopk && p.recv_topk_idx != nullptr; k2 += 32) {
                        p.recv_topk_idx[i * kNumTopk + k2] = -1;
                        p.recv_topk_weights[i * kNumTopk + k2] = 0.0f;
                    }
                }
                if (lane == 0)
                    p.recv_src_idx[i] = -1;
                continue;
            }
            const int4* src = bufs.at<const int4>(s, p.rows_offset) + static_cast<int64_t>(t) * kHiddenInt4;
            const char* meta = bufs.at<const char>(s, p.meta_offset) + static_cast<int64_t>(t) * p.meta_bytes;
            RowCopy<kHiddenInt4> row;
            row.load(src, 0, lane);
            int scale[kScalesPerLane > 0 ? kScalesPerLane : 1];
#pragma unroll
            for (int u = 0; u < kScalesPerLane; ++u)
                if (lane + 32 * u < kNumScales)
                    scale[u] = reinterpret_cast<const int*>(meta + p.scales_offset)[lane + 32 * u];
            int id[kTopkPerLane > 0 ? kTopkPerLane : 1];
            float weight[kTopkPerLane > 0 ? kTopkPerLane : 1];
            const bool want_topk = kNumTopk > 0 && p.recv_topk_idx != nullptr;
#pragma unroll
            for (int u = 0; u < kTopkPerLane; ++u)
                if (want_topk && lane + 32 * u < kNumTopk) {
                    id[u] = reinterpret_cast<const int*>(meta + p.topk_idx_offset)[lane + 32 * u];
                    weight[u] = reinterpret_cast<const float*>(meta + p.topk_weights_offset)[lane + 32 * u];
                }
            row.store(out, 0, lane);
            row.copy_rest(out, src, lane);
#pragma unroll
            for (int u = 0; u < kScalesPerLane; ++u)
                if (lane + 32 * u < kNumScales && p.recv_scales != nullptr)
                    p.recv_scales[i * kNumScales + lane + 32 * u] = scale[u];
#pragma unroll
            for (int u = 0; u < kTopkPerLane; ++u)
                if (want_topk && lane + 32 * u < kNumTopk) {
                    const int k2 = lane + 32 * u;
                    const int local = id[u] - me * experts_per_rank;
                    const bool mine = id[u] >= 0 && local >= 0 && local < experts_per_rank;
                    p.recv_topk_idx[i * kNumTopk + k2] = mine ? local : -1;
                    p.recv_topk_weights[i * kNumTopk + k2] = mine ? weight[u] : 0.0f;
                }
            if (lane == 0)
                p.recv_src_idx[i] = t;
        }
    }
    end_round(bufs, p.ctrl, n);
}

}  // namespace deepep_portable::intranode
