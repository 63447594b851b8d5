// The `nccl_gin` transport's device side: the contract of common/kernels/transport.cuh over NCCL's device API.
// Peers in my LSA team (NVLink, same node) are reached by load/store through ncclGetPeerPointer, exactly as the
// nvlink backend does; the others through GIN (one context per channel, `ch % contexts`), when the device
// communicator has GIN (the host asked for it: nccl_gin/host.cc).
//
// Ordering ("a signal never overtakes its data"): over LSA, every store of the warp, then a system fence, then
// the signal's release store. Over GIN, a signal is a *strong* VA signal add on the same context as the puts it
// follows: NCCL promises that its visibility implies every earlier put of that context to that peer is
// visible (device_gin.rst; before 2.30.5 every signal is strong). put_signal_warp bundles the signal with its
// put. Nothing orders GIN against LSA stores, and a peer is either LSA or GIN for the whole window: never both.
//
// SET signals over add-only GIN signals: GIN can only ADD to a word of the receiver's window (VA signal); the
// writer keeps the value it last set per (peer, word) and adds the difference (signal_shadow.cuh argues it).
// The receiver polls its own window (acquire), as for every other backend. A full table fails the op with an
// error record (never a wrong value).
//
// Not over GIN: fetch_add (no fetching atomic: kCheapFetchAdd = false keeps the LL dispatch on its path without
// it), and get_value before NCCL 2.30.3 (no get). Such a call records kErrorUnsupported (the next wait_ge
// reports it) and returns ~0, never a hang. NCCL's own GIN waits have no timeout (nccl#2383): none is used here;
// flush is bounded by NCCL's own progress.
//
// Versions: GIN needs VA signals (NCCL >= 2.29.7); with older headers the GIN branches compile out and a GIN
// peer is an unsupported call. LSA works from 2.28.3.
#pragma once

#include <cstdint>

#include <nccl.h>
#include <nccl_device.h>

#include "common/kernels/common.cuh"
#include "common/kernels/errors.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"
#include "backends/nccl_gin/signal_shadow.cuh"

#define DEEPEP_NCCL_AT_LEAST(X, Y, Z) (NCCL_VERSION_CODE >= ((X) * 10000 + (Y) * 100 + (Z)))
#define DEEPEP_NCCL_GIN DEEPEP_NCCL_AT_LEAST(2, 29, 7)
#define DEEPEP_NCCL_GIN_GET DEEPEP_NCCL_AT_LEAST(2, 30, 3)

namespace deepep_portable::transport {

struct NcclGinTransport {
    const ncclDevComm* comm;   // the device communicator (ncclDevCommCreate's), in device memory
    ncclWindow_t win;          // my window's NCCL handle (ncclCommWindowRegister)
    uint64_t base;             // my address of the window start
    int32_t rank;
    int32_t num_ranks;
    int32_t gin_contexts;      // GIN contexts of `comm` (0: LSA only)
    int32_t lsa_first;         // my LSA team is the ranks [lsa_first, lsa_first + lsa_size) (ncclTeamLsa: stride 1)
    int32_t lsa_size;
    int32_t pad;
    SignalShadow shadow;
    int64_t scratch_offset;    // u64 words in my window where get_value's GIN reads land
    unsigned int* scratch_ticket;
    int* failure;              // device int32 [3]: claim, peer, code (published last); reported by wait_ge

    static constexpr int kScratchWords = 1024;

    // Which peers are LSA is known at run time only; channels are GIN contexts; ordering per (context, peer)
    // holds only for strong signals, so ordered_delivery is false.
    static constexpr Capabilities capabilities() {
        Capabilities c{};
        c.peer_load_store = false;
        c.remote_atomics = false;
        c.ordered_delivery = false;
        c.max_channels = 1;
        c.graph_safe = true;
        c.network = Network::kOther;
        return c;
    }

    static constexpr bool kCheapFetchAdd = false;   // no fetching atomic over GIN
    static constexpr bool kSignalCoversWarp = false;   // GIN's NIC reads what the lanes stored: every lane fences

    template <typename U = void>
    DEEPEP_DEVICE U* local_ptr(int64_t off) const {
        return reinterpret_cast<U*>(base + static_cast<uint64_t>(off));
    }

