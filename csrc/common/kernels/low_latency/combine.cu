// Low-latency combine (see protocol.cuh for the buffer, the call counter and the signals).
//
//   ll_combine_send: one warp per (local expert e, source rank s) pair. The dispatch handle gives the
//       pair's rows (layout_range[e][s] = begin << 32 | count): x[e][begin + j] for j < count, in the
//       source's token order (dispatch packs them so). They go as ONE contiguous put to rows 0..count-1
//       of the global expert's combine receive slots at s, then s's combine signal of the expert is
//       SET to (seq << 32) | count (also for count 0). It never waits. With zero-copy, x already lies
//       in my buffer: same code, no copy. Its warps also fill my slot table for my receive kernel:
//       slot[t][k] = j such that row j of expert topk_idx[t][k] holds my token t (the number of my
//       tokens before t that selected that expert: the order the expert's rank sends them in).
//   ll_combine_recv: every block waits for the combine signals of all experts, then the warps share
//       (token, column chunk) items (a token alone would leave most warps idle: T is small)
//       and compute, per element in float32, acc = +0; for k ascending with topk_idx[t][k] != -1:
//       acc = acc + (float(row) * weight), product and sum each rounded (__fmul_rn/__fadd_rn: no FMA),
//       and stores bf16(acc): bit-identical to tests/oracle.py low_latency_combine.
//
// Why rows are packed per expert (row j, not row = token): a warp's rows leave as one contiguous
// write (one put over a network), on one or two pages. Page spread costs: a dispatch layout that
// gave each message of a warp its own page measured 2x slower on the H200 emulation.
//
// Compile-time (-D): HIDDEN (bf16 elements, multiple of 128), NUM_TOPK; the transport (selected_transport.cuh).
#include <cstdint>

#include "common/kernels/low_latency/protocol.cuh"

#ifndef HIDDEN
#error "low_latency/combine.cu needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "low_latency/combine.cu needs -DNUM_TOPK"
#endif

using namespace deepep_portable;
using namespace deepep_portable::low_latency;
using deepep_portable::fp8::kFp8Block;

namespace {
constexpr int kHidden = HIDDEN;
constexpr int kNumTopk = NUM_TOPK;
constexpr int kRowInt4 = kHidden * 2 / 16;
constexpr int kRowBytes = kHidden * 2;
constexpr int kTopkChunk = kNumTopk < 8 ? kNumTopk : 8;   // rows loaded together per column
static_assert(kHidden % kFp8Block == 0, "LL hidden must be a multiple of 128");
static_assert(kNumTopk >= 1 && kNumTopk <= 128, "bad top-k");
}  // namespace

struct LLCombineParams {
    Common c;
    // send
    const int4* x;                    // [E_local, R*T, HIDDEN] bf16
    const int* src_info;              // [E_local, R*T]
    const int64_t* layout_range;      // [E_local, R]
    int64_t expect_half;              // zero-copy: the half whose combine send area x is (-1: not zero-copy)
    // receive
    const int64_t* topk_idx;          // [N, NUM_TOPK]
    const float* topk_weights;        // [N, NUM_TOPK]
    int4* out;                        // [N, HIDDEN] bf16
    int64_t num_tokens;
    int64_t* wait_stats;              // [R] or null: clock64 cycles spent waiting per source rank
    int* slot_table;                  // [N, NUM_TOPK]: written by the send kernel, read by the receive kernel
};

