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
// Scheme (no atomics anywhere, no memset): many small blocks, each owning a few counters it keeps in
// registers. Block b < ceil(E/8) owns experts [8b, 8b + 8), block ceil(E/8) + j ranks [8j, 8j + 8).
// Every block reads all top-k rows (threads stride over tokens; the rows stay in L2 across blocks); a thread
// adds each selection it owns to one of its 8 register counters (compares, not an indexed array, so they
// stay in registers); rank blocks also write their 8 bytes of each token's is_token_in_rank row. At the end a
// warp sum per counter, then a sum over the block's warps in shared memory. (The first kernel: 5 blocks of
// 1024 threads and shared atomics on 64 counters, 17 us at 4096 tokens on the H200; a grid this size spreads
// the same reads over E/8 + R/8 SMs.)
#include "common/kernels/common.cuh"

namespace {

constexpr int kThreads = 256;          // must match LAYOUT_THREADS in engines/dispatch_layout.py
constexpr int kWarps = kThreads / 32;
constexpr int kPerBlock = 8;           // experts or ranks a block owns (LAYOUT_PER_BLOCK on the host)

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
    for (int64_t t = threadIdx.x; t < p.num_tokens; t += kThreads) {
        const int64_t* row = p.topk_idx + t * num_topk;
        if (expert_block) {
#pragma unroll 8
            for (int k = 0; k < num_topk; ++k) {
                const int64_t e = __ldg(row + k);   // -1 and out-of-range entries select nothing
#pragma unroll
                for (int j = 0; j < kPerBlock; ++j)
                    count[j] += e == lo + j;   // compared, never subtracted: no overflow for any int64 entry
            }
        } else {
            uint32_t mask = 0;   // bit j: the token has an expert on rank lo + j
#pragma unroll 8
            for (int k = 0; k < num_topk; ++k) {
                const int64_t e = __ldg(row + k);
                if (e < 0 || e >= num_experts)
                    continue;
                const int r = static_cast<int>(e) / experts_per_rank - lo;
                if (r >= 0 && r < kPerBlock)
                    mask |= 1u << r;
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
