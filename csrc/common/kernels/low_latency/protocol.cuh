// Low-latency (LL) protocol shared by low_latency/dispatch.cu and low_latency/combine.cu.
//
// Buffer (one per rank, same size everywhere, offsets from deepep_portable/layout.py LowLatencyLayout):
//   [ control | signals of half 0 | signals of half 1 | data of half 0 | data of half 1 | send stage ]
//   control: SENT (u64, calls whose send phase finished), RECVD (u64, calls whose receive phase
//            finished), two block-arrival words, the error claim word, LAST (see below), and the
//            grid-barrier words STAGE_ARRIVE (u32) and STAGED (u64) (layout.py LL_CTRL_*; grid_barrier); then the
//            stage flags, u64 [kMaxStageBlocks]: flag b = the last dispatch call whose stage phase block b
//            of my grid finished (set with a release after the block's messages; a send warp waits for the
//            flags of the blocks that staged its tokens). A fixed place whatever the call's shape, so no
//            payload of another shape can ever pass for a flag; zeroed with the control words by
//            clean_low_latency_buffer (call numbers start again from 1 there). Then the barrier words.
//   signals of a half: dispatch [E_local][R] u64 (slot (e, s) written only by source rank s),
//                      combine  [E] u64 (slot g written only by the rank that owns expert g),
//                      dispatch ranges [E_local][R] u64 (the first row of s's block of e, written by s),
//                      dispatch reservations [E_local] u64 (rows of e taken so far this call: fetch_add
//                      by every source, zeroed by this rank's receive once every source's block is in).
//   data of a half: the dispatch area, the combine send area [E_local][R*T][H] bf16 (the zero-copy
//                   buffer; written only by this rank), then the combine receive slots [E][T][H] bf16.
//                   The dispatch area holds, by the dispatch's placement (low_latency/dispatch.cu):
//                   kReserveRows: recv_x [E_local][R*T] rows (H bytes FP8 or 2H bf16 each, the tensor the
//                   op returns: peers write it directly), then the side messages [E_local][R][T] (per
//                   token: int32 source token, then its float32 scales); kPackOnReceive: whole messages
//                   [E_local][R][T] (side message + payload) from its start (they fit in the same bytes).
//   send stage: [T] dispatch messages built by the dispatch's stage phase (side message, then the
//               payload; written only by this rank, read by its send phase; the send quiets before it ends).
//
// Calls: every LL op (dispatch or combine) is one call, numbered 1, 2, ... on every rank in the same
// order. A call has two phases: SEND (never waits for a peer) and RECEIVE (waits for the peers'
// signals), two kernels (the hook launches the second) or, for a dispatch without a hook, one kernel
// running both. The send phase takes seq = SENT + 1 and its last block to finish stores SENT = seq;
// the receive phase does the same with RECVD. So sends and receives pair up first-in first-out, even when hooks delay
// receives, and a captured CUDA graph keeps counting on replay (the counters live in device memory).
// half = seq & 1; every signal of call seq is SET to (seq << kCountBits) | count, so no signal is ever
// zeroed between calls; a receiver waits until the value reaches seq << kCountBits and reports an overrun
// if it is already past seq (a peer two calls ahead: the caller broke the double-buffering rule). With 24
// bits of count (at most T rows per signal) the call number has 40: 2^40 calls, decades at a kHz, before
// a Buffer needs clean_low_latency_buffer (a 32-bit field would have wrapped after 2^32, weeks of decode).
//
// Safety of the double buffer: peers write only receive areas and signals, and dispatch and combine
// use disjoint ones in each half, so a send of call m can only clobber the half of the previous
// call of the SAME kind on the same half
// (call `prev`, usually m - 2). Without hooks that is safe: a peer's send m runs after its receive
// of m - 1, which needs my send of m - 1, which my stream runs after my receive of prev. With hooks
// the precondition (DeepEP has the same one) is: every rank enqueues the receive (hook) of a call
// before it makes the next-but-one call of the same kind (e.g. dispatch, dispatch, hook, hook,
// combine, combine is fine). Nothing on the device enforces it, so it is DETECTED both ways:
//  * sender: the send kernel records, per (kind, half), the last call that used it (ctrl_last) and
//    reads the destination's RECVD before writing; RECVD < prev means the peer has not finished
//    receiving prev, whose bytes are about to be overwritten -> kErrorOverwrite on the sender;
//  * receiver: a signal already carrying a later call -> kErrorOverrun.
// The same chain orders the dispatch's reservation word: my receive of prev zeroes it (after every
// source's block of prev is in, before RECVD = prev is released), and a sender of m adds to it only
// after that. A sender whose reservation would end past R*T rows (the word was not zeroed: the rule
// above was broken) reports kErrorOverwrite and writes nothing. recv_x itself is what the dispatch
// returns: it stays valid until this rank's next combine has sent (DeepEP's rule: at most two LL
// results alive at a time), and the host checks the half it handed out against the device's (a CUDA
// graph holding an odd number of LL calls would flip them).
// Unlike DeepEP's fixed per-source slots, reserved rows of the next dispatch may land on rows of any source:
// a peer that has all of my combine's rows may start that dispatch while my other warps still read x. So a
// combine whose x lies in the dispatch area (recv_x given back) signals only after a barrier over its grid.
// The host keeps receives in call order (hooks in call order, exactly once, no hook-less op while a
// hook is pending), so RECVD + 1 is always the call of the receive kernel being launched. Every wait
// is bounded and reports (op, rank, peer) to the ErrorSink; a kernel whose wait failed skips its
// copies but still finishes its bookkeeping, so no other block of any rank is left spinning forever.
//
// One kernel name per op (`dispatch`, `combine`: what a profiler table shows, as DeepEP's). The dispatch
// launch runs the phases its params name (kPhaseSend, kPhaseRecv, or both in one launch when the caller
// wants no hook); the hook launches the same kernel again for the receive phase. The combine is compiled
// once per phase (-DPHASE, combine.cu says why): its send kernel, then its receive kernel (at once, or by
// the hook).
//
// Shrink mode (Buffer(enable_shrink=True), DeepEP's dead-rank tolerance): Common::mask is an int32 [R]
// the host owns. A masked rank is neither sent to nor waited for: its signals count as 0 rows and its
// experts' combine rows as absent. A wait on a peer that times out masks that peer (signal.cuh:
// report_error) instead of failing the call. A masked rank is taken as gone: nothing it sends later
// is read, and the counters of the live ranks go on without it (to take it back, every rank, it
// included, must have made the same LL calls since; clean_low_latency_buffer on every rank resets them).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/fp8.cuh"
#include "common/kernels/grid_dependency.cuh"
#include "common/kernels/selected_transport.cuh"
#include "common/kernels/signal.cuh"


