// Internode dispatch (docs/INTERNODE.md; protocol.cuh for words, the handshake and deadlock freedom).
// Four kernels on the Buffer's stream, op n:
//
//   notify_counts   block 0: my counts (per rank, per node, token count, per expert of the receiver)
//                     go to every rank as a put-with-signal on HS[me] = n: the handshake; it waits for
//                     every rank's, then writes the rank prefix matrix and, with host_out, hands the
//                     host my receive count. Other blocks scan is_token_in_rank into send positions
//                     (per rank) and landing slots (per node) and each chunk's running row count.
//   send_tokens       a warp per chunk of kChunkTokens of my tokens: each token's row is staged once
//                     in my window (a NIC reads only registered memory), then put to its landing slot at
//                     every destination node, the meta (destination positions in that node + source
//                     token) beside it; then one signal per (node, chunk): ARRIVE = stamp(n, rows so far).
//                     Nothing here waits: the handshake already freed every landing area.
//   forward_arrivals  the landing role: a warp per (source node, chunk) waits for ARRIVE in my window,
//                     copies the slots' meta into the handle (what the combine needs), and republishes
//                     the chunk to my node as FORWARD = stamp(n, hi) with the slot range beside it
//                     (a release store after the acquire: node peers never read a network signal
//                     themselves, only mine, so no third-party visibility is assumed of a NIC write).
//   dispatch          the pull: a warp per (source rank, chunk) waits for FORWARD at the landing rank
//                     of my node (NVLink), then copies each slot whose meta names me to
//                     recv_x[prefix[source] + position]: rows ordered by global source rank, then
//                     source token. Also the handle's send_rows and the padding rows.
//
// Compile-time (-D): NUM_RANKS, RANKS_PER_NODE, HIDDEN_BYTES (payload bytes per token, multiple of 16),
// NUM_SCALES (4-byte scale words, 0 for BF16), NUM_TOPK (0: no top-k, e.g. a cached dispatch).
#include <cstdint>

#include "common/kernels/block_scan.cuh"
#include "common/kernels/common.cuh"
#include "common/kernels/internode/dispatch_params.cuh"
#include "common/kernels/internode/protocol.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"

using namespace deepep_portable;
using namespace deepep_portable::internode;

namespace {

DEEPEP_DEVICE int64_t global_warp() { return static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; }
DEEPEP_DEVICE int64_t grid_warps() { return static_cast<int64_t>(gridDim.x) * kWarps; }

// Block 0 of notify_counts: my counts by rank and node, from is_token_in_rank (the bits the scan turns
// into positions, so counts and positions cannot disagree), into s_count[R + M].
DEEPEP_DEVICE void count_my_tokens(const InternodeDispatchParams& p, int* s_count) {
    const int lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < kNumRanks + kNumNodes; i += blockDim.x)
        s_count[i] = 0;
    __syncthreads();
    for (int64_t base = (threadIdx.x / 32) * 32; base < p.num_tokens; base += kThreads) {
        const int64_t t = base + lane;
        const bool valid = t < p.num_tokens;
        for (int m = 0; m < kNumNodes; ++m) {
            bool any = false;
            for (int j = 0; j < kRanksPerNode; ++j) {
                const int r = m * kRanksPerNode + j;
                const bool in = valid && p.is_token_in_rank[t * kNumRanks + r];
                const int cnt = __popc(__ballot_sync(0xffffffffu, in));
                if (lane == 0 && cnt != 0)
                    atomicAdd(s_count + r, cnt);
                any = any || in;
            }
            const int cnt = __popc(__ballot_sync(0xffffffffu, any));
            if (lane == 0 && cnt != 0)
                atomicAdd(s_count + kNumRanks + m, cnt);
        }
    }
    __syncthreads();
}

