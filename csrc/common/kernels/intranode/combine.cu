// Intranode combine, pull-based and streamed: one launch stages my expert outputs and pulls my tokens'
// rows, each as soon as the peers have staged them (see protocol.cuh for the round protocol).
//
// My send area holds, for the combine, two arrays: the expert outputs [rows, HIDDEN] bf16 (row i =
// the i-th row I received in the dispatch: source rank 0's rows in token order, then source 1's, ...)
// and after them their top-k weights [rows, NUM_TOPK] f32.
//
// The first `stage_warps` warps of each block stage while the others already pull, so the two kinds
// of traffic overlap (a stage alone runs at the HBM rate and a pull alone below it; PERFORMANCE.md):
//   stage:  copy my rows (x) and their weights into my send area in chunks of `chunk_rows` rows of one
//           source's segment, chunk 0 of every source first, then chunk 1, ... (the order the sources'
//           pulls need them in), and after each chunk set its flag to the round number n. With
//           x == nullptr (a zero-copy combine: the caller wrote the rows there, after the round was
//           opened by open_round.cu) only the weights are copied. A stage warp then joins the pull.
//   pull:   every warp draws runs of `pull_run` consecutive tokens of mine from a ticket counter, in
//           token order. For each token, read its row from every rank it was sent to (row index from
//           the dispatch handle) once that rank's chunk holding it is flagged, and sum in float32 in a
//           fixed order: 0, + bias_0, + bias_1, + rows of ranks 0..R-1. Plain adds (no multiply, so no
//           FMA contraction): bit-identical to the torch oracle. A lane keeps the last chunk it saw
//           flagged at its rank, so it polls once a chunk, not once a token.
// Flags: u64 [R][chunk_slots] in the control area (CTRL_CHUNK_FLAGS), [s][k] = the last round whose
// chunk k of source s's rows is staged. Only this kernel writes them and round numbers only grow, so
// they are never cleared. The chunk size follows from the dispatch's rank_prefix_matrix, which every
// rank holds whole, so stager and puller agree on it without a word exchanged.
// Deadlock freedom: stage warps wait for nothing after the round's prologue (begin_round), and every
// block of every rank is resident (the SM budget guarantees it), so every flag is eventually set.
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
constexpr int kWarps = kThreads / 32;
constexpr int kRankGroup = kNumRanks < 8 ? kNumRanks : 8;   // ranks read together
constexpr int kColumns = kRankGroup >= 8 ? 2 : (kRankGroup >= 4 ? 3 : 4);   // columns per lane at a time (fits registers)
constexpr int kRanksPerLane = (kNumRanks + 31) / 32;   // ranks whose chunk a lane tracks (lane + 32 u)
constexpr int kTopkPerLane = kNumTopk > 0 ? (kNumTopk + 31) / 32 : 1;   // weights a lane sums
constexpr int kStageLoads = 16;   // 16-byte words a stage lane keeps in flight
constexpr unsigned int kPollSleepNs = 100;   // between polls of a chunk flag (pull warps ahead of the stage)
}  // namespace

