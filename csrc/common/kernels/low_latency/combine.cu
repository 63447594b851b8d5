// Low-latency combine (see protocol.cuh for the buffer, the call counter and the signals). The kernel
// `combine` is compiled once per phase (-DPHASE): the send kernel, then the receive kernel (launched
// right after it, or by the hook). Two launches beat one: a kernel holding both phases needed a barrier
// over its grid between them (the receive reads the slot table every block's send wrote) and one
// register allocation for both; on the H200 emulation (8 ranks, 128 tokens, graph-replayed) the two
// kernels took 126-128 us against 132-134 us. A one-launch form without that barrier (each block flags
// its part of the slot table, the receive waits for every block's flag after its signals) was slower
// too: 128.7-129.2 us against 119.3-119.8, although the two kernels leave a gap
// of ~8 us between them.
//
//   send: one warp per (local expert e, source rank s) pair. The dispatch handle gives the
//       pair's rows (layout_range[e][s] = begin << 32 | count): x[e][begin + j] for j < count, in the
//       source's token order (dispatch packs them so). They go as ONE contiguous put to rows 0..count-1
//       of the global expert's combine receive slots at s, then s's combine signal of the expert is
//       SET to signal_value(seq, count) (also for count 0). It never waits for a peer (x inside my dispatch
//       area: every signal waits for a barrier over my grid, see send_phase). With zero-copy, x already lies
//       in my buffer: same code, no copy. Then its warps fill my slot table for my receive phase:
//       slot[t][k] = j such that row j of expert topk_idx[t][k] holds my token t (the number of my
//       tokens before t that selected that expert: the order the expert's rank sends them in).
//   receive: every block waits for the combine signals of all experts, then the warps share
//       (token, column chunk) items (a token alone would leave most warps idle: T is small)
//       and compute, per element in float32, acc = +0; for k ascending with topk_idx[t][k] != -1:
//       acc = acc + (float(row) * weight), product and sum each rounded (__fmul_rn/__fadd_rn: no FMA),
//       and stores bf16(acc): bit-identical to tests/oracle.py low_latency_combine.
// LOGFMT=1 (use_logfmt=True): each row is encoded on the way out (logfmt.cuh: DeepEP's LogFMT-10, one
// row per put, straight into a load/store peer's slot) and decoded by the receive, whose items are
// then (token, LogFMT chunk); the reduction is the same. Rows sit logfmt Format::kRowBytes apart.
// Shrink mode: a masked source gets nothing; a masked expert owner is not waited for and its rows
// count as absent (as a -1 in topk_idx).
//
// Why rows are packed per expert (row j, not row = token): a warp's rows leave as one contiguous
// write (one put over a network), on one or two pages. Page spread costs: a dispatch layout that
// gave each message of a warp its own page measured 2x slower on the H200 emulation.
//
// Compile-time (-D): HIDDEN (bf16 elements, multiple of 128), NUM_TOPK, LOGFMT (0 / 1), PHASE (kPhaseSend /
// kPhaseRecv); the transport (selected_transport.cuh).
#include <cstdint>

#include "common/kernels/low_latency/logfmt.cuh"
#include "common/kernels/low_latency/protocol.cuh"

#ifndef HIDDEN
#error "low_latency/combine.cu needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "low_latency/combine.cu needs -DNUM_TOPK"
#endif
#ifndef LOGFMT
#error "low_latency/combine.cu needs -DLOGFMT (0 or 1)"
#endif
#if !defined(PHASE) || (PHASE != 1 && PHASE != 2)
#error "low_latency/combine.cu needs -DPHASE (1: send, 2: receive; protocol.cuh kPhaseSend / kPhaseRecv)"
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
constexpr bool kLogFmt = LOGFMT != 0;
constexpr int kLogFmtHidden = kLogFmt ? kHidden : 512;   // LOGFMT=0 never runs the LogFMT code: any valid shape
using LogFmt = logfmt::Format<kLogFmtHidden>;
constexpr int kSlotBytes = kLogFmt ? LogFmt::kRowBytes : kRowBytes;   // a combine receive (and staging) row
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
    int64_t x_in_dispatch_area;       // 1: x overlaps my dispatch area (e.g. recv_x itself): signal last
    // receive
    const int64_t* topk_idx;          // [N, NUM_TOPK]
    const float* topk_weights;        // [N, NUM_TOPK]
    int4* out;                        // [N, HIDDEN] bf16
    int64_t num_tokens;
    int64_t* wait_stats;              // [R] or null: per source rank, the clock64 cycles block 0 waited for
                                      // each of its experts' signals, summed (the waits run concurrently)
    int* slot_table;                  // [N, NUM_TOPK]: written by the send kernel, read by the receive kernel
};

