// Low-latency dispatch (see protocol.cuh for the buffer, the call counter and the signals).
//
// Three phases, written once as device functions and put together by three kernels:
//   stage:   one warp per token (or per part of a token: a decode batch has fewer tokens than warps)
//            builds its message once in my send stage, however many experts selected it (a token goes
//            to up to top-k experts: casting per expert would repeat the work). A message is a side
//            message (int32 source token; with FP8 the token's float32 scales) followed by the payload
//            (the bf16 row, or its FP8 cast). Each block then sets its stage flag to the call number.
//   send:    one warp per global expert g (experts strided over every warp of the grid). The warp
//            scans my tokens in order (32 at a time, __ballot_sync on "token lists g"), so the k-th
//            token of mine that selected g is my k-th message for g, sent into g's rank's buffer; then
//            it SETs the (local expert, me) signal there to signal_value(seq, count), also for count 0.
//            It never waits for a peer, only for the stage flags of the blocks that staged its tokens.
//   receive: one warp per (local expert e, source s) pair: waits for s's signal, writes
//            layout_range[e][s] and the pair's rows of the outputs; the pair with s = R-1 also waits
//            for every other source and writes recv_count[e] and the stats.
// Where the payload lands, by the transport's kCheapFetchAdd (Placement below):
//   kReserveRows (fetch_add is cheap: nvshmem, and nvlink on its default VMM window): the send warp
//            first reserves `count` rows of g's recv_x at g's rank (fetch_add on the rank's reservation
//            word of g) and writes each payload straight into its row of recv_x (the tensor the op
//            returns is a view of it), the side message into side slot k of (g, me), then its block's
//            first row into my range word. The receive only unpacks side messages (source token,
//            scales): ~2 % of the bytes. Blocks sit in the order the reservations arrived (as in
//            DeepEP); layout_range says where.
//   kPackOnReceive (nvlink on a legacy CUDA IPC window, DEEPEP_PORTABLE_LL_VMM=0, where atomics are
//            slow): the whole message goes to slot k of (g, me), and the receive of (e, s) copies the
//            payloads into recv_x (a fresh tensor) after the rows of sources 0..s-1 (it waits for their
//            signals too): source order, but every payload is copied twice, which on the one-GPU
//            emulation is twice the HBM traffic.
// Stage and send are ordered by the stage flags, not by a kernel boundary or a barrier over my grid: one
// launch, and a warp sends as soon as its own tokens are staged (a grid barrier made every warp wait for
// the last block and its barrier, ~5 us past the first staged block on the H200 emulation). One kernel,
// `dispatch`, runs the phases its params name (protocol.cuh): stage + send (the send phase of a call with return_recv_hook=True), receive
// (launched by the hook), or all three in one launch (calls without a hook: a block moves on to its
// receive pairs once its warps' sends are out, while peers are still sending).
// Shrink mode: experts of a masked rank get nothing, a masked source's pairs count 0 rows.
// Grids spin (stage flags, receive waits), so every block of every rank sharing the GPU must be
// resident at once: the host caps the grid accordingly (Window.grid).
// Either way a source's rows of an expert are contiguous and in its token order (the combine relies on it).
//
// Compile-time (-D): see dispatch_params.cuh. Run-time: ranks, experts, T, FP8 flags.
#include <cstdint>

#include "common/kernels/low_latency/dispatch_params.cuh"

namespace {

// How many warps stage each token: a decode batch has fewer tokens than warps, so each row is split
// over up to kMaxParts warps, and a warp waits for fewer serial rounds of loads (a part is a range
// of 128-channel block pairs). Part q of token t is item t * parts + q, staged by warp item % warps.
constexpr int kMaxParts = 4;

DEEPEP_DEVICE int stage_parts(const LLDispatchParams& p) {
    const int64_t spare = p.num_tokens > 0 ? gridDim.x * (kThreads / 32) / p.num_tokens : 1;
    return static_cast<int>(spare < 1 ? 1 : (spare > kMaxParts ? kMaxParts : spare));
}

DEEPEP_DEVICE volatile uint64_t* stage_flag(const LLDispatchParams& p, int block) {
    return own<volatile uint64_t>(p.c, p.stage_flags_offset) + block;
}

// Stage phase: my tokens' messages into my send stage (see the top of the file). It does not depend on
// the call number: the caller reads that meanwhile (read_call), then, once every warp of the block has
// staged its items, sets the block's flag to the call (publish_staged). No barrier over the grid: a send
// warp waits only for the blocks that staged its tokens (wait_staged).
DEEPEP_DEVICE void stage_tokens(const LLDispatchParams& p) {
    const Common& c = p.c;
    const int lane = threadIdx.x % 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    constexpr int kPairs = (kNumScales + 1) / 2;
    const int parts = stage_parts(p);
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
            cast_row_fp8(row, msg + kSideFp8, reinterpret_cast<float*>(msg + kMsgHeader), p.round_scale != 0,
                         lane, b_begin, b_end);
        else   // a 128-channel block is 16 words of bf16
            transport::warp_copy_bytes(msg + kSideBf16 + b_begin * 256, row + b_begin * 16, (b_end - b_begin) * 256, lane);
    }
}