// Block 0 of notify_counts, after the handshake: what every rank sent me.
DEEPEP_DEVICE void publish_counts(const InternodeDispatchParams& p, uint64_t n) {
    const Common& c = p.common;
    const int me = static_cast<int>(c.rank);
    for (int j = threadIdx.x; j < kNumRanks; j += blockDim.x) {
        int acc = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            acc += counts_of(c, n, s)[j];
            if (p.rank_prefix_matrix != nullptr)
                p.rank_prefix_matrix[s * kNumRanks + j] = acc;
        }
    }
    const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
    for (int e = threadIdx.x; e < experts_per_rank && p.host_out != nullptr; e += blockDim.x) {
        int count = 0;
        for (int s = 0; s < kNumRanks; ++s)
            count += counts_of(c, n, s)[kCountExpertsAt + e];
        p.host_out[3 + e] = align_up<int>(count, static_cast<int>(p.expert_alignment));
    }
    // num_worst_tokens / a cached handle fixed a rank's receive rows up front, and its count message says
    // how many (ranks differ: a cached handle holds that rank's own count). Every rank checks every rank
    // (each holds the whole matrix), so all fail this op together instead of one rank later.
    for (int j = threadIdx.x; j < kNumRanks; j += blockDim.x) {
        const int capacity = counts_of(c, n, j)[kCountCapacityAt];
        int rows = 0;
        for (int s = 0; s < kNumRanks; ++s)
            rows += counts_of(c, n, s)[j];
        if (capacity > 0 && rows > capacity)
            report_error(sink_of(c, kOpDispatch), kErrorCapacity, j, rows);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int num_recv = 0, most_call_tokens = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            num_recv += counts_of(c, n, s)[me];
            most_call_tokens = max(most_call_tokens, counts_of(c, n, s)[kCountCallTokensAt]);
        }
        if (p.num_recv_out != nullptr)
            *p.num_recv_out = num_recv;
        if (p.host_out != nullptr) {
            volatile int* host = p.host_out;
            host[1] = num_recv;
            host[2] = most_call_tokens;   // every rank reads the same: how many rounds the call takes
            __threadfence_system();
            host[0] = 1;   // the host reset it before the launch
            __threadfence_system();
        }
    }
}

// One column of is_token_in_rank (a rank, col < R) or of its per-node OR (node col - R), scanned by a
// whole block in token order: positions, and for nodes the running count at each chunk's end.
DEEPEP_DEVICE void scan_column(const InternodeDispatchParams& p, int col) {
    const bool is_node = col >= kNumRanks;
    const int m = col - kNumRanks;
    int carry = 0;
    for (int64_t base = 0; base < p.num_tokens; base += kThreads) {
        const int64_t t = base + threadIdx.x;
        bool sent = false;
        if (t < p.num_tokens) {
            if (!is_node) {
                sent = p.is_token_in_rank[t * kNumRanks + col];
            } else {
                for (int j = 0; j < kRanksPerNode && !sent; ++j)
                    sent = p.is_token_in_rank[t * kNumRanks + m * kRanksPerNode + j];
            }
        }
        const int pos = block_running_count<kWarps>(sent, carry);
        if (t < p.num_tokens) {
            if (!is_node) {
                p.send_pos[t * kNumRanks + col] = sent ? pos : -1;
            } else {
                p.node_pos[t * kNumNodes + m] = sent ? pos : -1;
                if (t % kChunkTokens == kChunkTokens - 1 || t == p.num_tokens - 1)
                    p.chunk_end[(t / kChunkTokens) * kNumNodes + m] = pos + (sent ? 1 : 0);
            }
        }
    }
}

}  // namespace