    // Load/store pointer into `peer`'s window (my LSA team: NVLink, same GPU), or nullptr (behind GIN).
    // ncclGetPeerPointer itself does not check that the peer is in the team (it computes an address for
    // any rank), so the team bounds are checked here.
    template <typename U = void>
    DEEPEP_DEVICE U* peer_ptr(int64_t off, int peer) const {
        if (static_cast<unsigned>(peer - lsa_first) >= static_cast<unsigned>(lsa_size)) return nullptr;
        return static_cast<U*>(ncclGetPeerPointer(win, static_cast<size_t>(off), peer));
    }

    DEEPEP_DEVICE void fail(int peer, int code) const {
        if (atomicCAS(failure, 0, 1) == 0) {
            failure[1] = peer;
            __threadfence();
            atomicExch(failure + 2, code);
        }
    }

    DEEPEP_DEVICE int64_t window_offset(const void* src) const {
        return static_cast<int64_t>(reinterpret_cast<uint64_t>(src) - base);
    }

#if DEEPEP_NCCL_GIN
    DEEPEP_DEVICE ncclGin context(int ch) const { return ncclGin(*comm, ch % gin_contexts); }

#if DEEPEP_NCCL_AT_LEAST(2, 30, 5)
    using Signal = ncclGin_StrongVASignalAdd;
#else
    using Signal = ncclGin_VASignalAdd;   // every signal is strong before 2.30.5
#endif

    // SET v at (peer, off) as an add of the difference to the last value set there (signal_shadow.cuh).
    DEEPEP_DEVICE bool delta_for(int peer, int64_t off, uint64_t v, uint64_t* delta) const {
        if (shadow.delta_for(peer, off, v, delta))
            return true;
        fail(peer, 1);   // the shadow table is full
        return false;
    }
#endif

    // Whole warp, same arguments on every lane. No order, no visibility promise. GIN: `src` must lie in my
    // window (the engines stage what goes to network peers there).
    DEEPEP_DEVICE void put_warp(int ch, int peer, int64_t dst_off, const void* src, int64_t bytes, int lane) const {
        if (void* dst = peer_ptr(dst_off, peer)) {
            warp_copy_bytes(dst, src, bytes, lane);
        } else {
#if DEEPEP_NCCL_GIN
            context(ch).put(ncclTeamWorld(*comm), peer, win, static_cast<size_t>(dst_off), win,
                            static_cast<size_t>(window_offset(src)), static_cast<size_t>(bytes), ncclGin_None{},
                            ncclGin_None{}, ncclCoopWarp());
#else
            if (lane == 0)
                fail(peer, 2);
#endif
        }
        __syncwarp();
    }

    DEEPEP_DEVICE void put2_warp(int ch, int peer, int64_t off0, int64_t n0, int64_t off1, const void* src, int64_t n1,
                                 int lane) const {
        if (void* dst0 = peer_ptr(off0, peer)) {
            warp_copy_split(dst0, n0, peer_ptr(off1, peer), src, n1, lane);
            __syncwarp();
            return;
        }
        put_warp(ch, peer, off0, src, n0, lane);
        put_warp(ch, peer, off1, static_cast<const char*>(src) + n0, n1, lane);
    }

    // Whole warp. Once `peer` reads v at sig_off, this put's data is visible there.
    DEEPEP_DEVICE void put_signal_warp(int ch, int peer, int64_t dst_off, const void* src, int64_t bytes,
                                       int64_t sig_off, uint64_t v, int lane) const {
        if (peer_ptr(dst_off, peer) != nullptr) {
            put_warp(ch, peer, dst_off, src, bytes, lane);
            if (lane == 0)
                signal(ch, peer, sig_off, v);
            __syncwarp();
            return;
        }
#if DEEPEP_NCCL_GIN
        uint64_t delta = 0;
        int ok = lane == 0 ? static_cast<int>(delta_for(peer, sig_off, v, &delta)) : 0;
        ok = __shfl_sync(0xffffffffu, ok, 0);
        delta = __shfl_sync(0xffffffffu, delta, 0);
        if (ok)
            context(ch).put(ncclTeamWorld(*comm), peer, win, static_cast<size_t>(dst_off), win,
                            static_cast<size_t>(window_offset(src)), static_cast<size_t>(bytes),
                            Signal{win, static_cast<size_t>(sig_off), delta}, ncclGin_None{}, ncclCoopWarp());
#else
        if (lane == 0)
            fail(peer, 2);
#endif
        __syncwarp();
    }