extern "C" __global__ void __launch_bounds__(kThreads) ll_combine_send(const __grid_constant__ LLCombineParams p) {
    const Common& c = p.c;
    const Transport tr = c.transport;
    const Call call = begin_call(c, c.ctrl_sent, kTraceCombineSend, kKindCombine);
    const uint64_t seq = call.seq;
    const int half = static_cast<int>(seq & 1);
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    const int num_ranks = static_cast<int>(c.num_ranks);
    const int num_local = static_cast<int>(c.num_experts) / num_ranks;
    const int64_t slots = static_cast<int64_t>(num_ranks) * c.num_max_tokens;
    const int me = static_cast<int>(c.rank);
    if (p.expect_half >= 0 && p.expect_half != half && blockIdx.x == 0 && threadIdx.x == 0)
        // The host handed out the zero-copy buffer of the other half (e.g. a CUDA graph holding an odd
        // number of LL calls): x may overlap messages peers write. Report it; the data still moves.
        report_error(sink_of(c, kOpLowLatencyCombine), kErrorOverrun, -1, static_cast<int>(half));

    // My slot table (see the top of the file): one warp per expert scans my tokens in the order the
    // dispatch send kernel used (token_selects).
    for (int g = warp; g < static_cast<int>(c.num_experts); g += num_warps) {
        int count = 0;
        for (int64_t t0 = 0; t0 < p.num_tokens; t0 += 32) {
            const int64_t t = t0 + lane;
            const bool hit = token_selects<kNumTopk>(p.topk_idx, p.num_tokens, t, g);
            const uint32_t mask = __ballot_sync(0xffffffffu, hit);
            if (hit) {
                const int j = count + __popc(mask & ((1u << lane) - 1u));
                for (int k = 0; k < kNumTopk; ++k)   // every k naming g (a repeated expert shares the row)
                    if (p.topk_idx[t * kNumTopk + k] == g)
                        p.slot_table[t * kNumTopk + k] = j;
            }
            count += __popc(mask);
        }
    }

    for (int pair = warp; pair < num_local * num_ranks; pair += num_warps) {
        const int e = pair / num_ranks, s = pair % num_ranks;
        const int64_t range = p.layout_range[e * num_ranks + s];
        const int64_t begin = range >> 32, count = range & 0xffffffffll;
        const int g = me * num_local + e;
        const uint64_t recvd = lane == 0 ? peer_recvd(tr, c, s) : 0;   // checked below, before the signal
        const int4* src = p.x + (e * slots + begin) * kRowInt4;
        if (count > 0) {
            // A peer reached over a network reads the source with its NIC: x must then lie in my window.
            // Unless it does (zero-copy), the rows are first copied to their place in my combine send
            // area of this half (only this rank writes it; the previous call on this half finished its sends).
            if (p.expect_half < 0 && tr.template peer_ptr<char>(0, s) == nullptr) {
                int4* staged = own<int4>(c, c.combine_send_offset + half * c.data_half_stride) + (e * slots + begin) * kRowInt4;
                transport::warp_copy_bytes(staged, src, count * kRowBytes, lane);
                __threadfence_system();   // the NIC reads what the lanes just stored
                __syncwarp();
                src = staged;
            }
            tr.put_warp(0, s, combine_row_off(c, half, g, 0, kRowBytes), src, count * kRowBytes, lane);
        }
        __threadfence_system();
        __syncwarp();
        if (lane == 0) {
            check_overwrite(c, kOpLowLatencyCombine, recvd, call, s);
            tr.signal(0, s, combine_signal_off(c, half, g), signal_value(seq, static_cast<uint32_t>(count)));
        }
    }
    // x (or the staged rows) may be reused once the op returns: complete this warp's puts (one quiet
    // per warp, after its last signal; a no-op for load/store peers).
    if (lane == 0)
        tr.flush(0);
    end_call(c, c.ctrl_sent, c.ctrl_send_arrive, seq, kTraceCombineSend, kKindCombine);
}

