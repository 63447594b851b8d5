// The round protocol shared by intranode dispatch and combine (pull-based).
//
// Every op is one "round" n on a rank's buffer, in two kernels:
//   stage kernel: wait until every peer said "I finished pulling round n-1 from you" (DONE), so
//                 nobody still reads my send area, then copy my outgoing rows into my own send area.
//   pull kernel:  announce READY = n (my send area holds round n), wait for READY >= n of every
//                 peer, pull the rows I need from the peers' send areas into my outputs; its last
//                 block to finish tells every peer DONE = n (end_round).
// DONE is given when the reads end, not at the start of the peer's next op: a rank whose next op
// starts early (its host was quicker, or a zero-copy opener ran ahead) copies at once instead of
// waiting for the slowest peer's host to launch its next kernel.
// Round numbers live in device memory (CTRL_ROUND / CTRL_CURRENT), so a captured CUDA graph that
// replays the kernels keeps counting. Deadlock freedom: every wait is on a signal that a peer emits
// unconditionally in the same round (READY, COUNTED) or in the previous one (DONE, at the end of a
// pull that waited only for round n-1's READY); with all blocks of all ranks resident (the SM budget
// guarantees it), every wait is eventually satisfied.
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/peers.cuh"
#include "common/kernels/signal.cuh"

