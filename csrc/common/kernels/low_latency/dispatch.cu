// Low-latency dispatch (see protocol.cuh for the buffer, the call counter and the signals).
//
// Three phases, written once as device functions and put together by three kernels:
//   stage:   one warp per token (or per part of a token: a decode batch has fewer tokens than warps)
//            builds its message once in my send stage (header: source token; payload: the bf16 row,
//            or the FP8 cast of it and its float32 scales), however many experts selected it (a token
//            goes to up to top-k experts: casting per expert would repeat the work).
//   send:    one warp per global expert g (experts strided over every warp of the grid). The warp
//            scans my tokens in order (32 at a time, __ballot_sync on "token lists g"), so the k-th
//            token of mine that selected g goes to slot k of (g's local expert, me) at g's rank:
//            deterministic, packed, in source-token order. It copies each staged message straight
//            into the receiver's buffer, then SETs the (local expert, me) signal to
//            (seq << 32) | count, also when count is 0. It never waits for a peer (the stage
//            barrier before it waits for the rank's own blocks only).
//   receive: one warp per (local expert e, source s) pair. Its lanes wait for the signals of sources
//            0..s of expert e (the rows of s start after those of sources < s), then the warp copies
//            s's messages out of my buffer into recv_x / scales (column-major) / src_info and writes
//            layout_range[e][s]; the pair with s = R-1 writes recv_count[e] and the stats.
// Stage and send are separated by a barrier over my grid (stage_barrier), not by a kernel boundary:
// one launch and no gap between them. Kernels:
//   ll_dispatch_send: stage + send (the send phase of a call with return_recv_hook=True);
//   ll_dispatch_recv: receive (launched by the hook);
//   ll_dispatch:      stage + send + receive in one launch (calls without a hook): a block moves on to
//                     its receive pairs once its warps' sends are out, while peers are still sending.
// Grids spin (stage barrier, receive waits), so every block of every rank sharing the GPU must be
// resident at once: the host caps the grid accordingly (Window.grid).
//
// Compile-time (-D): HIDDEN (bf16 elements, multiple of 128), NUM_TOPK, DEEPEP_TRANSPORT_*.
// Run-time: ranks, experts, T, FP8 flags.
#include <cstdint>

#include "common/kernels/low_latency/protocol.cuh"

#ifndef HIDDEN
#error "low_latency/dispatch.cu needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "low_latency/dispatch.cu needs -DNUM_TOPK"
#endif

using namespace deepep_portable;
using namespace deepep_portable::low_latency;

namespace {
constexpr int kHidden = HIDDEN;
constexpr int kNumTopk = NUM_TOPK;
constexpr int kNumScales = kHidden / kFp8Block;
constexpr int kRowInt4 = kHidden * 2 / 16;      // bf16 row in 16-byte words
constexpr int kFp8RowInt4 = kHidden / 16;       // fp8 row in 16-byte words
constexpr int kScalesPerLane = (kNumScales + 31) / 32;       // float32 scales each lane moves
constexpr int kWordsPerLane = kNumScales >= 4 ? (kNumScales / 4 + 31) / 32 : 1;  // UE8M0 words (4 scales) per lane
static_assert(kHidden % kFp8Block == 0, "LL hidden must be a multiple of 128");
static_assert(kNumTopk >= 1 && kNumTopk <= 128, "bad top-k");
}  // namespace

struct LLDispatchParams {
    Common c;
    // send
    const int4* x;                    // [N, HIDDEN] bf16
    const int64_t* topk_idx;          // [N, NUM_TOPK], -1 = none
    int64_t num_tokens;
    int64_t use_fp8;
    int64_t round_scale;
    int64_t send_stage_offset;        // my send stage: [T] messages
    int64_t ctrl_stage_arrive;        // u32 in my control area: blocks past the stage phase of this call
    int64_t ctrl_staged;              // u64 in my control area: the last call whose stage phase is complete
    // receive
    int4* recv_x;                     // [E_local, R*T, HIDDEN] bf16 or fp8
    void* recv_scales;                // fp32 [E_local][S][R*T] or int32 [E_local][S/4][R*T] (column-major views)
    int* src_info;                    // [E_local, R*T]
    int64_t* layout_range;            // [E_local, R]
    int* recv_count;                  // [E_local]
    int* cumulative_recv_stats;       // [E_local] or null
    int64_t* wait_stats;              // [R] or null: clock64 cycles spent waiting per source
    int64_t use_ue8m0;
};