namespace deepep_portable::internode {

__global__ void __launch_bounds__(kThreads) notify_counts(const __grid_constant__ InternodeDispatchParams p) {
    const Common& c = p.common;
    const uint64_t n = begin_op(c);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int me = static_cast<int>(c.rank);
    if (blockIdx.x == 0) {
        __shared__ int s_count[kNumRanks + kNumNodes];
        count_my_tokens(p, s_count);
        const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
        const int64_t words = c.count_words;
        for (int r = warp; r < kNumRanks; r += kWarps) {
            int* msg = local<int>(c, c.count_out_offset + 4 * r * words);
            for (int i = lane; i < words; i += 32) {
                int v = 0;
                if (i < kCountTokensAt)
                    v = s_count[i];
                else if (i == kCountTokensAt)
                    v = static_cast<int>(p.num_tokens);
                else if (i == kCountCapacityAt)
                    v = static_cast<int>(p.max_recv_rows);
                else if (i == kCountCallTokensAt)
                    v = static_cast<int>(p.call_tokens);
                else if (i - kCountExpertsAt < experts_per_rank && p.num_tokens_per_expert != nullptr)
                    v = p.num_tokens_per_expert[r * experts_per_rank + i - kCountExpertsAt];
                msg[i] = v;
            }
            __threadfence_system();   // the message is a put's source: written before a NIC reads it
            __syncwarp();
            const int64_t dst = c.counts_offset + 4 * ((static_cast<int64_t>(n % 2) * kNumRanks + me) * words);
            c.transport.put_signal_warp(0, r, dst, msg, 4 * words, c.hs_offset + 8 * me, n, lane);
        }
        __threadfence_system();
        __syncwarp();
        if (lane == 0)
            c.transport.flush(0);   // my count messages may be rewritten by the next dispatch
        if (!await_handshake(c, n, sink_of(c, kOpDispatch)))
            return;
        publish_counts(p, n);
    }
    // Columns: ranks 0..R-1, then nodes; block 0 takes none while others exist (it waits on the handshake).
    const int first = gridDim.x > 1 ? 1 : 0, blocks = gridDim.x > 1 ? gridDim.x - 1 : 1;
    if (static_cast<int>(blockIdx.x) >= first)
        for (int col = blockIdx.x - first; col < kNumRanks + kNumNodes; col += blocks)
            scan_column(p, col);
}

__global__ void __launch_bounds__(kThreads) send_tokens(const __grid_constant__ InternodeDispatchParams p) {
    const Common& c = p.common;
    if (op_failed(c))
        return;
    const uint64_t n = current_op(c);
    const int lane = threadIdx.x % 32;
    const int node = my_node(c), me_local = my_local(c);
    const int chunks = num_chunks(static_cast<int>(p.num_tokens));
    char* staging = local<char>(c, p.staging_offset);
    int* meta_staging = local<int>(c, p.meta_staging_offset);
    constexpr int kScalesPerLane = (kNumScales + 31) / 32;
    for (int k = static_cast<int>(global_warp()); k < chunks; k += static_cast<int>(grid_warps())) {
        const int64_t t_end = static_cast<int64_t>(k + 1) * kChunkTokens < p.num_tokens
                                  ? static_cast<int64_t>(k + 1) * kChunkTokens : p.num_tokens;
        for (int64_t t = static_cast<int64_t>(k) * kChunkTokens; t < t_end; ++t) {
            char* body = staging + t * kBodyBytes;
            transport::warp_copy_bytes(body, p.x + t * (kHiddenBytes / 16), kHiddenBytes, lane);
#pragma unroll
            for (int u = 0; u < kScalesPerLane; ++u) {
                const int i = lane + 32 * u;
                if (i < kNumScales)
                    reinterpret_cast<int*>(body + kScalesAt)[i] =
                        p.x_scales[t * p.scale_token_stride + i * p.scale_hidden_stride];
            }
            if constexpr (kNumTopk > 0) {
                for (int i = lane; i < kNumTopk && p.topk_idx != nullptr; i += 32) {
                    reinterpret_cast<int*>(body + kTopkIdxAt)[i] = static_cast<int>(p.topk_idx[t * kNumTopk + i]);
                    reinterpret_cast<float*>(body + kTopkWeightsAt)[i] = p.topk_weights[t * kNumTopk + i];
                }
            }
            for (int m = 0; m < kNumNodes; ++m) {
                if (p.node_pos[t * kNumNodes + m] < 0)
                    continue;
                int* meta = meta_staging + (t * kNumNodes + m) * (kMetaBytes / 4);
                for (int i = lane; i < kMetaWords; i += 32)
                    meta[i] = i < kRanksPerNode ? p.send_pos[t * kNumRanks + m * kRanksPerNode + i] : static_cast<int>(t);
            }
            __threadfence_system();   // staged rows are puts' sources (a NIC, or other lanes, read them)
            __syncwarp();
            for (int m = 0; m < kNumNodes; ++m) {
                const int pos = p.node_pos[t * kNumNodes + m];
                if (pos < 0)
                    continue;
                const int landing = m * kRanksPerNode + me_local;
                const int64_t slot = p.landing_offset + (static_cast<int64_t>(node) * c.max_tokens + pos) * kSlotBytes;
                const int ch = channel_of(c, m, k);
                c.transport.put_warp(ch, landing, slot, body, kBodyBytes, lane);
                c.transport.put_warp(ch, landing, slot + kBodyBytes, meta_staging + (t * kNumNodes + m) * (kMetaBytes / 4),
                                     kMetaBytes, lane);
            }
        }
        // Every chunk is signalled to every node, with no rows too: the landing rank waits for each.
        __threadfence_system();
        __syncwarp();
        if (lane == 0)
            for (int m = 0; m < kNumNodes; ++m)
                c.transport.signal(channel_of(c, m, k), m * kRanksPerNode + me_local,
                                   c.arrive_offset + chunk_slot(node, k),
                                   stamp(n, static_cast<uint32_t>(p.chunk_end[k * kNumNodes + m])));
        __syncwarp();
    }
    // Staged rows are rewritten by the next op: every put must have read them.
    __threadfence_system();
    __syncwarp();
    if (lane == 0)
        for (int ch = 0; ch < c.num_channels; ++ch)
            c.transport.flush(ch);
}

__global__ void __launch_bounds__(kThreads) forward_arrivals(const __grid_constant__ InternodeDispatchParams p) {
    const Common& c = p.common;
    if (op_failed(c))
        return;
    const uint64_t n = current_op(c);
    const ErrorSink sink = sink_of(c, kOpDispatch);
    const int lane = threadIdx.x % 32;
    const int me_local = my_local(c);
    // Tasks: (source node, chunk) for every chunk of the source (node, my local index), whose tokens land here.
    __shared__ int s_first[kNumNodes + 1];
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int m = 0; m < kNumNodes; ++m) {
            s_first[m] = acc;
            const int chunks = num_chunks(counts_of(c, n, m * kRanksPerNode + me_local)[kCountTokensAt]);
            if (blockIdx.x == 0)
                p.landed_chunks[m] = chunks;
            acc += chunks;
        }
        s_first[kNumNodes] = acc;
    }
    __syncthreads();
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    for (int64_t task = global_warp(); task < s_first[kNumNodes]; task += grid_warps()) {
        int src_node = 0;
        while (s_first[src_node + 1] <= task)
            ++src_node;
        const int k = static_cast<int>(task - s_first[src_node]);
        const int source = src_node * kRanksPerNode + me_local;
        ErrorSink on_channel = sink;   // a timeout names the channel the chunk travels on (the sender's
        on_channel.channel = channel_of(c, my_node(c), k);   // channel_of(destination node, chunk))
        int ok = 1;
        uint32_t lo = 0, hi = 0;
        if (lane == 0) {
            ok = c.transport.wait_ge(c.arrive_offset + chunk_slot(src_node, k), stamp(n, 0), deadline, on_channel,
                                     source);
            if (ok && k > 0)
                ok = c.transport.wait_ge(c.arrive_offset + chunk_slot(src_node, k - 1), stamp(n, 0), deadline,
                                         on_channel, source);
            if (ok) {
                hi = stamp_count(*local<volatile uint64_t>(c, c.arrive_offset + chunk_slot(src_node, k)));
                lo = k > 0 ? stamp_count(*local<volatile uint64_t>(c, c.arrive_offset + chunk_slot(src_node, k - 1))) : 0;
            }
        }
        __syncwarp();   // the other lanes read the landed slots after lane 0's acquire
        ok = __shfl_sync(0xffffffffu, ok, 0);
        lo = __shfl_sync(0xffffffffu, lo, 0);
        hi = __shfl_sync(0xffffffffu, hi, 0);
        if (!ok)
            return;
        const char* slots = local<const char>(c, p.landing_offset + static_cast<int64_t>(src_node) * c.max_tokens * kSlotBytes);
        const int64_t words = static_cast<int64_t>(hi - lo) * kMetaWords;
        for (int64_t w = lane; w < words; w += 32) {
            const int64_t i = lo + w / kMetaWords;
            const int word = static_cast<int>(w % kMetaWords);
            p.landed_meta[(static_cast<int64_t>(src_node) * c.max_tokens + i) * kMetaWords + word] =
                reinterpret_cast<const int*>(slots + i * kSlotBytes + kBodyBytes)[word];
        }
        if (lane == 0) {
            const int64_t range = (static_cast<int64_t>(lo) << 32) | hi;
            p.landed_range[src_node * kMaxChunks + k] = range;
            *local<volatile int64_t>(c, c.range_offset + chunk_slot(src_node, k)) = range;
            __threadfence_system();
            st_release_sys(local<uint64_t>(c, c.forward_offset + chunk_slot(src_node, k)), stamp(n, hi));
        }
    }
    end_op(c, n);   // here, not in `dispatch`: the host launches this kernel with the first (protocol.cuh)
}