namespace {

// My slot table (see the top of the file): one warp per expert scans my tokens in the order the
// dispatch's send phase used (token_selects).
DEEPEP_DEVICE void fill_slot_table(const LLCombineParams& p, int warp, int num_warps, int lane) {
    for (int g = warp; g < static_cast<int>(p.c.num_experts); g += num_warps) {
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
}

// The rows of one (e, s) pair to s: `count` rows from `src` into rows 0..count-1 of expert g's slots.
DEEPEP_DEVICE void send_rows(const LLCombineParams& p, const Transport& tr, int half, int e, int s, int g,
                             const int4* src, int64_t begin, int64_t count, int lane) {
    const Common& c = p.c;
    const int64_t slots = c.num_ranks * c.num_max_tokens;
    char* peer = tr.template peer_ptr<char>(0, s);
    if constexpr (kLogFmt) {
        // One row per put (rows have their own sizes). A load/store peer's slot is encoded into
        // directly; otherwise the row is encoded into my staging row, then put.
        for (int64_t j = 0; j < count; ++j) {
            const int64_t dst_off = combine_row_off(c, half, g, j, kSlotBytes);
            if (peer != nullptr) {
                logfmt::encode_row<kLogFmtHidden>(src + j * kRowInt4, peer + dst_off, lane);
            } else {
                char* staged = own<char>(c, c.combine_send_offset + half * c.data_half_stride) + (e * slots + begin + j) * kSlotBytes;
                const int bytes = logfmt::encode_row<kLogFmtHidden>(src + j * kRowInt4, staged, lane);
                __threadfence_system();   // the NIC reads what the lanes just stored
                __syncwarp();
                tr.put_warp(0, s, dst_off, staged, bytes, lane);
            }
        }
    } else {
        if (count == 0)
            return;
        // A peer reached over a network reads the source with its NIC: x must then lie in my window.
        // Unless it does (zero-copy), the rows are first copied to their place in my combine send
        // area of this half (only this rank writes it; the previous call on this half finished its sends).
        if (p.expect_half < 0 && peer == nullptr) {
            int4* staged = own<int4>(c, c.combine_send_offset + half * c.data_half_stride) + (e * slots + begin) * kRowInt4;
            transport::warp_copy_bytes(staged, src, count * kRowBytes, lane);
            __threadfence_system();   // the NIC reads what the lanes just stored
            __syncwarp();
            src = staged;
        }
        tr.put_warp(0, s, combine_row_off(c, half, g, 0, kRowBytes), src, count * kRowBytes, lane);
    }
}

// After the pair's rows (this warp's puts): s's combine signal of my expert e carries the count.
// `recvd`: s's RECVD as lane 0 read it (peer_recvd; checked before the signal, not in shrink mode: see
// dispatch.cu), read before the rows went so its latency overlaps them.
DEEPEP_DEVICE uint64_t recvd_of(const Transport& tr, const Common& c, int s, int lane) {
    return lane == 0 && c.mask == nullptr ? peer_recvd(tr, c, s) : ~0ull;
}

DEEPEP_DEVICE void signal_pair(const LLCombineParams& p, const Transport& tr, const Call& call, int e, int s,
                               int64_t count, uint64_t recvd, int lane) {
    const Common& c = p.c;
    const int g = static_cast<int>(c.rank) * (static_cast<int>(c.num_experts) / static_cast<int>(c.num_ranks)) + e;
    warp_stores_before_signal();
    if (lane == 0) {
        check_overwrite(c, kOpLowLatencyCombine, recvd, call, s);
        tr.signal(0, s, combine_signal_off(c, static_cast<int>(call.seq & 1), g),
                  signal_value(call.seq, static_cast<uint32_t>(count)));
    }
}

DEEPEP_DEVICE void send_phase(const LLCombineParams& p, const Transport& tr, const Call& call) {
    const Common& c = p.c;
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

    // x inside my dispatch area (recv_x passed back, or an expert that wrote it in place): a peer whose
    // combine receive is complete may start its next dispatch and reserve rows of that area that other
    // warps of mine are still reading for other ranks. So then no signal leaves before every warp of
    // the grid is done reading x (its puts flushed, a barrier over the grid).
    const bool signal_last = p.x_in_dispatch_area != 0;
    for (int pair = warp; pair < num_local * num_ranks; pair += num_warps) {
        const int e = pair / num_ranks, s = pair % num_ranks;
        if (__shfl_sync(0xffffffffu, lane == 0 && rank_masked(c, s), 0))
            continue;   // shrink mode: a masked rank is not sent to
        const int64_t range = p.layout_range[e * num_ranks + s];
        const int64_t begin = range >> 32, count = range & 0xffffffffll;
        const uint64_t recvd = signal_last ? 0 : recvd_of(tr, c, s, lane);
        send_rows(p, tr, half, e, s, me * num_local + e, p.x + (e * slots + begin) * kRowInt4, begin, count, lane);
        if (!signal_last)
            signal_pair(p, tr, call, e, s, count, recvd, lane);
    }
    // x (or the staged rows) may be reused once the op returns: complete this warp's puts (one quiet
    // per warp, after its last signal; a no-op for load/store peers).
    if (lane == 0)
        tr.flush(0);
    // Only my receive kernel, launched after this one, reads the slot table: filled after this warp's
    // rows and signals (with signal_last, after its rows; the signals then wait for the whole grid at the
    // barrier below, this fill included).
    fill_slot_table(p, warp, num_warps, lane);
    if (signal_last) {
        __syncwarp();
        // On a timeout (reported) the signals still go out: no peer is left waiting for this rank.
        grid_barrier(c, barrier_ticket(seq, 0), globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns),
                     kOpLowLatencyCombine);
        for (int pair = warp; pair < num_local * num_ranks; pair += num_warps) {
            const int e = pair / num_ranks, s = pair % num_ranks;
            if (!__shfl_sync(0xffffffffu, lane == 0 && rank_masked(c, s), 0))
                signal_pair(p, tr, call, e, s, p.layout_range[e * num_ranks + s] & 0xffffffffll,
                            recvd_of(tr, c, s, lane), lane);
        }
        if (lane == 0)
            tr.flush(0);
    }
}

// Shrink mode: which ranks this block counts as live, one bit each, snapshotted after its waits (the
// mask may still change under other blocks' timeouts: every lane of a warp must take the same branch
// around the warp-wide LogFMT decode, and every lane of a token the same rows).
__shared__ uint32_t s_live[kMaxShrinkRanks / 32];

DEEPEP_DEVICE void snapshot_live(const Common& c) {
    if (c.mask == nullptr)
        return;
    for (int w = threadIdx.x; w < (static_cast<int>(c.num_ranks) + 31) / 32; w += blockDim.x) {
        uint32_t bits = 0;
        for (int b = 0; b < 32 && 32 * w + b < c.num_ranks; ++b)
            bits |= rank_masked(c, 32 * w + b) ? 0u : 1u << b;
        s_live[w] = bits;
    }
}

// The rows one top-k entry contributes to: -1 when there are none (no expert, or a masked owner).
DEEPEP_DEVICE int64_t contributing(const Common& c, int64_t g, int num_local) {
    if (g < 0 || c.mask == nullptr)
        return g;
    const int owner = static_cast<int>(g / num_local);
    return (s_live[owner / 32] >> (owner % 32)) & 1u ? g : -1;
}

// acc += v * w, rounded twice (the oracle's order of operations).
DEEPEP_DEVICE void accumulate(float& acc, float v, float w) {
    acc = __fadd_rn(acc, __fmul_rn(v, w));
}

DEEPEP_DEVICE void store_bf16(int4* dst, const float* acc) {
    int4 packed;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    *dst = packed;
}

// bf16 rows: an item is (token, kCols x 32 16-byte columns): lane l reduces columns chunk + 32u + l.
// The loads of every row and column of an item are issued together (kTopkChunk * kCols words per
// lane): the reduction is bound by memory round trips, not by arithmetic.
DEEPEP_DEVICE void reduce_bf16(const LLCombineParams& p, int half, int warp, int num_warps, int lane) {
    const Common& c = p.c;
    const int num_local = static_cast<int>(c.num_experts / c.num_ranks);
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
                g[r] = k0 + r < kNumTopk ? contributing(c, idx[k0 + r], num_local) : -1;
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
                        accumulate(acc[u][2 * i], f.x, weight);
                        accumulate(acc[u][2 * i + 1], f.y, weight);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kCols; ++u)
            if (col0 + 32 * u < kRowInt4)
                store_bf16(p.out + t * kRowInt4 + col0 + 32 * u, acc[u]);
    }
}