// After finish_call's block barrier (every thread's stores are in): thread 0 sets the block's stage flag
// to seq (fence first; system scope: a network put's NIC reads the message after the sender saw the flag).
DEEPEP_DEVICE void publish_staged(const LLDispatchParams& p, uint64_t seq) {
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(const_cast<uint64_t*>(stage_flag(p, blockIdx.x)), seq);
    }
}

// The ballots of my first kKeptRounds * 32 tokens for one expert, kept from the count pass for the send
// pass (one slot row per warp of the block): topk_idx is read once, not twice, and the count pass issues
// several rounds' loads together (its ballots do not depend on each other).
constexpr int kKeptRounds = 8;
__shared__ uint32_t s_hits[kThreads / 32][kKeptRounds];

// One expert's share of the send phase before any message moves: how many of my tokens selected g, and
// (kReserveRows) that many rows reserved at g's rank. (Made before the stage for the warp's first expert,
// to overlap the cast, it made the dispatch 2 % slower: the fetch_add's result was spilled, so the warp
// waited for it before casting.)
struct Reservation {
    bool skip;         // shrink mode: g's rank is masked, nothing is sent to it
    uint32_t count;    // my tokens that selected g
    uint64_t begin;    // kReserveRows, lane 0: the first of the rows reserved at g's rank
    uint64_t recvd;    // lane 0: g's rank's RECVD (checked before the signal, see check_overwrite)
};

DEEPEP_DEVICE Reservation reserve(const LLDispatchParams& p, const Transport& tr, const Call& call, int g,
                                  uint32_t* hits, int lane) {
    const Common& c = p.c;
    const int num_local = static_cast<int>(c.num_experts / c.num_ranks);
    const int dst = g / num_local;
    Reservation r{false, 0, 0, ~0ull};
    r.skip = __shfl_sync(0xffffffffu, lane == 0 && rank_masked(c, dst), 0);
    if (r.skip)
        return r;
    // Not in shrink mode: a blocking get from a dead peer would never return (the check guards the hook
    // order, which shrink mode callers keep anyway).
    if (lane == 0 && c.mask == nullptr)
        r.recvd = peer_recvd(tr, c, dst);
#pragma unroll 4
    for (int64_t t0 = 0; t0 < p.num_tokens; t0 += 32) {
        const uint32_t m = __ballot_sync(0xffffffffu, token_selects<kNumTopk>(p.topk_idx, p.num_tokens, t0 + lane, g));
        if (lane == 0 && t0 < 32 * kKeptRounds)
            hits[t0 / 32] = m;
        r.count += __popc(m);
    }
    __syncwarp();   // the kept ballots, stored by lane 0, are read by every lane in send_expert
    // The word was zeroed by dst's receive of the half's previous dispatch (protocol.cuh).
    if (kPlacement == Placement::kReserveRows && lane == 0 && r.count > 0)
        r.begin = tr.fetch_add(0, dst, dispatch_reserve_off(c, static_cast<int>(call.seq & 1), g % num_local), r.count);
    return r;
}

