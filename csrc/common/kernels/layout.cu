// Dispatch layout: from topk_idx, how many tokens go to each rank and expert, and which ranks
// each token visits.
//
// Compile-time parameters (-D): NUM_TOPK, NUM_RANKS, NUM_EXPERTS (divisible by NUM_RANKS; rank r
// holds experts [r*E/R, (r+1)*E/R)). Run-time: num_tokens and the pointers in LayoutParams.
//
// Outputs (every element written by the kernel):
//   num_tokens_per_rank   [R] int32   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] int32   (token, k) pairs selecting expert e (= tokens, since top-k
//                                     entries of a row are distinct)
//   is_token_in_rank      [N, R] bool written completely here (0/1 for every element)
// Entries outside [0, E) (normally -1) select nothing.
//
// Launch contract (see deepep_portable/engines/dispatch_layout.py): block = LAYOUT_THREADS threads,
// grid = kGridBlocks (layout_grid() on the host). Every output element is written (no zeroing first).
//
// Scheme (no atomics on global memory, no memset): block b < kExpertBlocks owns experts
// [b * kExpertsPerBlock, ...) and block kExpertBlocks + j owns ranks [j * 32, j * 32 + 32). Every block
// reads all top-k rows (threads stride over tokens; the rows stay in L2 across blocks) and counts into
// shared memory only what it owns: expert blocks count (token, k) pairs per expert, rank blocks build
// each token's mask of its ranks, write the token's is_token_in_rank bytes for them and count each
// touched rank once. Each block then stores its counters. The host path is one allocation and one
// launch, which is what an eager call of a few microseconds of GPU work costs.
#include "common/kernels/common.cuh"

#ifndef NUM_TOPK
#error "layout.cu needs -DNUM_TOPK=<top-k>"
#endif
#ifndef NUM_RANKS
#error "layout.cu needs -DNUM_RANKS=<number of ranks>"
#endif
#ifndef NUM_EXPERTS
#error "layout.cu needs -DNUM_EXPERTS=<number of experts>"
#endif

namespace {

constexpr int kNumTopk = NUM_TOPK;
constexpr int kNumRanks = NUM_RANKS;
constexpr int kNumExperts = NUM_EXPERTS;
static_assert(kNumTopk >= 1 && kNumTopk <= 128, "NUM_TOPK must be in [1, 128]");
static_assert(kNumRanks >= 1, "NUM_RANKS must be >= 1");
static_assert(kNumExperts >= kNumRanks && kNumExperts % kNumRanks == 0,
              "NUM_EXPERTS must be a positive multiple of NUM_RANKS");

constexpr int kThreads = 1024;  // must match LAYOUT_THREADS in engines/dispatch_layout.py
constexpr int kExpertsPerRank = kNumExperts / kNumRanks;
constexpr int kExpertsPerBlock = 64;   // LAYOUT_EXPERTS_PER_BLOCK in engines/dispatch_layout.py
constexpr int kExpertBlocks = (kNumExperts + kExpertsPerBlock - 1) / kExpertsPerBlock;
constexpr int kRankBlocks = (kNumRanks + 31) / 32;
constexpr int kGridBlocks = kExpertBlocks + kRankBlocks;   // engines/dispatch_layout.py layout_grid()

}  // namespace

struct LayoutParams {
    const int64_t* topk_idx;     // [num_tokens, NUM_TOPK], row-major, contiguous
    int* num_tokens_per_rank;    // [NUM_RANKS]
    int* num_tokens_per_expert;  // [NUM_EXPERTS]
    bool* is_token_in_rank;      // [num_tokens, NUM_RANKS], row-major, contiguous
    int64_t num_tokens;
};

namespace deepep_portable::layout {

__global__ void __launch_bounds__(kThreads) routing_layout(const __grid_constant__ LayoutParams p) {
    __shared__ int counters[kExpertsPerBlock > 32 ? kExpertsPerBlock : 32];
    for (int i = threadIdx.x; i < kExpertsPerBlock; i += kThreads)
        counters[i] = 0;
    __syncthreads();
    const bool expert_block = blockIdx.x < kExpertBlocks;
    if (expert_block) {
        const int64_t lo = static_cast<int64_t>(blockIdx.x) * kExpertsPerBlock;
        for (int64_t t = threadIdx.x; t < p.num_tokens; t += kThreads) {
            const int64_t* row = p.topk_idx + t * kNumTopk;
#pragma unroll 8
            for (int k = 0; k < kNumTopk; ++k) {
                const int64_t e = __ldg(row + k) - lo;   // -1 and out-of-range entries select nothing
                if (e >= 0 && e < kExpertsPerBlock && e + lo < kNumExperts)
                    atomicAdd(&counters[e], 1);
            }
        }
    } else {
        const int lo = (static_cast<int>(blockIdx.x) - kExpertBlocks) * 32;
        const int width = kNumRanks - lo < 32 ? kNumRanks - lo : 32;
        for (int64_t t = threadIdx.x; t < p.num_tokens; t += kThreads) {
            const int64_t* row = p.topk_idx + t * kNumTopk;
            uint32_t mask = 0;
#pragma unroll 8
            for (int k = 0; k < kNumTopk; ++k) {
                const int64_t e = __ldg(row + k);
                if (e < 0 || e >= kNumExperts)
                    continue;
                const int r = static_cast<int>(e) / kExpertsPerRank - lo;
                if (r >= 0 && r < 32)
                    mask |= 1u << r;
            }
            bool* out = p.is_token_in_rank + t * kNumRanks + lo;
            for (int r = 0; r < width; ++r)
                out[r] = (mask >> r) & 1u;
            for (uint32_t m = mask; m != 0; m &= m - 1)   // each touched rank once
                atomicAdd(&counters[__ffs(m) - 1], 1);
        }
    }
    __syncthreads();
    if (expert_block) {
        const int lo = static_cast<int>(blockIdx.x) * kExpertsPerBlock;
        for (int i = threadIdx.x; i < kExpertsPerBlock && lo + i < kNumExperts; i += kThreads)
            p.num_tokens_per_expert[lo + i] = counters[i];
    } else {
        const int lo = (static_cast<int>(blockIdx.x) - kExpertBlocks) * 32;
        for (int i = threadIdx.x; i < 32 && lo + i < kNumRanks; i += kThreads)
            p.num_tokens_per_rank[lo + i] = counters[i];
    }
}

}  // namespace deepep_portable::layout