namespace deepep_portable::low_latency {

// The backend these kernels are built for (chosen by the host, see selected_transport.cuh).
using Transport = transport::Selected;

constexpr int kThreads = 512;          // __launch_bounds__ of every LL kernel (host: engines/low_latency.THREADS)
constexpr int kKindDispatch = 0;       // index of ctrl_last[kind][half]
constexpr int kKindCombine = 1;
constexpr int kNoKind = -1;            // a receive phase: begin_call / end_call record no ctrl_last
constexpr int kMsgHeader = 16;         // head of a dispatch side message (int32 source token), before its scales
constexpr int kMaxStageBlocks = 1024;  // stage flags, one per block: the LL grid's cap (layout.LL_MAX_STAGE_BLOCKS)
constexpr int kMaxShrinkRanks = 4096;  // shrink mode's rank limit (the combine's per-block live bitmap)
constexpr int kPhaseSend = 1;          // Common::phases: what a launch runs
constexpr int kPhaseRecv = 2;

// Fields shared by every LL params struct (the backend's Transport, then 64-bit words; mirrored in
// deepep_portable/engines/low_latency.py).
struct Common {
    Transport transport;             // the backend's struct, filled by the window (Window.transport_params)
    uint64_t local_base;             // my window's address here: the kernels' own control words and outputs
    int64_t rank;
    int64_t num_ranks;
    int64_t ctrl_sent;               // byte offsets in my buffer (control area)
    int64_t ctrl_recvd;
    int64_t ctrl_send_arrive;
    int64_t ctrl_recv_arrive;
    int64_t ctrl_last;               // u64 [kind][half]: the last call of that kind that used that half
    int64_t dispatch_signal_offset;  // half 0; half 1 is + signal_half_stride
    int64_t combine_signal_offset;
    int64_t signal_half_stride;
    int64_t dispatch_recv_offset;    // recv_x rows of half 0; half 1 is + data_half_stride
    int64_t dispatch_side_offset;    // side messages of half 0
    int64_t combine_send_offset;     // half 0 (the zero-copy buffer; only this rank writes it)
    int64_t combine_recv_offset;
    int64_t data_half_stride;
    int64_t num_experts;
    int64_t num_max_tokens;          // T
    int64_t msg_bytes;               // one message of the send stage
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
    uint64_t* trace;                 // null, or [kTraceCalls][kTraceKernels][start, end] globaltimer ns (profiling)
    int64_t phases;                  // kPhaseSend and / or kPhaseRecv: what this launch runs (the combine's
                                     // kernels are compiled for one phase: -DPHASE, the same value)
    int64_t ctrl_stage_arrive;       // u32 in my control area: blocks past the first part of a launch (grid_barrier)
    int64_t ctrl_staged;             // u64 in my control area: the last grid_barrier ticket every block passed
    int* mask;                       // shrink mode: int32 [R], 1 = masked (see the top of the file); else null
    int64_t barrier_offset;          // u64 [R] barrier words (clean.cu), never cleaned
};

DEEPEP_DEVICE ErrorSink sink_of(const Common& c, int op) {
    return ErrorSink{c.error_claim, c.error_host, op, static_cast<int>(c.rank), c.mask};
}

// Shrink mode: whether rank r is masked (a plain volatile load: another block may mask r meanwhile,
// and the kernel only needs to see it eventually). Callers that need one answer per warp read it on
// one lane and broadcast it.
DEEPEP_DEVICE bool rank_masked(const Common& c, int r) {
    return c.mask != nullptr && *reinterpret_cast<volatile const int*>(c.mask + r) != 0;
}

// Optional kernel timing (DEEPEP_PORTABLE_PROFILE=1; `bench --mode low_latency` prints it for the
// CUDA-graph replays, where host events cannot be placed): per call (slot seq % kTraceCalls) and
// kernel, the earliest block start and the latest block end. The host fills start slots with ~0 and
// end slots with 0 before the calls it traces.
constexpr int kTraceCalls = 64;
// The last two are spreads, not phases: over a dispatch's blocks, the first and the last block start, and
// the first and the last arrival at the stage barrier.
enum TraceKernel : int { kTraceDispatchStage = 0, kTraceDispatchSend, kTraceDispatchRecv, kTraceCombineSend,
                         kTraceCombineRecv, kTraceDispatchBlocks, kTraceDispatchStaged, kTraceKernels };

// The mark at time `now` (thread 0 only).
DEEPEP_DEVICE void trace_mark_at(uint64_t* trace, uint64_t seq, int kernel, bool end, unsigned long long now) {
    if (trace == nullptr || threadIdx.x != 0)
        return;
    unsigned long long* slot = reinterpret_cast<unsigned long long*>(trace) + ((seq % kTraceCalls) * kTraceKernels + kernel) * 2;
    if (end)
        atomicMax(slot + 1, now);
    else
        atomicMin(slot, now);
}

DEEPEP_DEVICE void trace_mark(uint64_t* trace, uint64_t seq, int kernel, bool end) {
    if (trace != nullptr)
        trace_mark_at(trace, seq, kernel, end, globaltimer_ns());
}

template <typename U>
DEEPEP_DEVICE U* own(const Common& c, int64_t off) {
    return reinterpret_cast<U*>(c.local_base + static_cast<uint64_t>(off));
}

DEEPEP_DEVICE int64_t last_off(const Common& c, int kind, int half) {
    return c.ctrl_last + 8 * (2 * kind + half);
}

// The call a kernel belongs to: seq = counter + 1 (read by every block before any block can finish,
// see end_call) and, for a send kernel (kind >= 0), prev = the last call of the same kind that used
// half seq & 1 (0: none). Every thread of the block gets the same values.
struct Call {
    uint64_t seq;
    uint64_t prev;
};

// A begin_call in two steps: read_call issues thread 0's loads (the counter, and both halves' ctrl_last
// words, so no load waits for another), finish_call consumes them. Between the two a kernel may do work
// that does not depend on the call (the dispatch stages its messages): the loads' latency then overlaps
// it instead of delaying every thread of the block.
struct PendingCall {
    uint64_t counter;
    uint64_t last[2];
    uint64_t start_ns;   // for the trace: when the block began the call
};

DEEPEP_DEVICE PendingCall read_call(const Common& c, int64_t counter_off, int kind = kNoKind) {
    PendingCall r{0, {0, 0}, 0};
    if (threadIdx.x == 0) {
        r.counter = *own<volatile uint64_t>(c, counter_off);
        if (kind >= 0) {
            r.last[0] = *own<volatile uint64_t>(c, last_off(c, kind, 0));
            r.last[1] = *own<volatile uint64_t>(c, last_off(c, kind, 1));
        }
        if (c.trace != nullptr)
            r.start_ns = globaltimer_ns();
    }
    return r;
}

DEEPEP_DEVICE Call finish_call(const Common& c, const PendingCall& r, int trace_kernel) {
    __shared__ uint64_t s_seq, s_prev;
    if (threadIdx.x == 0) {
        const uint64_t seq = r.counter + 1;
        s_seq = seq;
        s_prev = r.last[seq & 1];
        trace_mark_at(c.trace, seq, trace_kernel, false, r.start_ns);
    }
    __syncthreads();
    return Call{s_seq, s_prev};
}

DEEPEP_DEVICE Call begin_call(const Common& c, int64_t counter_off, int trace_kernel, int kind = kNoKind) {
    return finish_call(c, read_call(c, counter_off, kind), trace_kernel);
}

// Thread 0 of a block, after a __syncthreads that gathered the block's accesses: arrive on the u32
// word at `arrive_off` (a fence first, so those accesses are ordered before the arrival; `system`: at
// system scope, else device scope). True for the grid's last block only, which has then acquired every
// other block's arrival (second fence); it re-arms the word (rearm) before the word's next use.
DEEPEP_DEVICE bool arrive_last(const Common& c, int64_t arrive_off, bool system = true) {
    system ? __threadfence_system() : __threadfence();
    if (atomicAdd(own<unsigned int>(c, arrive_off), 1u) != gridDim.x - 1)
        return false;
    system ? __threadfence_system() : __threadfence();
    return true;
}

DEEPEP_DEVICE void rearm(const Common& c, int64_t arrive_off) {
    atomicExch(own<unsigned int>(c, arrive_off), 0u);
}

// The last block of the grid to get here stores counter = seq (all blocks read it in begin_call
// before arriving), for a send kernel also ctrl_last[kind][half] = seq, and re-arms the arrival word
// for the next launch. Every block's accesses are ordered before its arrival (__syncthreads + fence),
// the last block acquires the arrivals (a fence after its arrival atomic) and its stores of the words
// are strong: the fence and the stores are a release of everything the grid did.
//   Scope: a receive kernel's RECVD is read by the peers (the sender-side overwrite check: they must
//   see this grid's reads of the half done): system. A send kernel's SENT and ctrl_last are read only
//   by this GPU's next send kernel (its puts and signals are ordered by their own system fences): device
//   scope, a cheaper fence on the path from the grid's last block to the kernel's end.
//   The arrival word is re-armed after the counter: its next use is the next launch of this phase, which
//   waits for this grid to complete (stream order, or griddepcontrol.wait under a programmatic launch).
// `last_phase`: no wait of this block on a peer follows in this launch, so the next kernel in the stream
// (a programmatic launch) may be scheduled now (grid_dependency.cuh says why not earlier).
DEEPEP_DEVICE void end_call(const Common& c, int64_t counter_off, int64_t arrive_off, uint64_t seq, int trace_kernel,
                            int kind, bool last_phase) {
    __syncthreads();
    if (last_phase)
        allow_next_grid();
    trace_mark(c.trace, seq, trace_kernel, true);
    if (threadIdx.x != 0 || !arrive_last(c, arrive_off, /*system=*/kind < 0))
        return;
    if (kind >= 0)
        *own<volatile uint64_t>(c, last_off(c, kind, static_cast<int>(seq & 1))) = seq;
    *own<volatile uint64_t>(c, counter_off) = seq;
    rearm(c, arrive_off);
}

// Before one lane signals a peer the rows its warp stored or put there: every lane's stores ordered
// before the signal (a fence on every lane, unless the transport's signal covers the warp: transport.cuh),
// then the warp barrier.
DEEPEP_DEVICE void warp_stores_before_signal() {
    if constexpr (!Transport::kSignalCoversWarp)
        __threadfence_system();
    __syncwarp();
}

// Sender-side overwrite check, part 1 (one lane, before writing into `peer`'s half): the peer's
// RECVD, read through the transport (no ordering needed: in the valid case the peer stored RECVD >=
// prev before the signals this rank already acquired, so it cannot read stale). The value is only
// used in part 2, so a load's latency overlaps the writes (over a network it is a blocking get).
template <typename Tr>
DEEPEP_DEVICE uint64_t peer_recvd(const Tr& tr, const Common& c, int peer) {
    return tr.get_value(0, peer, c.ctrl_recvd);
}

// Part 2: report (once per buffer) when the peer had not finished receiving call `prev` of this half.
DEEPEP_DEVICE void check_overwrite(const Common& c, int op, uint64_t recvd, const Call& call, int peer) {
    if (recvd < call.prev)
        report_error(sink_of(c, op), kErrorOverwrite, peer, static_cast<int>(call.seq));
}

constexpr int kCountBits = 24;   // low bits of a signal: its count (< 2^24; the host checks T); high: the call

DEEPEP_HOST_DEVICE uint64_t signal_value(uint64_t seq, uint32_t count) {
    return (seq << kCountBits) | count;
}

// `ticket` = 2 * seq + which (0 for a launch's first barrier, 1 for a second one): the values only grow.
// Today every launch crosses at most one (the dispatch's stage barrier, or the combine send's signal-last one).
DEEPEP_DEVICE uint64_t barrier_ticket(uint64_t seq, int which) {
    return 2 * seq + static_cast<uint64_t>(which);
}

// Every block of my grid waits here until all of them have arrived (one launch's second part reads
// what other blocks wrote in its first: the dispatch's staged messages; or the combine send's signals
// wait until no block reads x any more).
// The last block to arrive re-arms the arrival word and publishes STAGED = ticket with a release; the
// others acquire-poll it (tickets grow with every call: no reset, no ABA). The blocks are co-resident
// (Window.grid), so the wait ends; it is bounded anyway. System scope: a network put's NIC reads what
// was written before. False (reported) on timeout.
DEEPEP_DEVICE bool grid_barrier(const Common& c, uint64_t ticket, uint64_t deadline, int op) {
    __shared__ int s_ok;
    __syncthreads();   // every thread of the block is done with the first part
    if (threadIdx.x == 0) {
        s_ok = 1;
        uint64_t* staged = own<uint64_t>(c, c.ctrl_staged);
        if (arrive_last(c, c.ctrl_stage_arrive)) {
            rearm(c, c.ctrl_stage_arrive);   // before the release: a second barrier of the launch arrives again
            st_release_sys(staged, ticket);
        }
        else if (!wait_ge(staged, ticket, deadline, ErrorSink{c.error_claim, c.error_host, op, static_cast<int>(c.rank)},
                          static_cast<int>(c.rank)))
            s_ok = 0;
    }
    __syncthreads();
    return s_ok != 0;
}

// Wait (one thread) until my signal at `off` carries call `seq`; returns the count, or -1 after
// reporting a timeout or an overrun (naming `peer`). Shrink mode: a masked peer, or one this wait
// masks (its timeout), sent nothing: 0.
template <typename Tr>
DEEPEP_DEVICE int64_t wait_signal(const Tr& tr, const Common& c, int64_t off, uint64_t seq, uint64_t deadline,
                                  const ErrorSink& sink, int peer) {
    if (rank_masked(c, peer))
        return 0;
    if (!tr.wait_ge(off, seq << kCountBits, deadline, sink, peer))
        return rank_masked(c, peer) ? 0 : -1;
    const uint64_t v = ld_acquire_sys(own<const uint64_t>(c, off));
    if ((v >> kCountBits) != seq) {
        report_error(sink, kErrorOverrun, peer, static_cast<int>(v >> kCountBits));
        return -1;
    }
    return static_cast<int64_t>(v & ((1ull << kCountBits) - 1));
}

DEEPEP_DEVICE int64_t dispatch_signal_off(const Common& c, int half, int local_expert, int src) {
    return c.dispatch_signal_offset + half * c.signal_half_stride + 8 * (static_cast<int64_t>(local_expert) * c.num_ranks + src);
}

DEEPEP_DEVICE int64_t combine_signal_off(const Common& c, int half, int expert) {
    return c.combine_signal_offset + half * c.signal_half_stride + 8 * static_cast<int64_t>(expert);
}

// Where s's block of local expert e starts in recv_x (its first row), and the reservation word its
// sources fetch_add their block sizes to: both after the combine signals of the half.
DEEPEP_DEVICE int64_t dispatch_range_off(const Common& c, int half, int local_expert, int src) {
    return c.dispatch_signal_offset + half * c.signal_half_stride +
           8 * (2 * c.num_experts + static_cast<int64_t>(local_expert) * c.num_ranks + src);
}

DEEPEP_DEVICE int64_t dispatch_reserve_off(const Common& c, int half, int local_expert) {
    return c.dispatch_signal_offset + half * c.signal_half_stride + 8 * (3 * c.num_experts + local_expert);
}

// Row `row` of local expert e in the receiver's recv_x (`row_bytes`: H for FP8, 2H for bf16). A
// source's block is contiguous and in its token order; blocks follow each other in reservation order.
DEEPEP_DEVICE int64_t dispatch_row_off(const Common& c, int half, int local_expert, int64_t row, int64_t row_bytes) {
    return c.dispatch_recv_offset + half * c.data_half_stride +
           (static_cast<int64_t>(local_expert) * c.num_ranks * c.num_max_tokens + row) * row_bytes;
}

// kPackOnReceive: the whole message of the `slot`-th token `src` sends to `local_expert`. Pair-major
// ([E_local][R][T]): the messages one warp writes (one pair) stay on one page. (Slot-major, which
// packs a call's messages onto fewer pages overall, measured 2x slower on the H200 emulation: every
// warp then touches a page per message.)
DEEPEP_DEVICE int64_t dispatch_slot_off(const Common& c, int half, int local_expert, int src, int64_t slot) {
    return c.dispatch_recv_offset + half * c.data_half_stride +
           ((static_cast<int64_t>(local_expert) * c.num_ranks + src) * c.num_max_tokens + slot) * c.msg_bytes;
}

// Side message of the `slot`-th token `src` sends to `local_expert` (`side_bytes` each). Pair-major
// ([E_local][R][T]): a pair's side messages are contiguous, so its receive loads them in one round.
DEEPEP_DEVICE int64_t dispatch_side_off(const Common& c, int half, int local_expert, int src, int64_t slot,
                                        int64_t side_bytes) {
    return c.dispatch_side_offset + half * c.data_half_stride +
           ((static_cast<int64_t>(local_expert) * c.num_ranks + src) * c.num_max_tokens + slot) * side_bytes;
}

// Combine row `slot` of a global expert in the source rank's buffer (row j = the j-th of that rank's
// tokens, in token order, that selected the expert); `hidden_bytes` per row.
DEEPEP_DEVICE int64_t combine_row_off(const Common& c, int half, int expert, int64_t slot, int64_t hidden_bytes) {
    return c.combine_recv_offset + half * c.data_half_stride +
           (static_cast<int64_t>(expert) * c.num_max_tokens + slot) * hidden_bytes;
}

// The token order both sides of a call agree on: a warp scans my tokens 32 at a time and lane l asks
// whether token t = t0 + l selected expert g. The dispatch send kernel sends the j-th hit as message
// j of (g, me); the combine send kernel recomputes j the same way to find my token's row of g.
template <int kNumTopk>
DEEPEP_DEVICE bool token_selects(const int64_t* topk_idx, int64_t num_tokens, int64_t t, int g) {
    bool hit = false;
    if (t < num_tokens) {
#pragma unroll
        for (int k = 0; k < kNumTopk; ++k)
            hit |= topk_idx[t * kNumTopk + k] == g;
    }
    return hit;
}

}  // namespace deepep_portable::low_latency