// Until the tokens t0 + 32 r + lane (r < rounds) that masks[r] selects are staged for call seq: each
// lane polls the flags of the blocks that staged its tokens' parts, all together (one round of loads
// covers up to kKeptRounds rounds of tokens), then acquires. False (reported, naming this rank: its own
// blocks did not stage in time) on timeout; the same answer on every lane.
DEEPEP_DEVICE bool wait_staged(const LLDispatchParams& p, uint64_t seq, int64_t t0, const uint32_t* masks,
                               int rounds, int parts, uint64_t deadline, int lane) {
    const int64_t num_warps = gridDim.x * (kThreads / 32);
    bool ok = true;
    for (;;) {
        bool staged = true;
#pragma unroll
        for (int r = 0; r < kKeptRounds; ++r) {
            if (r < rounds && (masks[r] >> lane & 1u)) {
                const int64_t item = (t0 + 32 * r + lane) * parts;
#pragma unroll
                for (int q = 0; q < kMaxParts; ++q)
                    staged &= q >= parts || *stage_flag(p, static_cast<int>((item + q) % num_warps / (kThreads / 32))) == seq;
            }
        }
        if (staged)
            break;
        if (globaltimer_ns() > deadline) {
            // The record names the waiting block, as a grid barrier's does (finding the late one here
            // would cost the loop above registers).
            report_error(sink_of(p.c, kOpLowLatencyDispatch), kErrorTimeout, static_cast<int>(p.c.rank),
                         static_cast<int>(seq));
            ok = false;
            break;
        }
    }
    // Acquire: the flags above before the messages, which every lane reads. With load/store peers and no
    // network only this GPU's lanes read them (device scope; the flag's writer released at system scope for
    // a NIC, which may read them otherwise).
    if constexpr (Transport::capabilities().peer_load_store &&
                  Transport::capabilities().network == transport::Network::kNone)
        __threadfence();
    else
        __threadfence_system();
    __syncwarp();
    return __all_sync(0xffffffffu, ok);
}

// Send phase of call `call` for expert g (see the top of the file), after reserve(g). A warp waits for
// its tokens' stage flags; when a wait times out (reported), the messages are not trusted and not
// sent (rows it reserved stay unused), but the signal is still set with count 0 so no peer is left
// waiting for this rank.
DEEPEP_DEVICE void send_expert(const LLDispatchParams& p, const Transport& tr, const Call& call, int g,
                               Reservation r, const uint32_t* hits, uint64_t deadline, int lane) {
    if (r.skip)
        return;
    const Common& c = p.c;
    const uint64_t seq = call.seq;
    const int half = static_cast<int>(seq & 1);
    const int num_local = static_cast<int>(c.num_experts / c.num_ranks);
    const int dst = g / num_local, local = g % num_local;
    const int me = static_cast<int>(c.rank);
    const int64_t slots = c.num_ranks * c.num_max_tokens;
    const int64_t side = side_bytes(p.use_fp8 != 0), row = row_bytes(p.use_fp8 != 0);
    constexpr bool kReserve = kPlacement == Placement::kReserveRows;
    const int parts = stage_parts(p);
    const int kept = static_cast<int>((p.num_tokens + 31) / 32 < kKeptRounds ? (p.num_tokens + 31) / 32 : kKeptRounds);
    bool ok = r.count == 0 || wait_staged(p, seq, 0, hits, kept, parts, deadline, lane);
    uint32_t count = ok ? r.count : 0;
    uint64_t begin = 0;
    if constexpr (kReserve) {
        // A block past the end means the word was not zeroed (see protocol.cuh): report, write nothing.
        if (lane == 0 && r.count > 0 && r.begin + r.count > static_cast<uint64_t>(slots)) {
            report_error(sink_of(c, kOpLowLatencyDispatch), kErrorOverwrite, dst, static_cast<int>(seq));
            count = 0;
        }
        begin = __shfl_sync(0xffffffffu, r.begin, 0);
        count = __shfl_sync(0xffffffffu, count, 0);
    }
    uint32_t j = 0;
    for (int64_t t0 = 0; ok && t0 < p.num_tokens && (!kReserve || j < count); t0 += 32) {
        uint32_t mask = t0 < 32 * kKeptRounds
                            ? hits[t0 / 32]
                            : __ballot_sync(0xffffffffu, token_selects<kNumTopk>(p.topk_idx, p.num_tokens, t0 + lane, g));
        if (t0 >= 32 * kKeptRounds && mask != 0 && !wait_staged(p, seq, t0, &mask, 1, parts, deadline, lane)) {
            ok = false;   // the rows sent so far are not counted: the signal says 0
            break;
        }
        while (mask != 0) {
            const int64_t token = t0 + __ffs(mask) - 1;
            mask &= mask - 1;
            const char* msg = own<const char>(c, p.send_stage_offset + token * c.msg_bytes);
            if constexpr (kReserve)
                tr.put2_warp(0, dst, dispatch_side_off(c, half, local, me, j, side), side,
                             dispatch_row_off(c, half, local, static_cast<int64_t>(begin) + j, row), msg, row, lane);
            else
                tr.put_warp(0, dst, dispatch_slot_off(c, half, local, me, j), msg, side + row, lane);
            ++j;
        }
    }
    if (!ok)
        count = 0;
    else if constexpr (!kReserve)
        count = j;
    // Every lane's stores are ordered before lane 0's release (warp barrier, then the signal's release,
    // after a fence on every lane unless the transport's signal covers the warp): the receiver that reads
    // the count sees the rows, side messages and range. The range goes out with the rows, before the
    // fence: one fence then covers it too (after the fence, it made the signal wait for one more remote
    // store to complete).
    if (kReserve && lane == 0 && count > 0)
        tr.put_value(0, dst, dispatch_range_off(c, half, local, me), begin);
    warp_stores_before_signal();
    if (lane == 0) {
        check_overwrite(c, kOpLowLatencyDispatch, r.recvd, call, dst);
        tr.signal(0, dst, dispatch_signal_off(c, half, local, me), signal_value(seq, count));
    }
}

