// Dispatch layout: from topk_idx, how many tokens go to each rank and expert, and which ranks
// each token visits.
//
// Shapes are run-time values (LayoutParams): one compiled kernel serves every (tokens, top-k, ranks,
// experts), so a new expert count costs no JIT compile. Rank r holds experts [r*E/R, (r+1)*E/R).
//
// Outputs (every element written by the kernel):
//   num_tokens_per_rank   [R] int32   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] int32   (token, k) pairs selecting expert e (= tokens, since top-k
//                                     entries of a row are distinct)
//   is_token_in_rank      [N, R] bool written completely here (0/1 for every element)
// Entries outside [0, E) (normally -1) select nothing.
//
// Launch contract (see deepep_portable/engines/dispatch_layout.py): block = kThreads threads, grid =
// ceil(E/8) + ceil(R/8) blocks (layout_grid() on the host). Every output element is written (no zeroing).
//
// Scheme (no atomics anywhere, no memset): small blocks, each owning a few counters it keeps in registers.
// Block b < ceil(E/8) owns experts [8b, 8b + 8), block ceil(E/8) + j ranks [8j, 8j + 8). Every block reads all
// of topk_idx (it stays in L2 across blocks). The op is latency-bound (256 KB at 4096 tokens, top-8), so each
// thread keeps several 16-byte loads in flight and a block has 1024 threads: a thread waits on memory a few times,
// not once per token. Expert blocks ignore token boundaries (they count entries equal to their experts over
// the flat array); rank blocks take a token per thread, OR the ranks of its entries into a mask, write their 8
// bytes of its is_token_in_rank row and count the mask's bits. A thread adds to one of its 8 register counters
// by compares (not an indexed array, so they stay in registers); at the end a warp sum per counter, then a
// sum over the block's warps in shared memory. (Earlier kernels: shared atomics on 64 counters in 5 blocks,
// 17 us at 4096 tokens; 256 threads with one 8-byte load per entry, a dependent round per token.)
#include "common/kernels/common.cuh"

namespace {

constexpr int kThreads = 1024;         // must match LAYOUT_THREADS in engines/dispatch_layout.py
constexpr int kWarps = kThreads / 32;
constexpr int kPerBlock = 8;           // experts or ranks a block owns (LAYOUT_PER_BLOCK on the host)
constexpr int kLoads = 4;              // 16-byte loads a thread of an expert block has in flight

// Adds entry e's selection to the counter of expert lo + j it equals (compared, never subtracted: no overflow
// for any int64 entry; -1 and out-of-range entries match nothing).
__device__ __forceinline__ void count_entry(int (&count)[kPerBlock], int64_t e, int lo) {
#pragma unroll
    for (int j = 0; j < kPerBlock; ++j)
        count[j] += e == lo + j;
}

// The ranks in [lo, lo + 8) that entry e selects, as mask bits.
__device__ __forceinline__ uint32_t rank_bit(int64_t e, int num_experts, int experts_per_rank, int lo) {
    if (e < 0 || e >= num_experts)
        return 0;
    const int r = static_cast<int>(e) / experts_per_rank - lo;
    return r >= 0 && r < kPerBlock ? 1u << r : 0u;
}

}  // namespace

struct LayoutParams {
    const int64_t* topk_idx;     // [num_tokens, num_topk], row-major, contiguous
    int* num_tokens_per_rank;    // [num_ranks]
    int* num_tokens_per_expert;  // [num_experts]
    bool* is_token_in_rank;      // [num_tokens, num_ranks], row-major, contiguous
    int64_t num_tokens;
    int32_t num_topk;            // >= 1
    int32_t num_ranks;           // >= 1
    int32_t num_experts;         // a positive multiple of num_ranks
    int32_t reserved;            // 0 (keeps the struct's size a multiple of 8 on both sides)
};