// LogFMT rows: an item is (token, LogFMT chunk); lane l reduces the chunk's kLaneChannels channels it
// owns in the format (logfmt.cuh), decoding every contributing row's part.
DEEPEP_DEVICE void reduce_logfmt(const LLCombineParams& p, int half, int warp, int num_warps, int lane) {
    const Common& c = p.c;
    const int num_local = static_cast<int>(c.num_experts / c.num_ranks);
    for (int64_t item = warp; item < p.num_tokens * LogFmt::kChunks; item += num_warps) {
        const int64_t t = item / LogFmt::kChunks;
        const int chunk = static_cast<int>(item % LogFmt::kChunks);
        float acc[LogFmt::kLaneChannels];
#pragma unroll
        for (int i = 0; i < LogFmt::kLaneChannels; ++i)
            acc[i] = 0.0f;
        for (int k = 0; k < kNumTopk; ++k) {
            const int64_t g = contributing(c, p.topk_idx[t * kNumTopk + k], num_local);
            if (g < 0)
                continue;
            const char* row = own<const char>(c, combine_row_off(c, half, static_cast<int>(g), p.slot_table[t * kNumTopk + k], kSlotBytes));
            const logfmt::ChunkView view = logfmt::view_chunk<kLogFmtHidden>(row, chunk, lane);
            float v[LogFmt::kLaneChannels];
            logfmt::decode_lane<kLogFmtHidden>(row, view, lane, v);
            const float weight = p.topk_weights[t * kNumTopk + k];
#pragma unroll
            for (int i = 0; i < LogFmt::kLaneChannels; ++i)
                accumulate(acc[i], v[i], weight);
        }
        int4* out = p.out + t * kRowInt4 + (chunk * LogFmt::kChunk + lane * LogFmt::kLaneChannels) / 8;
#pragma unroll
        for (int u = 0; u < LogFmt::kLaneWords; ++u)
            store_bf16(out + u, acc + 8 * u);
    }
}

