// Dispatch layout: from topk_idx, how many tokens go to each rank and expert, and which ranks
// each token visits.
//
// Compile-time parameters (-D): NUM_TOPK, NUM_RANKS, NUM_EXPERTS (divisible by NUM_RANKS; rank r
// holds experts [r*E/R, (r+1)*E/R)). Run-time: num_tokens and the pointers in LayoutParams.
//
// Outputs:
//   num_tokens_per_rank   [R] int32   tokens with at least one expert on rank r
//   num_tokens_per_expert [E] int32   (token, k) pairs selecting expert e (= tokens, since top-k
//                                     entries of a row are distinct)
//   is_token_in_rank      [N, R] bool written completely here (0/1 for every element)
// Entries outside [0, E) (normally -1) select nothing.
//
// Launch contract (see deepep_portable/engines/dispatch_layout.py): block = LAYOUT_THREADS threads, any grid of
// >= 1 block (grid-stride over tokens), and both counter arrays zeroed on the same stream before
// the launch (the kernel accumulates into them with atomics).
//
// Scheme: one thread per token. It reads the token's top-k row, adds 1 to each selected expert's
// counter, and collects the ranks it touches in a bitmask (registers; ceil(R/32) words), from
// which it writes its is_token_in_rank row and adds 1 to each touched rank's counter. Counters are
// block-local in shared memory and flushed to global memory with one atomic per non-zero counter.
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

constexpr int kThreads = 256;  // must match LAYOUT_THREADS in engines/dispatch_layout.py
constexpr int kExpertsPerRank = kNumExperts / kNumRanks;
constexpr int kMaskWords = (kNumRanks + 31) / 32;
constexpr int kNumCounters = kNumExperts + kNumRanks;
// Block-local counters while they fit comfortably in shared memory; beyond that (tens of
// thousands of experts) threads add straight into the global counters.
constexpr bool kSharedCounters = kNumCounters * 4 <= 32 * 1024;

}  // namespace

struct LayoutParams {
    const int64_t* topk_idx;     // [num_tokens, NUM_TOPK], row-major, contiguous
    int* num_tokens_per_rank;    // [NUM_RANKS], zeroed before launch
    int* num_tokens_per_expert;  // [NUM_EXPERTS], zeroed before launch
    bool* is_token_in_rank;      // [num_tokens, NUM_RANKS], row-major, contiguous
    int64_t num_tokens;
};

extern "C" __global__ void __launch_bounds__(kThreads)
dispatch_layout(const __grid_constant__ LayoutParams p) {
    __shared__ int shared_counters[kSharedCounters ? kNumCounters : 1];
    int* expert_counters = kSharedCounters ? shared_counters : p.num_tokens_per_expert;
    int* rank_counters = kSharedCounters ? shared_counters + kNumExperts : p.num_tokens_per_rank;
    if (kSharedCounters) {
        for (int i = threadIdx.x; i < kNumCounters; i += kThreads) shared_counters[i] = 0;
        __syncthreads();
    }

    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    for (int64_t token = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; token < p.num_tokens;
         token += stride) {
        // Ranks this token visits, one bit each. Words are selected with a compile-time loop so
        // the mask stays in registers (a dynamic index would put it in local memory).
        uint32_t mask[kMaskWords];
#pragma unroll
        for (int w = 0; w < kMaskWords; ++w) mask[w] = 0;

        const int64_t* row = p.topk_idx + token * kNumTopk;
#pragma unroll 8
        for (int k = 0; k < kNumTopk; ++k) {
            const int64_t expert = __ldg(row + k);
            if (expert < 0 || expert >= kNumExperts) continue;
            atomicAdd(&expert_counters[expert], 1);
            const int rank = static_cast<int>(expert) / kExpertsPerRank;
#pragma unroll
            for (int w = 0; w < kMaskWords; ++w)
                if (w == (rank >> 5)) mask[w] |= 1u << (rank & 31);
        }

        bool* out = p.is_token_in_rank + token * kNumRanks;
#pragma unroll
        for (int w = 0; w < kMaskWords; ++w) {
#pragma unroll
            for (int bit = 0; bit < 32; ++bit) {
                if (w * 32 + bit < kNumRanks) out[w * 32 + bit] = (mask[w] >> bit) & 1u;
            }
            for (uint32_t m = mask[w]; m != 0; m &= m - 1)  // each touched rank once
                atomicAdd(&rank_counters[w * 32 + __ffs(m) - 1], 1);
        }
    }

    if (kSharedCounters) {
        __syncthreads();
        for (int i = threadIdx.x; i < kNumCounters; i += kThreads) {
            const int count = shared_counters[i];
            if (count == 0) continue;
            if (i < kNumExperts)
                atomicAdd(&p.num_tokens_per_expert[i], count);
            else
                atomicAdd(&p.num_tokens_per_rank[i - kNumExperts], count);
        }
    }
}