// One round of unpack_side: words i0 + 32 u (u < kUnroll) of the block's side messages, loaded together.
template <int kWords, int kUnroll>
DEEPEP_DEVICE void load_side_round(const int4* side, int stride, int i0, int n, int4 (&v)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (i0 + 32 * u < n)
            v[u] = side[(i0 + 32 * u) / kWords * stride + (i0 + 32 * u) % kWords];
}

// Their values into src_info (word 0 of a side message) and the scales output (the others), rows from begin.
template <int kWords, int kUnroll>
DEEPEP_DEVICE void store_side_round(const LLDispatchParams& p, int e, int64_t begin, int i0, int n,
                                    const int4 (&v)[kUnroll]) {
    const int64_t slots = p.c.num_ranks * p.c.num_max_tokens;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + 32 * u;
        if (i >= n)
            break;
        const int64_t row = begin + i / kWords;
        const int w = i % kWords;
        if (w == 0) {
            p.src_info[e * slots + row] = v[u].x;
        } else if (p.use_ue8m0) {
            // One int32 per 4 scales (word w holds scales 4(w-1)..4(w-1)+3): their exponent bytes.
            const uint32_t word = ((static_cast<uint32_t>(v[u].x) >> 23) & 0xffu) |
                                  (((static_cast<uint32_t>(v[u].y) >> 23) & 0xffu) << 8) |
                                  (((static_cast<uint32_t>(v[u].z) >> 23) & 0xffu) << 16) |
                                  (((static_cast<uint32_t>(v[u].w) >> 23) & 0xffu) << 24);
            static_cast<int*>(p.recv_scales)[(static_cast<int64_t>(e) * (kNumScales / 4) + (w - 1)) * slots + row] =
                static_cast<int>(word);
        } else {
            float* out = static_cast<float*>(p.recv_scales) + (static_cast<int64_t>(e) * kNumScales + 4 * (w - 1)) * slots + row;
            const int vals[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (4 * (w - 1) + k < kNumScales)
                    out[k * slots] = __int_as_float(vals[k]);
        }
    }
}

// The side messages of one (local expert e, source) block, rows [begin, begin + count) of e, into
// src_info and the scales output: a whole warp, loads of up to 4 words per lane issued together (a
// block of <= 8 FP8 side messages at hidden 7168 is one round trip; 8 words per lane made the
// one-launch kernel spill). kWords: 16-byte words per side message (1: bf16, the head only);
// `stride`: words from one side message to the next (kWords when packed, a whole message in slots).
// `range_word` (kReserveRows; else null, and `begin` is given): where the sender wrote `begin`. It is
// read after the first round's loads are issued, so both are in flight together: the side messages sit
// in fixed slots, only the rows they are written to depend on it. Returns begin, or -1 (nothing written)
// when the block would end past R*T rows.
template <int kWords>
DEEPEP_DEVICE int64_t unpack_side(const LLDispatchParams& p, const int4* side, int stride, int e, int64_t begin,
                                  const volatile uint64_t* range_word, int64_t count, int lane) {
    constexpr int kUnroll = 4;
    const int64_t slots = p.c.num_ranks * p.c.num_max_tokens;
    const int n = static_cast<int>(count) * kWords;   // count <= T: 32-bit indices
    if (count > 0 && range_word != nullptr) {
        int4 v[kUnroll];
        load_side_round<kWords, kUnroll>(side, stride, lane, n, v);
        begin = static_cast<int64_t>(*range_word);
        if (begin + count > slots)
            return -1;
        store_side_round<kWords, kUnroll>(p, e, begin, lane, n, v);
        lane += 32 * kUnroll;   // the rounds below go on after the first
    } else if (begin + count > slots) {
        return -1;
    }
    for (int i0 = lane; i0 < n; i0 += 32 * kUnroll) {
        int4 v[kUnroll];
        load_side_round<kWords, kUnroll>(side, stride, i0, n, v);
        store_side_round<kWords, kUnroll>(p, e, begin, i0, n, v);
    }
    return begin;
}