namespace deepep_portable::layout {

__global__ void __launch_bounds__(kThreads) routing_layout(const __grid_constant__ LayoutParams p) {
    __shared__ int partial[kWarps][kPerBlock];
    const int num_topk = p.num_topk, num_ranks = p.num_ranks, num_experts = p.num_experts;
    const int expert_blocks = (num_experts + kPerBlock - 1) / kPerBlock;
    const int experts_per_rank = num_experts / num_ranks;
    const bool expert_block = static_cast<int>(blockIdx.x) < expert_blocks;
    const int lo = (expert_block ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) - expert_blocks) *
                   kPerBlock;
    const int width = expert_block ? min(kPerBlock, num_experts - lo) : min(kPerBlock, num_ranks - lo);
    const bool aligned = num_ranks % kPerBlock == 0 && (reinterpret_cast<uintptr_t>(p.is_token_in_rank) & 7) == 0;
    int count[kPerBlock];
#pragma unroll
    for (int j = 0; j < kPerBlock; ++j)
        count[j] = 0;
    if (expert_block) {
        const int64_t entries = p.num_tokens * num_topk;
        if ((reinterpret_cast<uintptr_t>(p.topk_idx) & 15) == 0) {   // pairs of entries, kLoads in flight
            const auto* pairs = reinterpret_cast<const longlong2*>(p.topk_idx);
            const int64_t num_pairs = entries / 2;
            for (int64_t i = threadIdx.x; i < num_pairs; i += kThreads * kLoads) {
                longlong2 v[kLoads];
#pragma unroll
                for (int u = 0; u < kLoads; ++u)
                    v[u] = i + u * kThreads < num_pairs ? __ldg(pairs + i + u * kThreads) : make_longlong2(-1, -1);
#pragma unroll
                for (int u = 0; u < kLoads; ++u) {
                    count_entry(count, v[u].x, lo);
                    count_entry(count, v[u].y, lo);
                }
            }
            if ((entries & 1) && threadIdx.x == 0)
                count_entry(count, __ldg(p.topk_idx + entries - 1), lo);
        } else {
            for (int64_t i = threadIdx.x; i < entries; i += kThreads)
                count_entry(count, __ldg(p.topk_idx + i), lo);
        }
    } else {
        const bool vector_rows = num_topk % 2 == 0 && (reinterpret_cast<uintptr_t>(p.topk_idx) & 15) == 0;
        for (int64_t t = threadIdx.x; t < p.num_tokens; t += kThreads) {
            const int64_t* row = p.topk_idx + t * num_topk;
            uint32_t mask = 0;   // bit j: the token has an expert on rank lo + j
            if (vector_rows) {   // the row in 16-byte loads (16-byte aligned: the base is, and the row is even)
                const auto* row2 = reinterpret_cast<const longlong2*>(row);
#pragma unroll 8
                for (int k = 0; k < num_topk / 2; ++k) {
                    const longlong2 v = __ldg(row2 + k);
                    mask |= rank_bit(v.x, num_experts, experts_per_rank, lo) |
                            rank_bit(v.y, num_experts, experts_per_rank, lo);
                }
            } else {
#pragma unroll 8
                for (int k = 0; k < num_topk; ++k)
                    mask |= rank_bit(__ldg(row + k), num_experts, experts_per_rank, lo);
            }
            bool* out = p.is_token_in_rank + t * num_ranks + lo;
            if (aligned) {   // one 8-byte store: lo and the row stride are multiples of 8, the base 8-aligned
                uint64_t bytes = 0;
#pragma unroll
                for (int j = 0; j < kPerBlock; ++j)
                    bytes |= static_cast<uint64_t>((mask >> j) & 1u) << (8 * j);
                *reinterpret_cast<uint64_t*>(out) = bytes;
            } else {
                for (int j = 0; j < width; ++j)
                    out[j] = (mask >> j) & 1u;
            }
#pragma unroll
            for (int j = 0; j < kPerBlock; ++j)
                count[j] += (mask >> j) & 1u;
        }
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int j = 0; j < kPerBlock; ++j) {
        const int sum = __reduce_add_sync(0xffffffffu, count[j]);   // sm_80+ (every architecture we build)
        if (lane == 0)
            partial[warp][j] = sum;
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < width) {
        int total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w)
            total += partial[w][threadIdx.x];
        (expert_block ? p.num_tokens_per_expert : p.num_tokens_per_rank)[lo + threadIdx.x] = total;
    }
}

}  // namespace deepep_portable::layout
