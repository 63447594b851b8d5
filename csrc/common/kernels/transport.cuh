// The transport contract: what kernel code may ask of a transport, and what each answer promises.
//
// Kernels are written once against a transport type (a backend's csrc/backends/<name>/device.cuh
// provides it; the host picks which: selected_transport.cuh). A transport object is a small struct
// passed in the kernel's parameter struct, so it lives in constant memory; its methods are
// __device__ and cheap to call. Conformance: csrc/common/kernels/transport_selftest.cu exercises every
// primitive and its promise on the GPU, for any backend (tests/mpi/test_transport_selftest_gpu_mpi.py).
//
// Windows: every rank owns a window (a buffer the others can address) of the same size; all
// offsets below are byte offsets inside the window, identical on every rank (symmetric layout).
// Channels: an explicit small integer (a QP, a GIN context, a proxy ring...). Ordering promises hold
// only within one (channel, peer) pair; the host maps channels over NIC ports. Transports without
// such resources ignore it.
//
// | primitive                               | who calls  | promise                                                  |
// |-----------------------------------------|------------|----------------------------------------------------------|
// | peer_ptr(off, peer)                     | any thread | load/store pointer into peer's window, or nullptr        |
// | put_warp(ch, peer, dst_off, src, bytes) | whole warp | non-blocking write; no order, no visibility promise      |
// | put2_warp(ch, peer, off0, n0, off1,     | whole warp | put_warp of src[0, n0) to off0 and src[n0, n0 + n1) to   |
// |           src, n1)                      |            | off1: one message split over two places (one round of    |
// |                                         |            | loads for a load/store peer)                             |
// | put_signal_warp(..., sig_off, v)        | whole warp | once the peer reads v at sig_off, this put's data is     |
// |                                         |            | visible there                                            |
// | signal(ch, peer, sig_off, v)            | one thread | strong: once visible, every earlier op of this thread    |
// |                                         |            | on (ch, peer) is visible, and every earlier op of its    |
// |                                         |            | warp once the warp's lanes fenced and synchronized       |
// |                                         |            | (__threadfence_system(); __syncwarp();) before the call  |
// | put_value(ch, peer, dst_off, u64)       | one thread | small inline write, no order promise                     |
// | get_value(ch, peer, off)                | one thread | blocking read of a u64 in peer's window: a value the     |
// |                                         |            | word held at some point during the call (no ordering)    |
// | fetch_add(ch, peer, off, v)             | one thread | blocking atomic add to a u64 in peer's window, returns   |
// |                                         |            | the old value; atomic only against other fetch_adds of   |
// |                                         |            | the word; a later signal() orders it like a put          |
// | wait_ge(sig_off, v, deadline, sink, p)  | one thread | acquire-poll of MY window until >= v; false + an error   |
// |                                         |            | record naming peer p once the deadline passes             |
// | flush(ch)                               | one thread | earlier ops of this thread, and of its warp under the    |
// |                                         |            | signal() condition, are locally complete (their sources  |
// |                                         |            | reusable); no remote promise                             |
// | forget_signals(begin, end)              | whole block| every rank's owner zeroed its words in [begin, end) (all |
// |                                         |            | ranks, between two barriers): my later signals there     |
// |                                         |            | start again from 0                                       |
//
// Signals are single-writer 64-bit sequence numbers set (not added): a signal slot has exactly one
// writing rank, values only grow, and writing the same value twice is harmless, so no signal needs
// network atomics. The one exception is a reset (clean_low_latency_buffer): every owner zeroes a range of
// its words and every writer calls forget_signals for it, between two barriers, so no signal is in flight
// (a backend that emulates SET over ADD keeps what it last set per word, and must start again from 0). "No
// signal in flight" rests on channel order: every signal into the range and the barrier's own go on channel 0,
// so a barrier signal seen means every earlier signal of that writer there has landed.
// fetch_add is the one atomic of the contract: the LL dispatch reserves its rows in
// the receiver's output with it (a load/store atomic for P2P peers, a network AMO otherwise, which the
// capability record's remote_atomics states), when the transport's kCheapFetchAdd says it is cheap (a
// compile-time constant of each transport type; the LL dispatch has a path without it). Never rely
// on two puts arriving in order.
//
// Each backend states in its device.cuh how it keeps "a signal never overtakes its data", and in its
// compile-time kSignalCoversWarp whether one lane's signal, after a __syncwarp, also covers the other
// lanes' earlier stores and puts to that peer (true: a kernel signals without a fence on every lane first).
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/signal.cuh"

namespace deepep_portable::transport {

// What a backend can do; the host fills the same record for `available_transports()`.
// Host mirror: deepep_portable/contract.py (Capabilities); tests/test_transports.py checks each
// backend's record against its Python class.
enum class Network : int { kNone = 0, kInfiniBand = 1, kRoCE = 2, kOther = 3 };

struct Capabilities {
    bool peer_load_store;    // peer_ptr() is non-null for every peer of the node
    bool remote_atomics;     // fetch_add reaches peers behind a network (P2P peers: always)
    bool ordered_delivery;   // puts on one (channel, peer) arrive in order (never relied on)
    int max_channels;        // channels the host set up (>= 1)
    bool graph_safe;         // every primitive may be captured in a CUDA graph
    Network network;
};

// Copy `bytes` (a multiple of 16, 16-byte aligned on both sides) with a whole warp.
// Latency, not bandwidth, bounds an LL message: every load of a round is issued before its first
// store, and the tail is predicated into the same round instead of a serial loop (a 7 KB FP8
// message is one round trip per lane, a 14 KB bf16 row two). kUnroll words per lane stay in registers.
template <int kUnroll = 16>
DEEPEP_DEVICE void warp_copy_bytes(void* __restrict__ dst, const void* __restrict__ src, int64_t bytes, int lane) {
    int4* d = static_cast<int4*>(dst);
    const int4* s = static_cast<const int4*>(src);
    const int64_t n = bytes / 16;
    for (int64_t i = lane; i < n; i += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + 32 * u < n)
                v[u] = s[i + 32 * u];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + 32 * u < n)
                d[i + 32 * u] = v[u];
    }
}

// Copy `n0 + n1` bytes from one contiguous source to two places with a whole warp: src[0, n0) to dst0,
// src[n0, n0 + n1) to dst1 (both multiples of 16, 16-byte aligned). One round of loads, like
// warp_copy_bytes: a message whose head and body live apart costs one memory round trip, not two.
template <int kUnroll = 16>
DEEPEP_DEVICE void warp_copy_split(void* __restrict__ dst0, int64_t n0, void* __restrict__ dst1,
                                   const void* __restrict__ src, int64_t n1, int lane) {
    // 32-bit word indices (a message is far below 2^31 words): fewer registers in the unrolled round.
    const int w0 = static_cast<int>(n0 / 16), n = static_cast<int>((n0 + n1) / 16);
    const int4* s = static_cast<const int4*>(src);
    int4* d0 = static_cast<int4*>(dst0);
    int4* d1 = static_cast<int4*>(dst1) - w0;   // so word i >= w0 goes to d1 + i (never dereferenced below w0)
    for (int i = lane; i < n; i += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + 32 * u < n)
                v[u] = s[i + 32 * u];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + 32 * u < n)
                (i + 32 * u < w0 ? d0 : d1)[i + 32 * u] = v[u];
    }
}

}  // namespace deepep_portable::transport