__global__ void __launch_bounds__(kThreads) dispatch(const __grid_constant__ InternodeDispatchParams p) {
    const Common& c = p.common;
    if (op_failed(c))
        return;
    const uint64_t n = current_op(c);
    const ErrorSink sink = sink_of(c, kOpDispatch);
    const int lane = threadIdx.x % 32;
    const int me = static_cast<int>(c.rank), node = my_node(c), me_local = my_local(c);
    // My rows from source s start at s_row[s]; the chunks of source s are tasks s_task[s] .. s_task[s+1]-1.
    __shared__ int s_row[kNumRanks + 1];
    __shared__ int s_task[kNumRanks + 1];
    if (threadIdx.x == 0) {
        int rows = 0, tasks = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            s_row[s] = rows;
            s_task[s] = tasks;
            rows += counts_of(c, n, s)[me];
            tasks += num_chunks(counts_of(c, n, s)[kCountTokensAt]);
        }
        s_row[kNumRanks] = rows;
        s_task[kNumRanks] = tasks;
    }
    __syncthreads();
    const int num_recv_all = s_row[kNumRanks];
    const int64_t num_recv = num_recv_all < p.max_recv_rows ? num_recv_all : p.max_recv_rows;
    if (blockIdx.x == 0 && threadIdx.x == 0 && num_recv_all > p.max_recv_rows)
        report_error(sink, kErrorCapacity, -1, num_recv_all);

    // The handle's send_rows: my rows at rank r start after those of ranks 0..me-1 there.
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         p.send_rows != nullptr && i < p.num_tokens * kNumRanks; i += threads) {
        const int r = static_cast<int>(i % kNumRanks);
        const int pos = p.send_pos[i];
        p.send_rows[i] = pos < 0 ? -1 : pos + (me > 0 ? p.rank_prefix_matrix[(me - 1) * kNumRanks + r] : 0);
    }
    // Padding rows (num_worst_tokens): zero payload and scales, no experts, no source.
    for (int64_t i = num_recv + global_warp(); i < p.max_recv_rows; i += grid_warps()) {
        for (int w = lane; w < kHiddenBytes / 16; w += 32)
            p.recv_x[i * (kHiddenBytes / 16) + w] = make_int4(0, 0, 0, 0);
        for (int w = lane; w < kNumScales && p.recv_scales != nullptr; w += 32)
            p.recv_scales[i * kNumScales + w] = 0;
        for (int w = lane; w < kNumTopk && p.recv_topk_idx != nullptr; w += 32) {
            p.recv_topk_idx[i * kNumTopk + w] = -1;
            p.recv_topk_weights[i * kNumTopk + w] = 0.0f;
        }
        if (lane == 0 && p.recv_src_idx != nullptr)
            p.recv_src_idx[i] = -1;
    }

    const int experts_per_rank = static_cast<int>(p.num_experts / kNumRanks);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    for (int64_t task = global_warp(); task < s_task[kNumRanks]; task += grid_warps()) {
        int s = 0;
        while (s_task[s + 1] <= task)
            ++s;
        const int k = static_cast<int>(task - s_task[s]);
        const int src_node = s / kRanksPerNode, landing_local = s % kRanksPerNode;
        ErrorSink on_channel = sink;   // the channel the chunk crossed the network on, to my node
        on_channel.channel = channel_of(c, node, k);
        int ok = 1;
        int64_t range = 0;
        if (lane == 0) {
            ok = deepep_portable::wait_ge(node_peer<const uint64_t>(c, landing_local, c.forward_offset + chunk_slot(src_node, k)),
                                          stamp(n, 0), deadline, on_channel, node * kRanksPerNode + landing_local);
            if (ok)
                range = *node_peer<const volatile int64_t>(c, landing_local, c.range_offset + chunk_slot(src_node, k));
        }
        __syncwarp();   // the other lanes read the landing rank's slots after lane 0's acquire
        ok = __shfl_sync(0xffffffffu, ok, 0);
        range = __shfl_sync(0xffffffffu, range, 0);
        if (!ok)
            return;
        const int lo = static_cast<int>(range >> 32), hi = static_cast<int>(range & 0xffffffff);
        const char* slots = node_peer<const char>(c, landing_local,
                                                  p.landing_offset + static_cast<int64_t>(src_node) * c.max_tokens * kSlotBytes);
        for (int g = lo; g < hi; g += 32) {
            int pos = -1, token = -1;
            if (g + lane < hi) {
                const int* meta = reinterpret_cast<const int*>(slots + static_cast<int64_t>(g + lane) * kSlotBytes + kBodyBytes);
                pos = meta[me_local];
                token = meta[kRanksPerNode];
            }
            unsigned int mine = __ballot_sync(0xffffffffu, pos >= 0);
            while (mine != 0) {
                const int b = __ffs(mine) - 1;
                mine &= mine - 1;
                const int64_t row = s_row[s] + __shfl_sync(0xffffffffu, pos, b);
                const int t = __shfl_sync(0xffffffffu, token, b);
                if (row >= p.max_recv_rows)
                    continue;   // reported above (capacity)
                const char* slot = slots + static_cast<int64_t>(g + b) * kSlotBytes;
                transport::warp_copy_bytes(p.recv_x + row * (kHiddenBytes / 16), slot, kHiddenBytes, lane);
                for (int w = lane; w < kNumScales && p.recv_scales != nullptr; w += 32)
                    p.recv_scales[row * kNumScales + w] = reinterpret_cast<const int*>(slot + kScalesAt)[w];
                for (int w = lane; w < kNumTopk && p.recv_topk_idx != nullptr; w += 32) {
                    const int id = reinterpret_cast<const int*>(slot + kTopkIdxAt)[w];
                    const int local_id = id - me * experts_per_rank;
                    const bool here = id >= 0 && local_id >= 0 && local_id < experts_per_rank;
                    p.recv_topk_idx[row * kNumTopk + w] = here ? local_id : -1;
                    p.recv_topk_weights[row * kNumTopk + w] =
                        here ? reinterpret_cast<const float*>(slot + kTopkWeightsAt)[w] : 0.0f;
                }
                if (lane == 0 && p.recv_src_idx != nullptr)
                    p.recv_src_idx[row] = t;
            }
        }
    }
}

}  // namespace deepep_portable::internode