// Receive phase of call `seq` (see the top of the file).
DEEPEP_DEVICE void receive_messages(const LLDispatchParams& p, const Transport& tr, uint64_t seq) {
    const Common& c = p.c;
    const int half = static_cast<int>(seq & 1);
    const ErrorSink sink = sink_of(c, kOpLowLatencyDispatch);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    const int num_ranks = static_cast<int>(c.num_ranks);
    const int num_local = static_cast<int>(c.num_experts) / num_ranks;
    const int64_t slots = static_cast<int64_t>(num_ranks) * c.num_max_tokens;
    const int64_t side = side_bytes(p.use_fp8 != 0);
    constexpr bool kReserve = kPlacement == Placement::kReserveRows;
    if (kReserve && p.expect_half != half && blockIdx.x == 0 && threadIdx.x == 0)
        // The host handed out recv_x of the other half (e.g. a CUDA graph holding an odd number of LL
        // calls): the rows are not where the returned tensor is. Report it.
        report_error(sink, kErrorOverrun, -1, half);

    for (int pair = warp; pair < num_local * num_ranks; pair += num_warps) {
        const int e = pair / num_ranks, s = pair % num_ranks;
        const bool last = s == num_ranks - 1;   // also waits for every other source: recv_count[e]
        // Signals to wait for: s's; every source's for the last pair (recv_count); with kPackOnReceive
        // also those of sources < s, whose rows come first.
        int64_t before = 0, mine = 0, after = 0;
        bool ok = true;
        for (int s2 = lane; s2 < num_ranks; s2 += 32) {
            if (s2 != s && !last && (kReserve || s2 > s))
                continue;
            const long long t_start = clock64();
            const int64_t n = wait_signal(tr, c, dispatch_signal_off(c, half, e, s2), seq, deadline, sink, s2);
            if (n < 0) {
                ok = false;
                continue;
            }
            if (s2 < s)
                before += n;
            else if (s2 > s)
                after += n;
            else {
                mine = n;
                if (p.wait_stats != nullptr)
                    atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + s),
                              static_cast<unsigned long long>(clock64() - t_start));
            }
        }
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) {
            before += __shfl_xor_sync(0xffffffffu, before, off);
            mine += __shfl_xor_sync(0xffffffffu, mine, off);
            after += __shfl_xor_sync(0xffffffffu, after, off);
        }
        if (!__all_sync(0xffffffffu, ok))
            continue;   // reported; skip the copies
        // The lanes acquired the signals; order every lane's reads (range word, messages) after them.
        __threadfence_system();
        __syncwarp();
        const int64_t row = row_bytes(p.use_fp8 != 0);
        const int4* sides;
        int stride;
        const volatile uint64_t* range_word = nullptr;
        if constexpr (kReserve) {
            sides = own<const int4>(c, dispatch_side_off(c, half, e, s, 0, side));
            stride = static_cast<int>(side / 16);
            range_word = own<volatile uint64_t>(c, dispatch_range_off(c, half, e, s));
        } else {
            sides = own<const int4>(c, dispatch_slot_off(c, half, e, s, 0));
            stride = static_cast<int>(c.msg_bytes / 16);
            if (before + mine <= slots)
                for (int64_t j = 0; j < mine; ++j)   // the payloads, one message per round trip
                    transport::warp_copy_bytes(reinterpret_cast<char*>(p.recv_x) + (e * slots + before + j) * row,
                                               reinterpret_cast<const char*>(sides + j * stride) + side, row, lane);
        }
        // kReserveRows: begin is the sender's (0 when it sent nothing); else the rows of sources < s come first.
        const int64_t begin = p.use_fp8 ? unpack_side<kSideFp8 / 16>(p, sides, stride, e, kReserve ? 0 : before, range_word, mine, lane)
                                        : unpack_side<kSideBf16 / 16>(p, sides, stride, e, kReserve ? 0 : before, range_word, mine, lane);
        if (begin < 0) {   // cannot happen when the sender checked its reservation; nothing was written past
            if (lane == 0)
                report_error(sink, kErrorOverwrite, s, static_cast<int>(seq));
            continue;
        }
        if (lane == 0) {
            p.layout_range[e * num_ranks + s] = (begin << 32) | mine;
            if (last) {
                const int total = static_cast<int>(before + mine + after);
                p.recv_count[e] = total;
                if (p.cumulative_recv_stats != nullptr)
                    p.cumulative_recv_stats[e] += total;
                // Every source's reservation of this call is in (their signals came after it): re-arm the
                // word for the half's next dispatch (ordered before it by end_call's release of RECVD).
                if (kReserve)
                    *own<volatile uint64_t>(c, dispatch_reserve_off(c, half, e)) = 0;
            }
        }
    }
}