namespace {

// FP8 cast of 128-channel blocks [b_begin, b_end) of one bf16 row by a warp (b_begin even): lanes
// 0-15 handle block b, lanes 16-31 block b+1; each lane 8 channels (one 16-byte word). Writes the
// blocks' fp8 bytes into `data` (the row's H bytes) and their float32 scales into `scales` (S).
// The loads of kBatch block pairs are issued together (the stores in between would otherwise keep
// the compiler from hoisting them: one memory round trip per pair).
DEEPEP_DEVICE void cast_row_fp8(const int4* __restrict__ row, char* __restrict__ data, float* __restrict__ scales,
                                bool round_scale, int lane, int b_begin, int b_end) {
    constexpr int kBatch = 8;
    const int half = lane / 16, l16 = lane % 16;
    for (int b0 = b_begin; b0 < b_end; b0 += 2 * kBatch) {
        int4 raw[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int b = b0 + 2 * u + half;
            raw[u] = b < b_end ? row[b * 16 + l16] : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            if (b0 + 2 * u >= b_end)
                break;   // uniform over the warp: the shuffles below stay converged
            const int b = b0 + 2 * u + half;
            const bool active = b < b_end;
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
            float f[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 v = __bfloat1622float2(h[i]);
                f[2 * i] = v.x;
                f[2 * i + 1] = v.y;
            }
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
            for (int off = 8; off >= 1; off /= 2)
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));   // stays within each 16-lane half
            const float scale = fp8_scale(amax, round_scale);
            if (active) {
                uint2 out;
                out.x = static_cast<uint32_t>(fp8x2(f[0], f[1], scale)) | (static_cast<uint32_t>(fp8x2(f[2], f[3], scale)) << 16);
                out.y = static_cast<uint32_t>(fp8x2(f[4], f[5], scale)) | (static_cast<uint32_t>(fp8x2(f[6], f[7], scale)) << 16);
                reinterpret_cast<uint2*>(data + b * kFp8Block)[l16] = out;
                if (l16 == 0)
                    scales[b] = scale;
            }
        }
    }
}

// Bytes of a message that carry data (header + payload [+ scales]), a multiple of 16.
DEEPEP_DEVICE int64_t message_used_bytes(bool use_fp8) {
    return kMsgHeader + (use_fp8 ? align_up<int64_t>(kHidden + kNumScales * 4, 16) : kRowInt4 * 16);
}

}  // namespace

