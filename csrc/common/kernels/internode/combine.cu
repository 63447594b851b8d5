// Internode combine (docs/INTERNODE.md; protocol.cuh for words, the handshake and deadlock freedom):
// the dispatch reversed. Three kernels on the Buffer's stream, op n:
//
//   notify_staged_rows  handshake (HS[me] = n to every rank, wait for every rank's), then copy my combine
//                      input rows (and top-k weights) into my window, row i at staging row i: my node
//                      peers read them there.
//   reduce_node_rows   publish STAGED = n (my rows are complete: the previous kernel ended), wait for
//                      my node peers' STAGED. The landing role: a warp per (source node, chunk) of the
//                      tokens that landed here in the dispatch (the handle's copy of their meta) sums,
//                      for each token, the rows of the ranks of my node that received it, in float32
//                      from +0.0 in ascending rank, rounds to bf16 (what crosses the network, as DeepEP),
//                      and puts the partial (and the weights' float32 partial) into the source's landing
//                      row [my node][token]; one signal per (source, chunk): COMBINE_ARRIVE = n.
//   combine            a warp per quarter of a chunk of my tokens waits for every node's partials of the
//                      chunk, then
//                      out[t] = bf16(+0.0 + bias_0 + bias_1 + partial of each node that received t,
//                      node ascending); weights: +0.0 + each node's partial. The torch oracle adds in
//                      exactly this order (transports/reference.py), so the result is bit-exact.
//
// Compile-time (-D): NUM_RANKS, RANKS_PER_NODE, HIDDEN (bf16 elements, multiple of 8), NUM_TOPK (0: no weights).
#include <cstdint>

#include "common/kernels/bf16.cuh"
#include "common/kernels/common.cuh"
#include "common/kernels/internode/protocol.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"

#ifndef HIDDEN
#error "internode/combine.cu needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "internode/combine.cu needs -DNUM_TOPK (0 for none)"
#endif

using namespace deepep_portable;
using namespace deepep_portable::internode;

namespace deepep_portable::internode {

// A combine row: bf16 [HIDDEN] | float32 top-k weights [NUM_TOPK]. Host mirror: internode_layout.InternodeCombineLayout.
constexpr int kHiddenInt4 = HIDDEN / 8;
constexpr int kNumTopk = NUM_TOPK;
constexpr int64_t kWeightsAt = 16 * static_cast<int64_t>(kHiddenInt4);
constexpr int64_t kRowBytes = kWeightsAt + align_up<int64_t>(4 * kNumTopk, 16);
constexpr int kMetaWords = kRanksPerNode + 1;   // as the dispatch's landed meta: positions [P], source token
// The final combine's sums: kColumns 16-byte columns per lane at a time, kRowGroup rows' loads in flight
// before their adds. (reduce_node_rows keeps its simple loop: with its put_warp's copy round in registers,
// wider sums spill past the 128 registers of 512 threads in the nvshmem build.)
constexpr int kColumns = 4;
constexpr int kRowGroup = 2;
// The final combine splits each chunk over kTasksPerChunk warps (a chunk per warp left 3/4 of them idle).
constexpr int kTokensPerTask = 16;
constexpr int kTasksPerChunk = kChunkTokens / kTokensPerTask;
static_assert(kChunkTokens % kTokensPerTask == 0, "a chunk splits into whole tasks");
static_assert(HIDDEN % 8 == 0, "hidden must be a multiple of 8 bf16");

}  // namespace deepep_portable::internode

struct InternodeCombineParams {
    Common common;
    int64_t landing_offset;         // [M][N] rows: each node's partial of my tokens (network destination)
    int64_t partial_offset;         // [M][N] rows: partials I computed, staged for their put
    int64_t staging_offset;         // [max_rows] rows: my combine input, read by my node peers
    int64_t max_rows;
    // inputs
    const int4* x;                  // [rows, HIDDEN] bf16: the rows this rank received in the dispatch
    const float* topk_weights;      // [rows, NUM_TOPK], or null
    const int* num_recv;            // [1] device count of real rows
    const int* rank_prefix_matrix;  // [R, R] of the dispatch
    const int* landed_meta;         // [M, meta_tokens, P + 1] of the dispatch
    const int64_t* landed_range;    // [M, kMaxChunks]
    const int* landed_chunks;       // [M]
    int64_t meta_tokens;
    const bool* is_token_in_rank;   // [T, R] of the dispatch
    int64_t num_tokens;             // T
    const int4* bias_0;             // [T, HIDDEN] bf16, or null
    const int4* bias_1;
    // outputs
    int4* out;                      // [T, HIDDEN] bf16
    float* out_topk_weights;        // [T, NUM_TOPK], or null
};

namespace {

DEEPEP_DEVICE int64_t global_warp() { return static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; }
DEEPEP_DEVICE int64_t grid_warps() { return static_cast<int64_t>(gridDim.x) * kWarps; }

}  // namespace

