// V2's dispatch handle (EPHandle, deepep_portable/elastic_handle.py) from a V1 dispatch's results, in one
// launch: the plain receive layout's fields that ElasticBuffer.dispatch derives after every fresh dispatch.
// As torch operations they were some thirty launches of microseconds of host time each, which made a V2
// dispatch bound by its host path (about 1.4 ms of host time above V1's at 8 ranks sharing an H100).
//
// Inputs (the V1 handle's, and the dispatch's arguments):
//   rank_prefix_matrix [R, R] int32: [i][j] = rows ranks 0..i sent rank j; column `rank` orders my rows
//   recv_src_idx       [rows] int32: the source token of each received row, -1 on padding rows
//   recv_topk_idx      [rows, K] int64: local expert ids chosen by each received row, -1 elsewhere
//   send_rows          [num_tokens, R] int32: row of my token at rank r, -1 = not sent
//   topk_idx           [num_tokens, K] int64: my tokens' global expert ids, -1 = none
// Outputs (every element written; `counts` and `done` zeroed by the host before the launch):
//   metadata           [rows, K + 2] int32: source token's global index (-1 on padding), source rank * K +
//                      the first top-k position choosing a local expert (-1 on padding), then per position
//                      the row itself where it chose a local expert, else -1
//   dst_slot           [num_tokens, K] int32: send_rows[t][rank of topk_idx[t][k]], -1 where it is -1
//   counts             [L] int32: entries choosing each local expert
//   psum_per_expert    [L] int32: inclusive prefix sum of counts, each aligned up to expert_alignment
//   psum_per_scaleup   [S] int32: inclusive prefix sum over scale-up rank index j of the rows from the
//                      ranks i * S + j
//
// Scheme: thread per row (then per token) over a grid stride; a block keeps its expert histogram in
// shared memory and adds it to `counts` once. The last block to finish (a counter taken after a fence,
// as in CUDA's threadFenceReduction sample) sees every block's additions and writes the prefix sums.
#include <cstdint>

#include "common/kernels/common.cuh"

namespace {
constexpr int kThreads = 256;   // must match THREADS in deepep_portable/engines/handle_kernel.py
}  // namespace

struct HandleParams {
    const int* rank_prefix_matrix;
    const int* recv_src_idx;
    const int64_t* recv_topk_idx;
    const int* send_rows;
    const int64_t* topk_idx;
    int* metadata;
    int* dst_slot;
    int* counts;
    int* psum_per_expert;
    int* psum_per_scaleup;
    unsigned int* done;
    int64_t rows;
    int64_t num_tokens;
    int64_t num_max_tokens_per_rank;
    int32_t num_topk;
    int32_t num_ranks;
    int32_t rank;
    int32_t num_scaleup_ranks;
    int32_t num_local_experts;
    int32_t expert_alignment;
};

namespace deepep_portable::handle {

// Dynamic shared memory: the column [R] (my rows' ends per source rank), then the histogram [L].
__global__ void __launch_bounds__(kThreads) elastic_handle(const __grid_constant__ HandleParams p) {
    extern __shared__ int smem[];
    int* column = smem;
    int* histogram = smem + p.num_ranks;
    const int R = p.num_ranks, K = p.num_topk, L = p.num_local_experts;
    for (int i = threadIdx.x; i < R; i += blockDim.x)
        column[i] = p.rank_prefix_matrix[static_cast<int64_t>(i) * R + p.rank];
    for (int e = threadIdx.x; e < L; e += blockDim.x)
        histogram[e] = 0;
    __syncthreads();

    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t row = first; row < p.rows; row += stride) {
        // Source rank: the number of column entries <= row (rows come grouped by source rank).
        int lo = 0, hi = R;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (column[mid] <= row)
                lo = mid + 1;
            else
                hi = mid;
        }
        const int src_rank = lo;
        const int src_token = p.recv_src_idx[row];
        const bool real = src_token >= 0;
        int* meta = p.metadata + row * (K + 2);
        int first_choice = -1;
        for (int k = 0; k < K; ++k) {
            const int64_t e = p.recv_topk_idx[row * K + k];
            const bool chosen = e >= 0;
            if (chosen) {
                if (first_choice < 0)
                    first_choice = k;
                if (e < L)
                    atomicAdd(&histogram[e], 1);
            }
            meta[2 + k] = chosen ? static_cast<int>(row) : -1;
        }
        first_choice = first_choice < 0 ? 0 : first_choice;   // as an argmax over no choice: position 0
        meta[0] = real ? static_cast<int>(static_cast<int64_t>(src_rank) * p.num_max_tokens_per_rank + src_token) : -1;
        meta[1] = real ? src_rank * K + first_choice : -1;
    }
    for (int64_t t = first; t < p.num_tokens; t += stride) {
        for (int k = 0; k < K; ++k) {
            const int64_t e = p.topk_idx[t * K + k];
            p.dst_slot[t * K + k] = e >= 0 ? p.send_rows[t * R + static_cast<int>(e / L)] : -1;
        }
    }

    __syncthreads();
    for (int e = threadIdx.x; e < L; e += blockDim.x)
        if (histogram[e] != 0)
            atomicAdd(&p.counts[e], histogram[e]);
    // The last block: every block's counts are in (each fenced its additions before taking the counter).
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        s_last = atomicAdd(p.done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last || threadIdx.x != 0)
        return;
    __threadfence();
    int acc = 0;
    for (int e = 0; e < L; ++e) {
        const int c = *reinterpret_cast<volatile int*>(&p.counts[e]);
        acc += (c + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
        p.psum_per_expert[e] = acc;
    }
    const int S = p.num_scaleup_ranks;
    acc = 0;
    for (int j = 0; j < S; ++j) {
        for (int i = j; i < R; i += S)
            acc += column[i] - (i == 0 ? 0 : column[i - 1]);
        p.psum_per_scaleup[j] = acc;
    }
}

}  // namespace deepep_portable::handle