struct CombineParams {
    const uint64_t* peer_bases;
    int64_t rank;
    ControlLayout ctrl;
    int64_t send_area_offset;        // the expert outputs: [rows, HIDDEN] bf16, contiguous
    int64_t weights_area_offset;     // their top-k weights: [rows, NUM_TOPK] f32, contiguous
    int64_t chunk_flags_offset;      // u64 [R][chunk_slots] (see the top of the file)
    int64_t chunk_slots;             // flags per source; chunks are sized so a source's rows need no more
    int64_t min_chunk_rows;          // chunks are at least this many rows
    int64_t stage_warps;             // warps of each block that stage before they pull, 1 .. kWarps - 1
    int64_t pull_run;                // tokens a warp's pull ticket covers
    // stage inputs
    const int4* x;                   // [rows, HIDDEN] bf16: the rows this rank received; null: already in my
                                     // send area (written there by the caller, zero-copy)
    const float* topk_weights;       // [rows, NUM_TOPK], or null
    const int* rank_prefix_matrix;   // [R, R]: [i][j] = tokens ranks 0..i sent rank j (the dispatch handle's)
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

// What every warp of a block needs, computed once per block from the handle's rank_prefix_matrix.
struct Geometry {
    int chunk_rows;                  // rows per chunk (the same on every rank)
    int seg_begin[kNumRanks + 1];    // my rows received from source s: [seg_begin[s], seg_begin[s + 1])
    int my_first_row[kNumRanks];     // where rank r keeps my first token's row (its segment for me)
};

DEEPEP_DEVICE void compute_geometry(const CombineParams& p, Geometry& g) {
    __shared__ int s_max_segment;
    const int me = static_cast<int>(p.rank);
    const int* prefix = p.rank_prefix_matrix;
    if (threadIdx.x == 0)
        s_max_segment = 0;
    __syncthreads();
    int longest = 0;
    for (int i = threadIdx.x; i < kNumRanks * kNumRanks; i += blockDim.x) {
        const int s = i / kNumRanks;
        const int below = s == 0 ? 0 : prefix[i - kNumRanks];
        longest = max(longest, prefix[i] - below);
    }
    atomicMax(&s_max_segment, longest);
    for (int s = threadIdx.x; s <= kNumRanks; s += blockDim.x)
        g.seg_begin[s] = s == 0 ? 0 : prefix[(s - 1) * kNumRanks + me];
    for (int r = threadIdx.x; r < kNumRanks; r += blockDim.x)
        g.my_first_row[r] = me == 0 ? 0 : prefix[(me - 1) * kNumRanks + r];
    __syncthreads();
    if (threadIdx.x == 0) {
        const int by_slots = static_cast<int>(ceil_div<int64_t>(s_max_segment, p.chunk_slots));
        g.chunk_rows = max(static_cast<int>(p.min_chunk_rows), max(by_slots, 1));
    }
    __syncthreads();
}

DEEPEP_DEVICE uint64_t* chunk_flag(const PeerBuffers& bufs, const CombineParams& p, int owner, int source, int chunk) {
    return bufs.at<uint64_t>(owner, p.chunk_flags_offset) + static_cast<int64_t>(source) * p.chunk_slots + chunk;
}

// Stage warp: my rows of source s's chunk k (k-major over the sources), then its flag.
DEEPEP_DEVICE void stage_chunks(const CombineParams& p, const PeerBuffers& bufs, const Geometry& g, uint64_t n,
                                int stage_warp, int stage_warps, int lane) {
    int4* rows = bufs.at<int4>(bufs.rank, p.send_area_offset);
    float* weights = bufs.at<float>(bufs.rank, p.weights_area_offset);
    const bool has_weights = kNumTopk > 0 && p.topk_weights != nullptr;
    int longest = 0;
#pragma unroll 1
    for (int s = 0; s < kNumRanks; ++s)
        longest = max(longest, g.seg_begin[s + 1] - g.seg_begin[s]);
    const int64_t items = static_cast<int64_t>(ceil_div(longest, g.chunk_rows)) * kNumRanks;
    for (int64_t item = stage_warp; item < items; item += stage_warps) {
        const int k = static_cast<int>(item / kNumRanks), s = static_cast<int>(item % kNumRanks);
        const int64_t first = g.seg_begin[s] + static_cast<int64_t>(k) * g.chunk_rows;
        const int64_t last = min(static_cast<int64_t>(g.seg_begin[s + 1]), first + g.chunk_rows);
        if (first >= last)
            continue;   // no such rows: no puller waits for this chunk
        if (p.x != nullptr) {   // rows [first, last) are contiguous in x and in my send area
            const int4* src = p.x + first * kHiddenInt4;
            int4* dst = rows + first * kHiddenInt4;
            const int64_t words = (last - first) * kHiddenInt4;
            for (int64_t base = 0; base < words; base += 32 * kStageLoads) {
                int4 v[kStageLoads];
#pragma unroll
                for (int u = 0; u < kStageLoads; ++u)
                    if (base + lane + 32 * u < words)
                        v[u] = __ldg(src + base + lane + 32 * u);
#pragma unroll
                for (int u = 0; u < kStageLoads; ++u)
                    if (base + lane + 32 * u < words)
                        dst[base + lane + 32 * u] = v[u];
            }
        }
        if (has_weights)
            for (int64_t i = first * kNumTopk + lane; i < last * kNumTopk; i += 32)
                weights[i] = p.topk_weights[i];
        // Every lane's stores come before lane 0's release (the warp barrier orders them, the system
        // fence makes them visible to peers on other GPUs as well).
        __syncwarp();
        if (lane == 0) {
            __threadfence_system();
            st_release_sys(chunk_flag(bufs, p, bufs.rank, s, k), n);
        }
    }
}

// One token: the sum over ranks of its rows (row of rank r: shuffled from lane r of my_row).
DEEPEP_DEVICE void reduce_token(const CombineParams& p, const PeerBuffers& bufs, int64_t t, int my_row, int lane) {
    // The row of rank r (shuffled from lane r of my_row, or read when ranks outnumber lanes).
    auto row_at = [&](int r) {
        return kNumRanks <= 32 ? __shfl_sync(0xffffffffu, my_row, r) : p.send_rows[t * kNumRanks + r];
    };
    const int4* src[kNumRanks];
#pragma unroll
    for (int r = 0; r < kNumRanks; ++r) {
        const int row = row_at(r);
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
            float w[kTopkPerLane] = {};
#pragma unroll
            for (int r = 0; r < kNumRanks; ++r) {
                const int row = row_at(r);   // every lane shuffles: the loop over k below is per lane
#pragma unroll
                for (int u = 0; u < kTopkPerLane; ++u)
                    if (row >= 0 && lane + 32 * u < kNumTopk)
                        w[u] = __fadd_rn(w[u], bufs.at<const float>(r, p.weights_area_offset)[
                                                   static_cast<int64_t>(row) * kNumTopk + lane + 32 * u]);
            }
#pragma unroll
            for (int u = 0; u < kTopkPerLane; ++u)
                if (lane + 32 * u < kNumTopk)
                    p.out_topk_weights[t * kNumTopk + lane + 32 * u] = w[u];
        }
    }
}