namespace deepep_portable::intranode {

// Byte offsets of the control area (mirrors deepep_portable/layout.py).
struct ControlLayout {
    int64_t round, current, ready, error, num_tokens, done, count_to, expert_count, counted, token_ticket,
        pull_arrive;
};

constexpr int kThreads = 512;   // threads of every intranode launch (host: engines/intranode.THREADS)

// Stage-kernel prologue: wait until no peer reads my send area any more. Returns the round number n,
// or 0 when a wait timed out. Writes only my CURRENT: it may run more than once in a round (the
// zero-copy opener, open_round.cu, runs it ahead of the op's stage kernel).
DEEPEP_DEVICE uint64_t begin_round(const PeerBuffers& bufs, const ControlLayout& ctrl, uint64_t timeout_ns,
                                   const ErrorSink& sink) {
    __shared__ uint64_t s_round;
    __shared__ int s_ok;
    const uint64_t prev = *bufs.at<volatile uint64_t>(bufs.rank, ctrl.round);   // written only by the last kernel of round n-1
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *bufs.at<volatile uint64_t>(bufs.rank, ctrl.current) = prev + 1;
    const uint64_t deadline = globaltimer_ns() + timeout_ns;
    for (int p = threadIdx.x; p < bufs.num_ranks; p += blockDim.x)
        if (!wait_ge(bufs.at<const uint64_t>(bufs.rank, ctrl.done + 8 * p), prev, deadline, sink, p))
            s_ok = 0;
    __syncthreads();
    if (threadIdx.x == 0)
        s_round = s_ok ? prev + 1 : 0;
    __syncthreads();
    return s_round;
}

// Pull-kernel prologue: announce READY = n and wait for every peer's READY >= n.
// Returns n, or 0 when a wait timed out.
DEEPEP_DEVICE uint64_t await_peers_ready(const PeerBuffers& bufs, const ControlLayout& ctrl, uint64_t timeout_ns,
                                         const ErrorSink& sink) {
    __shared__ uint64_t s_round;
    __shared__ int s_ok;
    const uint64_t n = *bufs.at<volatile uint64_t>(bufs.rank, ctrl.current);
    if (threadIdx.x == 0) {
        s_ok = 1;
        // The stage kernel's writes to my send area completed at the kernel boundary; the
        // release store makes them visible to any peer that acquires READY >= n.
        __threadfence_system();
        st_release_sys(bufs.at<uint64_t>(bufs.rank, ctrl.ready), n);
    }
    __syncthreads();
    const uint64_t deadline = globaltimer_ns() + timeout_ns;
    for (int p = threadIdx.x; p < bufs.num_ranks; p += blockDim.x)
        if (!wait_ge(bufs.at<const uint64_t>(p, ctrl.ready), n, deadline, sink, p))
            s_ok = 0;
    __syncthreads();
    // Other threads of the block read peer data next: order their loads after the acquires.
    __threadfence_system();
    if (threadIdx.x == 0)
        s_round = s_ok ? n : 0;
    __syncthreads();
    return s_round;
}

// End of the pull kernel, reached by every thread of every block once its reads of the peers' send
// areas are done (n: the round, 0 after a timeout). The last block to arrive (CTRL_PULL_ARRIVE counts
// them, and is re-armed to 0 for the next kernel) records the round as complete (ROUND, read by my
// next stage kernel) and tells every peer DONE = n. A block's loads of peer memory are complete once
// their values were stored (before the __syncthreads); its arrival is ordered after them by the fence.
DEEPEP_DEVICE void end_round(const PeerBuffers& bufs, const ControlLayout& ctrl, uint64_t n) {
    __syncthreads();
    if (threadIdx.x != 0 || n == 0)
        return;
    __threadfence();
    unsigned int* arrive = bufs.at<unsigned int>(bufs.rank, ctrl.pull_arrive);
    if (atomicAdd(arrive, 1u) != gridDim.x - 1)
        return;
    atomicExch(arrive, 0u);
    *bufs.at<volatile uint64_t>(bufs.rank, ctrl.round) = n;
    __threadfence_system();
    for (int p = 0; p < bufs.num_ranks; ++p)
        st_release_sys(bufs.at<uint64_t>(p, ctrl.done + 8 * bufs.rank), n);
}

// Tokens handed out one at a time through my TOKEN_TICKET word (the dispatch's stage kernel, the
// combine's pull kernel): the grid finishes together even when its blocks start late or its tokens
// differ in cost, where a fixed grid stride leaves the last sweep to whichever warps drew the most work.
// A warp issues its next draw before working on the current token and reads it after (issue_draw /
// take_draw): with one row in flight per warp, a draw between rows had halved the copy rate.
// Every warp draws until it gets a ticket past the last one, so num_tickets + warps tickets are drawn
// in all; the warp that draws the last one re-arms the word for the next kernel (every other warp has
// drawn its last ticket by then; the next kernel that draws, a later op's, starts after this one ends).
DEEPEP_DEVICE unsigned int issue_draw(unsigned int* ticket, int lane) {
    return lane == 0 ? atomicAdd(ticket, 1u) : 0u;
}

DEEPEP_DEVICE int64_t take_draw(unsigned int* ticket, unsigned int v, int64_t num_tickets, int lane) {
    if (lane == 0 && v == static_cast<unsigned int>(num_tickets) + gridDim.x * (blockDim.x / 32) - 1)
        atomicExch(ticket, 0u);
    return static_cast<int64_t>(__shfl_sync(0xffffffffu, v, 0));
}

// A warp's copy of one row in chunks of kChunk 16-byte words per lane: the caller issues the first
// chunk's loads, then its other loads for the row (scales, top-k), then stores, so one row costs
// one memory round trip instead of one per part.
template <int kNumInt4, int kChunk = 16>
struct RowCopy {
    int4 v[kChunk];

    DEEPEP_DEVICE void load(const int4* __restrict__ src, int base, int lane) {
#pragma unroll
        for (int u = 0; u < kChunk; ++u)
            if (base + lane + 32 * u < kNumInt4)
                v[u] = src[base + lane + 32 * u];
    }
    DEEPEP_DEVICE void store(int4* __restrict__ dst, int base, int lane) const {
#pragma unroll
        for (int u = 0; u < kChunk; ++u)
            if (base + lane + 32 * u < kNumInt4)
                dst[base + lane + 32 * u] = v[u];
    }
    // The remaining chunks, after the first one was loaded and stored by the caller.
    DEEPEP_DEVICE void copy_rest(int4* __restrict__ dst, const int4* __restrict__ src, int lane) {
        for (int base = 32 * kChunk; base < kNumInt4; base += 32 * kChunk) {
            load(src, base, lane);
            store(dst, base, lane);
        }
    }
};

}  // namespace deepep_portable::intranode