namespace deepep_portable::internode {

__global__ void __launch_bounds__(kThreads) notify_staged_rows(const __grid_constant__ InternodeCombineParams p) {
    const Common& c = p.common;
    const uint64_t n = begin_op(c);
    const ErrorSink sink = sink_of(c, kOpCombine);
    const int me = static_cast<int>(c.rank);
    if (blockIdx.x == 0)
        for (int r = threadIdx.x; r < kNumRanks; r += blockDim.x)
            c.transport.signal(0, r, c.hs_offset + 8 * me, n);
    // Every block: nobody reads my staging rows of an earlier op any more, nor writes my landing rows.
    if (!await_handshake(c, n, sink))
        return;
    const int num_recv = *p.num_recv;
    if (blockIdx.x == 0 && threadIdx.x == 0 && num_recv > p.max_rows)
        report_error(sink, kErrorCapacity, -1, num_recv);
    const int64_t rows = num_recv < p.max_rows ? num_recv : p.max_rows;
    const int lane = threadIdx.x % 32;
    char* staging = local<char>(c, p.staging_offset);
    for (int64_t i = global_warp(); i < rows; i += grid_warps()) {
        char* row = staging + i * kRowBytes;
        transport::warp_copy_bytes(row, p.x + i * kHiddenInt4, 16 * kHiddenInt4, lane);
        for (int k = lane; k < kNumTopk && p.topk_weights != nullptr; k += 32)
            reinterpret_cast<float*>(row + kWeightsAt)[k] = p.topk_weights[i * kNumTopk + k];
    }
}

__global__ void __launch_bounds__(kThreads) reduce_node_rows(const __grid_constant__ InternodeCombineParams p) {
    const Common& c = p.common;
    if (op_failed(c))
        return;
    const uint64_t n = current_op(c);
    const ErrorSink sink = sink_of(c, kOpCombine);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int node = my_node(c), me_local = my_local(c);
    __shared__ int s_ok;
    __shared__ int s_first[kNumNodes + 1];
    __shared__ int s_rows[kWarps][kRanksPerNode];
    if (threadIdx.x == 0) {
        s_ok = 1;
        if (blockIdx.x == 0) {
            // My staging rows were written by the previous kernel (complete at its end): publish them.
            __threadfence_system();
            st_release_sys(local<uint64_t>(c, c.staged_offset), n);
        }
        int acc = 0;
        for (int m = 0; m < kNumNodes; ++m) {
            s_first[m] = acc;
            acc += p.landed_chunks[m];
        }
        s_first[kNumNodes] = acc;
    }
    __syncthreads();
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    for (int j = threadIdx.x; j < kRanksPerNode; j += blockDim.x)
        if (!deepep_portable::wait_ge(node_peer<const uint64_t>(c, j, c.staged_offset), n, deadline, sink,
                                      node * kRanksPerNode + j))
            s_ok = 0;
    __syncthreads();
    __threadfence_system();   // the peers' rows are read after the acquires
    if (!s_ok)
        return;

    for (int64_t task = global_warp(); task < s_first[kNumNodes]; task += grid_warps()) {
        int src_node = 0;
        while (s_first[src_node + 1] <= task)
            ++src_node;
        const int k = static_cast<int>(task - s_first[src_node]);
        const int source = src_node * kRanksPerNode + me_local;
        const int64_t range = p.landed_range[src_node * kMaxChunks + k];
        const int lo = static_cast<int>(range >> 32), hi = static_cast<int>(range & 0xffffffff);
        const int ch = channel_of(c, src_node, k);
        for (int i = lo; i < hi; ++i) {
            const int* meta = p.landed_meta + (static_cast<int64_t>(src_node) * p.meta_tokens + i) * kMetaWords;
            // Row of this token at each rank j of my node: its position among the source's rows to j,
            // after the rows of the sources before it there.
            for (int j = lane; j < kRanksPerNode; j += 32) {
                const int pos = meta[j];
                const int before = source > 0 ? p.rank_prefix_matrix[(source - 1) * kNumRanks + node * kRanksPerNode + j] : 0;
                s_rows[warp][j] = pos < 0 ? -1 : before + pos;
            }
            const int t = meta[kRanksPerNode];
            __syncwarp();
            char* partial = local<char>(c, p.partial_offset + (static_cast<int64_t>(src_node) * c.max_tokens + i) * kRowBytes);
            for (int w = lane; w < kHiddenInt4; w += 32) {
                float acc[8];
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    acc[e] = 0.0f;
                for (int j = 0; j < kRanksPerNode; ++j) {
                    const int row = s_rows[warp][j];
                    if (row >= 0)
                        add_bf16x8(acc, node_peer<const int4>(c, j, p.staging_offset + row * kRowBytes)[w]);
                }
                reinterpret_cast<int4*>(partial)[w] = pack_bf16x8(acc);
            }
            for (int kk = lane; kk < kNumTopk; kk += 32) {
                float acc = 0.0f;
                for (int j = 0; j < kRanksPerNode; ++j) {
                    const int row = s_rows[warp][j];
                    if (row >= 0)
                        acc = __fadd_rn(acc, node_peer<const float>(c, j, p.staging_offset + row * kRowBytes + kWeightsAt)[kk]);
                }
                reinterpret_cast<float*>(partial + kWeightsAt)[kk] = acc;
            }
            __threadfence_system();   // the partial is a put's source
            __syncwarp();             // and s_rows is rewritten by the next token
            c.transport.put_warp(ch, source, p.landing_offset + (static_cast<int64_t>(node) * c.max_tokens + t) * kRowBytes,
                                 partial, kRowBytes, lane);
        }
        __threadfence_system();
        __syncwarp();
        if (lane == 0)
            c.transport.signal(ch, source, c.combine_arrive_offset + chunk_slot(node, k), n);
        __syncwarp();
    }
    __threadfence_system();
    __syncwarp();
    if (lane == 0)
        for (int ch = 0; ch < c.num_channels; ++ch)
            c.transport.flush(ch);   // the partials are rewritten by a later op
}

__global__ void __launch_bounds__(kThreads) combine(const __grid_constant__ InternodeCombineParams p) {
    const Common& c = p.common;
    if (op_failed(c))
        return;
    const uint64_t n = current_op(c);
    const ErrorSink sink = sink_of(c, kOpCombine);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int me_local = my_local(c);
    __shared__ bool s_in[kWarps][kNumNodes];
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int chunks = num_chunks(static_cast<int>(p.num_tokens));
    const char* landing = local<const char>(c, p.landing_offset);
    // A warp per slice of kTokensPerTask tokens of a chunk (the warps of one chunk wait for the same signals).
    for (int64_t task = global_warp(); task < static_cast<int64_t>(chunks) * kTasksPerChunk; task += grid_warps()) {
        const int k = static_cast<int>(task / kTasksPerChunk);
        // Every landing rank signals every chunk of mine (with or without rows from its node).
        int ok = 1;
        for (int m = lane; m < kNumNodes; m += 32) {
            ErrorSink on_channel = sink;   // a timeout names the channel node m's partials travel on
            on_channel.channel = channel_of(c, my_node(c), k);
            if (!c.transport.wait_ge(c.combine_arrive_offset + chunk_slot(m, k), n, deadline, on_channel,
                                     m * kRanksPerNode + me_local))
                ok = 0;
        }
        ok = __all_sync(0xffffffffu, ok);
        __syncwarp();   // every lane reads every node's rows after the lanes' acquires
        if (!ok)
            return;
        const int64_t t_first = static_cast<int64_t>(k) * kChunkTokens + (task % kTasksPerChunk) * kTokensPerTask;
        const int64_t t_end = t_first + kTokensPerTask < p.num_tokens ? t_first + kTokensPerTask : p.num_tokens;
        for (int64_t t = t_first; t < t_end; ++t) {
            for (int m = lane; m < kNumNodes; m += 32) {
                bool in = false;
                for (int j = 0; j < kRanksPerNode && !in; ++j)
                    in = p.is_token_in_rank[t * kNumRanks + m * kRanksPerNode + j];
                s_in[warp][m] = in;
            }
            __syncwarp();
            // Rows in the oracle's order: bias_0, bias_1, then each node's partial, node ascending.
            const auto row_of = [&](int r) -> const int4* {
                if (r < 2) {
                    const int4* bias = r == 0 ? p.bias_0 : p.bias_1;
                    return bias == nullptr ? nullptr : bias + t * kHiddenInt4;
                }
                const int m = r - 2;
                return s_in[warp][m] ? reinterpret_cast<const int4*>(
                                           landing + (static_cast<int64_t>(m) * c.max_tokens + t) * kRowBytes)
                                     : nullptr;
            };
            for (int c0 = lane; c0 < kHiddenInt4; c0 += 32 * kColumns) {
                float acc[kColumns][8] = {};
                add_rows_bf16<kHiddenInt4, kColumns, kRowGroup>(acc, 2 + kNumNodes, row_of, c0);
#pragma unroll
                for (int u = 0; u < kColumns; ++u)
                    if (c0 + 32 * u < kHiddenInt4)
                        p.out[t * kHiddenInt4 + c0 + 32 * u] = pack_bf16x8(acc[u]);
            }
            for (int kk = lane; kk < kNumTopk && p.out_topk_weights != nullptr; kk += 32) {
                float acc = 0.0f;
                for (int m = 0; m < kNumNodes; ++m)
                    if (s_in[warp][m])
                        acc = __fadd_rn(acc, reinterpret_cast<const float*>(
                                                 landing + (static_cast<int64_t>(m) * c.max_tokens + t) * kRowBytes + kWeightsAt)[kk]);
                p.out_topk_weights[t * kNumTopk + kk] = acc;
            }
            __syncwarp();   // s_in is rewritten by the next token
        }
    }
    end_op(c, n);
}

}  // namespace deepep_portable::internode
