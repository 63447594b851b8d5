// The `nvlink` transport's device side: every peer's window is mapped here (CUDA IPC, or shareable
// VMM memory passed by file descriptor), so every primitive is a load, a store or an atomic.
//
// "A signal never overtakes its data": put_signal_warp's lanes store the data, each lane fences at
// system scope, the warp synchronizes, then one lane stores the signal with a system-scope release;
// a reader that acquires the signal therefore sees the data (causality through the warp barrier).
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/peers.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"

namespace deepep_portable::transport {

// {bases, rank, num_ranks}: every rank's window base, mapped in this process (host mirror:
// deepep_portable/transports/nvlink/window.py NvlinkTransportParams).
struct NvlinkTransport : PeerBuffers {

    static constexpr Capabilities capabilities() {
        Capabilities c{};
        c.peer_load_store = true;
        c.remote_atomics = false;
        c.ordered_delivery = true;
        c.max_channels = 1;
        c.graph_safe = true;
        c.network = Network::kNone;
        return c;
    }

    // Whether fetch_add is cheap depends on how the windows are mapped (the host says, -D): on the
    // H200 emulation (8 processes, one GPU, MPS) an atomic on a legacy CUDA IPC mapping, system or
    // device scope, made the LL dispatch's send phase 84-128 us instead of 38-54 us without it, while
    // shareable VMM mappings (DEEPEP_WINDOW_VMM, as NVSHMEM's heap) take it at full speed. Kernels
    // that would use it once per (expert, sender) take their other path when it is not cheap.
#if defined(DEEPEP_WINDOW_VMM)
    static constexpr bool kCheapFetchAdd = true;
#else
    static constexpr bool kCheapFetchAdd = false;
#endif

    // One lane's signal covers its warp's earlier stores: the lanes' stores come before the __syncwarp
    // (bar.warp.sync orders memory among the warp's lanes), and the signalling lane's system fence is
    // cumulative, so it releases them with the signal. A fence on every lane first only costs time
    // (the LL dispatch's graph-replayed call 0.95-0.96x without it on the H200 emulation).
    static constexpr bool kSignalCoversWarp = true;

    template <typename U = void>
    DEEPEP_DEVICE U* peer_ptr(int64_t off, int peer) const {
        return at<U>(peer, off);
    }

    DEEPEP_DEVICE void put_warp(int /*ch*/, int peer, int64_t dst_off, const void* src, int64_t bytes, int lane) const {
        warp_copy_bytes(peer_ptr(dst_off, peer), src, bytes, lane);
    }

    DEEPEP_DEVICE void put2_warp(int /*ch*/, int peer, int64_t off0, int64_t n0, int64_t off1, const void* src,
                                 int64_t n1, int lane) const {
        warp_copy_split(peer_ptr(off0, peer), n0, peer_ptr(off1, peer), src, n1, lane);
    }

    DEEPEP_DEVICE void put_signal_warp(int ch, int peer, int64_t dst_off, const void* src, int64_t bytes,
                                       int64_t sig_off, uint64_t v, int lane) const {
        put_warp(ch, peer, dst_off, src, bytes, lane);
        __threadfence_system();
        __syncwarp();
        if (lane == 0)
            st_release_sys(peer_ptr<uint64_t>(sig_off, peer), v);
    }

    DEEPEP_DEVICE void signal(int /*ch*/, int peer, int64_t sig_off, uint64_t v) const {
        __threadfence_system();
        st_release_sys(peer_ptr<uint64_t>(sig_off, peer), v);
    }

    DEEPEP_DEVICE void put_value(int /*ch*/, int peer, int64_t dst_off, uint64_t v) const {
        *peer_ptr<volatile uint64_t>(dst_off, peer) = v;
    }

    DEEPEP_DEVICE uint64_t get_value(int /*ch*/, int peer, int64_t off) const {
        return *peer_ptr<const volatile uint64_t>(off, peer);
    }

    // System scope: the word's other writers are other processes' threads, on this GPU or across NVLink.
    DEEPEP_DEVICE uint64_t fetch_add(int /*ch*/, int peer, int64_t off, uint64_t v) const {
        return atomicAdd_system(peer_ptr<unsigned long long>(off, peer), static_cast<unsigned long long>(v));
    }

    DEEPEP_DEVICE bool wait_ge(int64_t sig_off, uint64_t v, uint64_t deadline_ns, const ErrorSink& sink,
                               int peer) const {
        return deepep_portable::wait_ge(peer_ptr<const uint64_t>(sig_off, rank), v, deadline_ns, sink, peer);
    }

    DEEPEP_DEVICE void flush(int /*ch*/) const {}   // stores are complete once issued

    DEEPEP_DEVICE void forget_signals(int64_t /*begin*/, int64_t /*end*/) const {}   // a signal is a plain store
};

}  // namespace deepep_portable::transport