namespace {

// Stage phase: my tokens' messages into my send stage (see the top of the file).
DEEPEP_DEVICE void stage_tokens(const LLDispatchParams& p) {
    const Common& c = p.c;
    const int lane = threadIdx.x % 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    // A decode batch has fewer tokens than warps: split each row over up to kMaxParts warps, so a
    // warp waits for fewer serial rounds of loads (a part is a range of 128-channel block pairs).
    constexpr int kMaxParts = 4;
    constexpr int kPairs = (kNumScales + 1) / 2;
    const int64_t spare = p.num_tokens > 0 ? num_warps / p.num_tokens : 1;
    const int parts = static_cast<int>(spare < 1 ? 1 : (spare > kMaxParts ? kMaxParts : spare));
    const int pairs_per_part = (kPairs + parts - 1) / parts;
    for (int64_t item = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; item < p.num_tokens * parts; item += num_warps) {
        const int64_t t = item / parts;
        const int part = static_cast<int>(item % parts);
        const int b_begin = min(kNumScales, 2 * part * pairs_per_part);
        const int b_end = min(kNumScales, 2 * (part + 1) * pairs_per_part);
        char* msg = own<char>(c, p.send_stage_offset + t * c.msg_bytes);
        const int4* row = p.x + t * kRowInt4;
        if (lane == 0 && part == 0)
            *reinterpret_cast<int*>(msg) = static_cast<int>(t);
        if (p.use_fp8)
            cast_row_fp8(row, msg + kMsgHeader, reinterpret_cast<float*>(msg + kMsgHeader + kHidden), p.round_scale != 0,
                         lane, b_begin, b_end);
        else   // a 128-channel block is 16 words of bf16
            transport::warp_copy_bytes(msg + kMsgHeader + b_begin * 256, row + b_begin * 16, (b_end - b_begin) * 256, lane);
    }
}

// Every block of my grid waits here until all of them have staged their tokens (the send phase
// reads messages other blocks built). The last block to arrive re-arms the arrival word and
// publishes STAGED = seq with a release; the others acquire-poll it (seq grows every call: no reset,
// no ABA). The blocks are co-resident (see the top of the file), so the wait ends; it is bounded
// anyway. System scope: a network put's NIC reads the stage. False (reported) on timeout.
DEEPEP_DEVICE bool stage_barrier(const LLDispatchParams& p, uint64_t seq, uint64_t deadline) {
    const Common& c = p.c;
    __shared__ int s_ok;
    __syncthreads();   // every thread of the block has staged
    if (threadIdx.x == 0) {
        s_ok = 1;
        uint64_t* staged = own<uint64_t>(c, p.ctrl_staged);
        if (arrive_last(c, p.ctrl_stage_arrive))
            st_release_sys(staged, seq);
        else if (!wait_ge(staged, seq, deadline, sink_of(c, kOpDispatch), static_cast<int>(c.rank)))
            s_ok = 0;
    }
    __syncthreads();
    return s_ok != 0;
}

// Send phase of call `call` (see the top of the file). `ok`: the stage barrier passed; when it did
// not (reported), the messages are not trusted and not sent, but every signal is still set with
// count 0 so no peer is left waiting for this rank.
DEEPEP_DEVICE void send_messages(const LLDispatchParams& p, const Transport& tr, const Call& call, bool ok) {
    const Common& c = p.c;
    const uint64_t seq = call.seq;
    const int half = static_cast<int>(seq & 1);
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    const int num_experts = static_cast<int>(c.num_experts);
    const int num_local = num_experts / static_cast<int>(c.num_ranks);
    const int me = static_cast<int>(c.rank);
    const int64_t used_bytes = message_used_bytes(p.use_fp8 != 0);

    for (int g = warp; g < num_experts; g += num_warps) {
        const int dst = g / num_local, local = g % num_local;
        const uint64_t recvd = lane == 0 ? peer_recvd(tr, c, dst) : 0;   // checked below, before the signal
        uint32_t count = 0;
        for (int64_t t0 = 0; ok && t0 < p.num_tokens; t0 += 32) {
            uint32_t mask = __ballot_sync(0xffffffffu, token_selects<kNumTopk>(p.topk_idx, p.num_tokens, t0 + lane, g));
            while (mask != 0) {
                const int j = __ffs(mask) - 1;
                mask &= mask - 1;
                const int64_t token = t0 + j;
                tr.put_warp(0, dst, dispatch_msg_off(c, half, local, me, count),
                            own<const char>(c, p.send_stage_offset + token * c.msg_bytes), used_bytes, lane);
                ++count;
            }
        }
        // Every lane's stores are ordered before lane 0's release (fence + warp barrier), as
        // put_signal_warp does: the receiver that reads the count sees the messages.
        __threadfence_system();
        __syncwarp();
        if (lane == 0) {
            check_overwrite(c, kOpDispatch, recvd, call, dst);
            tr.signal(0, dst, dispatch_signal_off(c, half, local, me), signal_value(seq, count));
        }
    }
    // The puts read my send stage, which the next dispatch's stage phase rewrites: complete this
    // warp's puts before the phase ends (one quiet per warp; a no-op for load/store peers).
    if (lane == 0)
        tr.flush(0);
}

// Receive phase of call `seq` (see the top of the file).
DEEPEP_DEVICE void receive_messages(const LLDispatchParams& p, const Transport& tr, uint64_t seq) {
    const Common& c = p.c;
    const int half = static_cast<int>(seq & 1);
    const ErrorSink sink = sink_of(c, kOpDispatch);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    const int num_ranks = static_cast<int>(c.num_ranks);
    const int num_local = static_cast<int>(c.num_experts) / num_ranks;
    const int64_t slots = static_cast<int64_t>(num_ranks) * c.num_max_tokens;

    for (int pair = warp; pair < num_local * num_ranks; pair += num_warps) {
        const int e = pair / num_ranks, s = pair % num_ranks;
        int64_t before = 0, mine = 0;
        bool ok = true;
        for (int s2 = lane; s2 <= s; s2 += 32) {
            const long long t_start = clock64();
            const int64_t n = wait_signal(tr, c, dispatch_signal_off(c, half, e, s2), seq, deadline, sink, s2);
            if (n < 0) {
                ok = false;
                continue;
            }
            if (s2 < s)
                before += n;
            else
                mine = n;
            if (s2 == s && p.wait_stats != nullptr)
                atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + s),
                          static_cast<unsigned long long>(clock64() - t_start));
        }
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) {
            before += __shfl_xor_sync(0xffffffffu, before, off);
            mine += __shfl_xor_sync(0xffffffffu, mine, off);
        }
        if (!__all_sync(0xffffffffu, ok))
            continue;   // reported; skip the copies
        // The lanes acquired the signals; order every lane's reads of the messages after them.
        __threadfence_system();
        __syncwarp();
        if (lane == 0) {
            p.layout_range[e * num_ranks + s] = (before << 32) | mine;
            if (s == num_ranks - 1) {
                const int total = static_cast<int>(before + mine);
                p.recv_count[e] = total;
                if (p.cumulative_recv_stats != nullptr)
                    p.cumulative_recv_stats[e] += total;
            }
        }
        for (int64_t j = 0; j < mine; ++j) {
            const char* msg = own<const char>(c, dispatch_msg_off(c, half, e, s, j));
            const int64_t row = before + j;
            // Every load of the message (header, scales, payload) is issued before the first store,
            // so a message costs one memory round trip per lane, not three.
            const int src_token = *reinterpret_cast<const int*>(msg);
            if (p.use_fp8) {
                const float* scales = reinterpret_cast<const float*>(msg + kMsgHeader + kHidden);
                float scale[kScalesPerLane];   // float32 scales: lane l holds scale l + 32u
                float4 quad[kWordsPerLane];    // UE8M0: lane l holds scales 4w..4w+3 of word w = l + 32u
                if (p.use_ue8m0) {
#pragma unroll
                    for (int u = 0; u < kWordsPerLane; ++u)
                        if (lane + 32 * u < kNumScales / 4)
                            quad[u] = reinterpret_cast<const float4*>(scales)[lane + 32 * u];
                } else {
#pragma unroll
                    for (int u = 0; u < kScalesPerLane; ++u)
                        if (lane + 32 * u < kNumScales)
                            scale[u] = scales[lane + 32 * u];
                }
                transport::warp_copy_bytes(reinterpret_cast<char*>(p.recv_x) + (e * slots + row) * kHidden,
                                           msg + kMsgHeader, kFp8RowInt4 * 16, lane);
                if (p.use_ue8m0) {
                    // One int32 per 4 scales: their exponent bytes, scale 4w + b in byte b.
                    int* out = static_cast<int*>(p.recv_scales) + static_cast<int64_t>(e) * (kNumScales / 4) * slots;
#pragma unroll
                    for (int u = 0; u < kWordsPerLane; ++u) {
                        if (lane + 32 * u >= kNumScales / 4)
                            continue;
                        const float v[4] = {quad[u].x, quad[u].y, quad[u].z, quad[u].w};
                        uint32_t word = 0;
#pragma unroll
                        for (int b = 0; b < 4; ++b)
                            word |= ((__float_as_uint(v[b]) >> 23) & 0xffu) << (8 * b);
                        out[(lane + 32 * u) * slots + row] = static_cast<int>(word);
                    }
                } else {
                    float* out = static_cast<float*>(p.recv_scales) + static_cast<int64_t>(e) * kNumScales * slots;
#pragma unroll
                    for (int u = 0; u < kScalesPerLane; ++u)
                        if (lane + 32 * u < kNumScales)
                            out[(lane + 32 * u) * slots + row] = scale[u];
                }
            } else {
                transport::warp_copy_bytes(p.recv_x + (e * slots + row) * kRowInt4, msg + kMsgHeader, kRowInt4 * 16, lane);
            }
            if (lane == 0)
                p.src_info[e * slots + row] = src_token;
        }
    }
}