// Pull: runs of pull_run consecutive tokens, drawn in token order from my ticket word by every warp
// of the grid (a stage warp joins once its chunks are staged). Returns false after a timeout.
DEEPEP_DEVICE bool pull_tokens(const CombineParams& p, const PeerBuffers& bufs, const Geometry& g, uint64_t n,
                               int lane, const ErrorSink& sink) {
    int seen[kRanksPerLane];   // the last chunk of rank lane + 32 u this lane saw flagged (-1: none)
#pragma unroll
    for (int u = 0; u < kRanksPerLane; ++u)
        seen[u] = -1;
    const int64_t run = p.pull_run, num_runs = ceil_div<int64_t>(p.num_tokens, run);
    unsigned int* ticket = bufs.at<unsigned int>(bufs.rank, p.ctrl.stage_ticket);
    auto row_of = [&](int64_t t, int r) { return r < kNumRanks ? p.send_rows[t * kNumRanks + r] : -1; };
    for (int64_t q = take_draw(ticket, issue_draw(ticket, lane), num_runs, lane); q < num_runs;) {
        const unsigned int next_draw = issue_draw(ticket, lane);
        const int end = static_cast<int>(min((q + 1) * run, p.num_tokens));
        // The next token's rows (lane r: its row at rank r) load while the current token is summed.
        int next_row = row_of(q * run, lane);
#pragma unroll 1
        for (int t = static_cast<int>(q * run); t < end; ++t) {
            const int my_row = next_row;
            if (t + 1 < end)
                next_row = row_of(t + 1, lane);
            bool waited = false, ok = true;
#pragma unroll
            for (int u = 0; u < kRanksPerLane; ++u) {
                const int r = lane + 32 * u;
                const int row = u == 0 ? my_row : row_of(t, r);
                const int k = row < 0 ? -1 : (row - g.my_first_row[r]) / g.chunk_rows;
                if (k > seen[u] && ok) {   // a warp's tokens only grow (tickets do), so do a lane's chunks
                    ok = wait_ge(chunk_flag(bufs, p, r, bufs.rank, k), n, globaltimer_ns() + p.timeout_ns, sink, r,
                                 kPollSleepNs);
                    seen[u] = k;
                    waited = true;
                }
            }
            // A timed-out warp leaves its ticket drawn: the Buffer is unusable after a timeout anyway.
            if (__any_sync(0xffffffffu, !ok))
                return false;
            // The lanes that acquired a flag come before every lane's reads of that rank's rows.
            if (__any_sync(0xffffffffu, waited))
                __threadfence_system();
            __syncwarp();
            reduce_token(p, bufs, t, my_row, lane);
        }
        q = take_draw(ticket, next_draw, num_runs, lane);
    }
    return true;
}

}  // namespace

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) combine(const __grid_constant__ CombineParams p) {
    const PeerBuffers bufs{p.peer_bases, static_cast<int>(p.rank), kNumRanks};
    const ErrorSink sink{p.error_claim, p.error_host, kOpCombine, static_cast<int>(p.rank)};
    const uint64_t n = begin_round(bufs, p.ctrl, p.timeout_ns, sink);
    if (n == 0)
        return;
    __shared__ Geometry g;
    __shared__ int s_failed;
    if (threadIdx.x == 0)
        s_failed = 0;
    compute_geometry(p, g);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int stage_warps = static_cast<int>(p.stage_warps);
    if (warp < stage_warps)
        stage_chunks(p, bufs, g, n, blockIdx.x * stage_warps + warp, gridDim.x * stage_warps, lane);
    if (!pull_tokens(p, bufs, g, n, lane, sink))
        s_failed = 1;
    __syncthreads();
    // After a timeout no DONE is given: the peers' next round times out too, and the host reports it.
    end_round(bufs, p.ctrl, s_failed ? 0 : n);
}

}  // namespace deepep_portable::intranode