DEEPEP_DEVICE void receive_phase(const LLCombineParams& p, const Transport& tr, uint64_t seq) {
    const Common& c = p.c;
    const int half = static_cast<int>(seq & 1);
    const ErrorSink sink = sink_of(c, kOpLowLatencyCombine);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int num_experts = static_cast<int>(c.num_experts);
    const int num_local = num_experts / static_cast<int>(c.num_ranks);

    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    // Every thread of the block polls one expert (more than kThreads experts: a thread takes several, in
    // series): a thread's waits are serial (acquire loads do not overlap), so one warp polling 256 experts
    // made each lane acquire 8 signals one after another. Each signal line is still polled once per block
    // (several polls of one line, every thread on every expert, had multiplied the loads on the very lines
    // the peers are signalling).
    for (int g = threadIdx.x; g < num_experts; g += kThreads) {
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
    snapshot_live(c);
    __syncthreads();
    if (!s_ok)
        return;
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    if constexpr (kLogFmt)
        reduce_logfmt(p, half, warp, num_warps, lane);
    else
        reduce_bf16(p, half, warp, num_warps, lane);
}

}  // namespace

namespace deepep_portable::low_latency {

// The combine kernel of phase PHASE (see the top of the file).
__global__ void __launch_bounds__(kThreads) combine(const __grid_constant__ LLCombineParams p) {
    static_assert(PHASE == kPhaseSend || PHASE == kPhaseRecv, "one phase per combine kernel");
    const Common& c = p.c;
    const Transport tr = c.transport;
    wait_previous_grid();   // a programmatic launch: nothing of the previous kernel is read before
    if constexpr (PHASE == kPhaseSend) {
        const Call call = begin_call(c, c.ctrl_sent, kTraceCombineSend, kKindCombine);
        send_phase(p, tr, call);
        end_call(c, c.ctrl_sent, c.ctrl_send_arrive, call.seq, kTraceCombineSend, kKindCombine, /*last_phase=*/true);
    } else {
        const uint64_t seq = begin_call(c, c.ctrl_recvd, kTraceCombineRecv).seq;
        receive_phase(p, tr, seq);
        end_call(c, c.ctrl_recvd, c.ctrl_recv_arrive, seq, kTraceCombineRecv, kNoKind, /*last_phase=*/true);
    }
}

}  // namespace deepep_portable::low_latency