    // One thread. Strong: once v is visible at the peer, every earlier op of this thread (and of its warp,
    // fenced and synchronized) to that peer on this channel is visible.
    DEEPEP_DEVICE void signal(int ch, int peer, int64_t sig_off, uint64_t v) const {
        if (uint64_t* sig = peer_ptr<uint64_t>(sig_off, peer)) {
            __threadfence_system();
            st_release_sys(sig, v);
            return;
        }
#if DEEPEP_NCCL_GIN
        uint64_t delta = 0;
        if (delta_for(peer, sig_off, v, &delta))
            context(ch).signal(ncclTeamWorld(*comm), peer, Signal{win, static_cast<size_t>(sig_off), delta},
                               ncclCoopThread());
#else
        fail(peer, 2);
#endif
    }

    // One thread. Small write, no order promise.
    DEEPEP_DEVICE void put_value(int ch, int peer, int64_t dst_off, uint64_t v) const {
        if (volatile uint64_t* dst = peer_ptr<volatile uint64_t>(dst_off, peer)) {
            *dst = v;
            return;
        }
#if DEEPEP_NCCL_GIN
        context(ch).putValue(ncclTeamWorld(*comm), peer, win, static_cast<size_t>(dst_off), v);
#else
        fail(peer, 2);
#endif
    }

    // One thread. A load for LSA peers; a GIN get into a scratch word then a flush (NCCL >= 2.30.3), else ~0
    // and a recorded failure.
    DEEPEP_DEVICE uint64_t get_value(int ch, int peer, int64_t off) const {
        if (const volatile uint64_t* src = peer_ptr<const volatile uint64_t>(off, peer))
            return *src;
#if DEEPEP_NCCL_GIN && DEEPEP_NCCL_GIN_GET
        const unsigned int i = atomicAdd(scratch_ticket, 1u) % kScratchWords;
        const int64_t at = scratch_offset + 8 * static_cast<int64_t>(i);
        ncclGin g = context(ch);
        g.get(ncclTeamWorld(*comm), peer, win, static_cast<size_t>(off), win, static_cast<size_t>(at), 8,
              ncclCoopThread());
        g.flush(ncclCoopThread());   // for a get: the data has arrived
        return ld_acquire_sys(local_ptr<const uint64_t>(at));
#else
        fail(peer, 3);
        return ~0ull;
#endif
    }

    // One thread. Only between LSA peers (a system-scope atomic on the peer's mapping); GIN has no fetching
    // atomic: a recorded failure and ~0.
    DEEPEP_DEVICE uint64_t fetch_add(int /*ch*/, int peer, int64_t off, uint64_t v) const {
        if (unsigned long long* p = peer_ptr<unsigned long long>(off, peer))
            return atomicAdd_system(p, static_cast<unsigned long long>(v));
        fail(peer, 4);
        return ~0ull;
    }

    // One thread. Acquire-poll of MY window until >= v; false + an error record naming `peer` at the
    // deadline, or at once naming the failed peer after a recorded failure of this rank.
    DEEPEP_DEVICE bool wait_ge(int64_t sig_off, uint64_t v, uint64_t deadline_ns, const ErrorSink& sink,
                               int peer) const {
        const uint64_t* sig = local_ptr<const uint64_t>(sig_off);
        while (ld_acquire_sys(sig) < v) {
            const int code = *reinterpret_cast<const volatile int*>(failure + 2);
            if (code != 0) {
                deepep_portable::report_error(sink, deepep_portable::kErrorUnsupported, failure[1], code);
                return false;
            }
            if (deepep_portable::globaltimer_ns() > deadline_ns) {
                deepep_portable::report_error(sink, deepep_portable::kErrorTimeout, peer, static_cast<int>(v));
                return false;
            }
        }
        return true;
    }

    // One thread. Earlier GIN ops of this thread on this channel are locally complete (sources reusable).
    DEEPEP_DEVICE void flush(int ch) const {
#if DEEPEP_NCCL_GIN
        if (gin_contexts > 0)
            context(ch).flush(ncclCoopThread());
#endif
    }

    // Whole block. The owners zeroed their words in [begin, end) (clean_low_latency_buffer, between two
    // barriers): forget what I set there, so my next SET adds its whole value (else the difference to the
    // last value, now gone, would wrap). Only this rank's kernels touch the table, in stream order.
    DEEPEP_DEVICE void forget_signals(int64_t begin, int64_t end) const {
        shadow.forget(begin, end, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
    }
};

}  // namespace deepep_portable::transport