// Stage + send of one call: the trace's stage span ends and its send span starts at the barrier.
DEEPEP_DEVICE void stage_and_send(const LLDispatchParams& p, const Transport& tr) {
    const Common& c = p.c;
    const Call call = begin_call(c, c.ctrl_sent, kTraceDispatchStage, kKindDispatch);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    stage_tokens(p);
    const bool ok = stage_barrier(p, call.seq, deadline);
    trace_mark(c.trace, call.seq, kTraceDispatchStage, true);
    trace_mark(c.trace, call.seq, kTraceDispatchSend, false);
    send_messages(p, tr, call, ok);
    end_call(c, c.ctrl_sent, c.ctrl_send_arrive, call.seq, kTraceDispatchSend, kKindDispatch);
}

DEEPEP_DEVICE void receive(const LLDispatchParams& p, const Transport& tr) {
    const Common& c = p.c;
    const uint64_t seq = begin_call(c, c.ctrl_recvd, kTraceDispatchRecv).seq;
    receive_messages(p, tr, seq);
    end_call(c, c.ctrl_recvd, c.ctrl_recv_arrive, seq, kTraceDispatchRecv);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) ll_dispatch_send(const __grid_constant__ LLDispatchParams p) {
    stage_and_send(p, make_transport(p.c.peer_bases, p.c.rank, p.c.num_ranks));
}

extern "C" __global__ void __launch_bounds__(kThreads) ll_dispatch_recv(const __grid_constant__ LLDispatchParams p) {
    receive(p, make_transport(p.c.peer_bases, p.c.rank, p.c.num_ranks));
}

// Without a hook the receive phase follows in the same launch: a warp's receive waits overlap the
// peers' (and my other warps') sends instead of starting after a kernel boundary. RECVD + 1 is this
// call (the host allows no hook-less op while a hook is pending), and a block reads RECVD before it
// can arrive at the receive phase's end (end_call), so the sequence numbers agree.
extern "C" __global__ void __launch_bounds__(kThreads) ll_dispatch(const __grid_constant__ LLDispatchParams p) {
    const Transport tr = make_transport(p.c.peer_bases, p.c.rank, p.c.num_ranks);
    stage_and_send(p, tr);
    receive(p, tr);
}