// Stage + send of one call: the trace's stage span ends and its send span starts when the block set its
// stage flag.
DEEPEP_DEVICE void stage_and_send(const LLDispatchParams& p, const Transport& tr) {
    const Common& c = p.c;
    const PendingCall pending = read_call(c, c.ctrl_sent, kKindDispatch);
    stage_tokens(p);
    const Call call = finish_call(c, pending, kTraceDispatchStage);
    publish_staged(p, call.seq);
    trace_mark_at(c.trace, call.seq, kTraceDispatchBlocks, false, pending.start_ns);
    trace_mark_at(c.trace, call.seq, kTraceDispatchBlocks, true, pending.start_ns);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    const int num_warps = gridDim.x * (kThreads / 32);
    const int num_experts = static_cast<int>(c.num_experts);
    uint32_t* hits = s_hits[threadIdx.x / 32];
    if (c.trace != nullptr) {   // profiling: this block's staged point (finish_call ended with a block barrier)
        trace_mark(c.trace, call.seq, kTraceDispatchStaged, false);
        trace_mark(c.trace, call.seq, kTraceDispatchStaged, true);
        trace_mark(c.trace, call.seq, kTraceDispatchStage, true);
        trace_mark(c.trace, call.seq, kTraceDispatchSend, false);
    }
    for (int g = warp; g < num_experts; g += num_warps)
        send_expert(p, tr, call, g, reserve(p, tr, call, g, hits, lane), hits, deadline, lane);
    // The puts read my send stage, which the next dispatch's stage phase rewrites: complete this
    // warp's puts before the phase ends (one quiet per warp; a no-op for load/store peers).
    if (lane == 0)
        tr.flush(0);
    end_call(c, c.ctrl_sent, c.ctrl_send_arrive, call.seq, kTraceDispatchSend, kKindDispatch,
             /*last_phase=*/(c.phases & kPhaseRecv) == 0);
}

DEEPEP_DEVICE void receive(const LLDispatchParams& p, const Transport& tr) {
    const Common& c = p.c;
    const uint64_t seq = begin_call(c, c.ctrl_recvd, kTraceDispatchRecv).seq;
    receive_messages(p, tr, seq);
    end_call(c, c.ctrl_recvd, c.ctrl_recv_arrive, seq, kTraceDispatchRecv, kNoKind, /*last_phase=*/true);
}

}  // namespace

namespace deepep_portable::low_latency {

// The one dispatch kernel (see the top of the file). Without a hook the receive phase follows in the
// same launch: a warp's receive waits overlap the peers' (and my other warps') sends instead of
// starting after a kernel boundary. RECVD + 1 is this call (the host allows no hook-less op while a
// hook is pending), and a block reads RECVD before it can arrive at the receive phase's end
// (end_call), so the sequence numbers agree.
__global__ void __launch_bounds__(kThreads) dispatch(const __grid_constant__ LLDispatchParams p) {
    const Transport tr = p.c.transport;
    wait_previous_grid();   // a programmatic launch: nothing of the previous kernel is read before
    if (p.c.phases & kPhaseSend)
        stage_and_send(p, tr);
    if (p.c.phases & kPhaseRecv)
        receive(p, tr);
}

}  // namespace deepep_portable::low_latency
