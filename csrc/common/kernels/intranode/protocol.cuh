// The round protocol shared by intranode dispatch and combine (pull-based).
//
// Every op is one "round" n on a rank's buffer, in two kernels:
//   stage kernel: tell every peer "I finished pulling round n-1 from you" (DONE), wait until every
//                 peer said the same to me (so nobody still reads my send area), copy my outgoing
//                 rows into my own send area.
//   pull kernel:  announce READY = n (my send area holds round n), wait for READY >= n of every
//                 peer, pull the rows I need from the peers' send areas into my outputs.
// Round numbers live in device memory (CTRL_ROUND / CTRL_CURRENT), so a captured CUDA graph that
// replays the kernels keeps counting. Deadlock freedom: each kernel signals before it waits, and
// every wait is on a signal that a peer's *same* round emits unconditionally; with all blocks of
// all ranks resident (the SM budget guarantees it), every wait is eventually satisfied.
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/peers.cuh"
#include "common/kernels/signal.cuh"

namespace deepep_portable::intranode {

// Byte offsets of the control area (mirrors deepep_portable/layout.py).
struct ControlLayout {
    int64_t round, current, ready, error, num_tokens, done, count_to, expert_count, counted, stage_ticket;
};

constexpr int kThreads = 512;   // threads of every intranode launch (host: engines/intranode.THREADS)

// Stage-kernel prologue. Returns the round number n, or 0 when a wait timed out.
DEEPEP_DEVICE uint64_t begin_round(const PeerBuffers& bufs, const ControlLayout& ctrl, uint64_t timeout_ns,
                                   const ErrorSink& sink) {
    __shared__ uint64_t s_round;
    __shared__ int s_ok;
    const uint64_t prev = *bufs.at<volatile uint64_t>(bufs.rank, ctrl.round);   // written only by the last kernel of round n-1
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    if (blockIdx.x == 0) {
        // My pulls of round prev finished with the previous kernel on this stream.
        for (int p = threadIdx.x; p < bufs.num_ranks; p += blockDim.x)
            st_release_sys(bufs.at<uint64_t>(p, ctrl.done + 8 * bufs.rank), prev);
        if (threadIdx.x == 0)
            *bufs.at<volatile uint64_t>(bufs.rank, ctrl.current) = prev + 1;
    }
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

// Last kernel of a round: record it as complete (read by the next round's stage kernel only).
DEEPEP_DEVICE void end_round(const PeerBuffers& bufs, const ControlLayout& ctrl, uint64_t n) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && n != 0)
        *bufs.at<volatile uint64_t>(bufs.rank, ctrl.round) = n;
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