extern "C" __global__ void __launch_bounds__(kThreads) ll_combine_recv(const __grid_constant__ LLCombineParams p) {
    const Common& c = p.c;
    const Transport tr = c.transport;
    const uint64_t seq = begin_call(c, c.ctrl_recvd, kTraceCombineRecv).seq;
    const int half = static_cast<int>(seq & 1);
    const ErrorSink sink = sink_of(c, kOpLowLatencyCombine);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int num_experts = static_cast<int>(c.num_experts);
    const int num_local = num_experts / static_cast<int>(c.num_ranks);

    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    // One warp per block polls (its lanes stride over the experts); the others wait at the barrier.
    // Polling with every thread multiplied the loads on the very lines the peers are signalling.
    for (int g = threadIdx.x; threadIdx.x < 32 && g < num_experts; g += 32) {
        const long long t_start = clock64();
        if (wait_signal(tr, c, combine_signal_off(c, half, g), seq, deadline, sink, g / num_local) < 0)
            s_ok = 0;
        else if (blockIdx.x == 0 && p.wait_stats != nullptr)
            atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + g / num_local),
                      static_cast<unsigned long long>(clock64() - t_start));
    }
    // Order every thread's reads of the rows after the acquires of the signals.
    __threadfence_system();
    __syncthreads();
    if (s_ok) {
        const int lane = threadIdx.x % 32;
        const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
        const int num_warps = gridDim.x * (kThreads / 32);
        // An item is (token, kCols x 32 16-byte columns): lane l reduces columns chunk + 32u + l. The
        // loads of every row and column of an item are issued together (kTopkChunk * kCols words per
        // lane): the reduction is bound by memory round trips, not by arithmetic.
        constexpr int kCols = 2;
        constexpr int kChunks = (kRowInt4 + 32 * kCols - 1) / (32 * kCols);
        for (int64_t item = warp; item < p.num_tokens * kChunks; item += num_warps) {
            const int64_t t = item / kChunks;
            const int col0 = static_cast<int>(item % kChunks) * 32 * kCols + lane;
            const int64_t* idx = p.topk_idx + t * kNumTopk;
            const float* w = p.topk_weights + t * kNumTopk;
            float acc[kCols][8];
#pragma unroll
            for (int u = 0; u < kCols; ++u)
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    acc[u][i] = 0.0f;
            for (int k0 = 0; k0 < kNumTopk; k0 += kTopkChunk) {
                int4 v[kTopkChunk][kCols];
                int64_t g[kTopkChunk];
#pragma unroll
                for (int r = 0; r < kTopkChunk; ++r)
                    g[r] = k0 + r < kNumTopk ? idx[k0 + r] : -1;
#pragma unroll
                for (int r = 0; r < kTopkChunk; ++r) {
                    if (g[r] < 0)
                        continue;
                    const int4* row = own<const int4>(
                        c, combine_row_off(c, half, static_cast<int>(g[r]), p.slot_table[t * kNumTopk + k0 + r], kRowBytes));
#pragma unroll
                    for (int u = 0; u < kCols; ++u)
                        if (col0 + 32 * u < kRowInt4)
                            v[r][u] = row[col0 + 32 * u];
                }
#pragma unroll
                for (int r = 0; r < kTopkChunk; ++r) {
                    if (g[r] < 0)
                        continue;   // the oracle adds +0.0 here, which never changes acc (acc is never -0.0)
                    const float weight = w[k0 + r];
#pragma unroll
                    for (int u = 0; u < kCols; ++u) {
                        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[r][u]);
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float2 f = __bfloat1622float2(h[i]);
                            acc[u][2 * i] = __fadd_rn(acc[u][2 * i], __fmul_rn(f.x, weight));
                            acc[u][2 * i + 1] = __fadd_rn(acc[u][2 * i + 1], __fmul_rn(f.y, weight));
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kCols; ++u) {
                if (col0 + 32 * u >= kRowInt4)
                    continue;
                int4 packed;
                __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    o[i] = __floats2bfloat162_rn(acc[u][2 * i], acc[u][2 * i + 1]);
                p.out[t * kRowInt4 + col0 + 32 * u] = packed;
            }
        }
    }
    end_call(c, c.ctrl_recvd, c.ctrl_recv_arrive, seq, kTraceCombineRecv);
}
