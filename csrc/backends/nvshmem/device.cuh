// The `nvshmem` transport's device side: every primitive of common/kernels/transport.cuh mapped onto
// NVSHMEM's PUBLIC device API (nvshmem.h / nvshmemx.h) and nothing else: no nvshmemi_* symbol, no
// header under non_abi/ is named here (DeepEP broke when NVSHMEM's internals moved).
//
// Build: kernels that include this header must be compiled relocatable (-rdc=true) and device-linked
// against libnvshmem_device.a (deepep_portable/transports/nvshmem/link.py does both), then the loaded module must
// be registered with nvshmemx_cumodule_init (deepep_portable/transports/nvshmem/runtime.py) before launch:
// that call fills the module's copy of NVSHMEM's device state.
//
// Windows. A window is a range of the symmetric heap (nvshmem_malloc, collective, same size on every
// PE). The struct holds this PE's address of the window start (`base`); offsets are symmetric, so
// base + off is this PE's address of a symmetric object, which is what NVSHMEM's remote routines take
// (they translate it for the target PE themselves). Only the window's own memory may be a put's
// destination or a signal; a put's *source* must be symmetric or registered memory as well whenever
// a peer is reached over a network (IBGDA / proxy transports read it with the NIC); P2P peers accept
// any device memory.
//
// Channels: ignored for now. Everything goes through NVSHMEM's default context, and NVSHMEM spreads
// work over its own QPs / proxy channels; its ordering promises (fence, put-with-signal) are per
// target PE and do not need a channel. (NVSHMEM >= 3.6 headers also have QP-directed calls
// (nvshmemx_qp_*); they are not used so that 3.4.x, the version on the lent H200, works.)
//
// Two paths per peer, fixed for the life of the window: a peer that nvshmem_ptr maps (NVLink, same
// GPU) is written with this warp's own stores and signalled with a system fence + release store,
// exactly the nvlink backend's protocol (NVSHMEM's own P2P puts are the same stores behind a library
// call per put); every other peer goes through the NVSHMEM routines below. One peer never mixes the
// two, so each path's ordering argument stands alone.
//
// Network path. "A signal never overtakes its data" (cited from the NVSHMEM API documentation, not its code):
//  * put_signal_warp uses nvshmemx_putmem_signal_nbi_warp(..., NVSHMEM_SIGNAL_SET, pe). The
//    put-with-signal routines "copy data from a contiguous local data object to a data object on a
//    specified PE and subsequently update a remote flag to signal completion" (Signaling Operations):
//    the signal update is ordered after the data ("the delivery of signal flag on the remote PE
//    indicates only the delivery of its corresponding dest data words", OpenSHMEM 1.5 put-with-signal
//    notes), so a PE that reads the new signal value THROUGH A POINT-TO-POINT ROUTINE (wait_ge
//    below) reads the data. Signal updates are atomic with respect to other signal operations on
//    that object and to the point-to-point routines that access it.
//  * signal() is nvshmem_fence() then nvshmemx_signal_op(..., NVSHMEM_SIGNAL_SET, pe). nvshmem_fence
//    "ensures ordering of delivery of operations on symmetric data objects": every operation issued
//    to a PE before the fence (memory stores, blocking and non-blocking puts, AMOs) is delivered
//    before any later operation to that PE (Memory Ordering). It orders delivery, not completion,
//    and only per target PE, which is exactly the contract's (channel, peer) promise. Like every
//    SHMEM ordering routine it covers the CALLING thread's operations only, so the puts issued by
//    the other lanes of a warp-collective put_warp are brought in by the __syncwarp at the end of
//    put_warp (a warp barrier orders memory among its lanes; for NVLink / same-GPU peers, where
//    puts are stores, the fence is a system-scope fence, cumulative over what the lane observed):
//    call signal() from a lane of the warp that issued the puts, or after a __syncthreads.
//  * wait_ge polls this PE's copy of the signal with nvshmem_uint64_test(NVSHMEM_CMP_GE), NOT a plain
//    load: the fence notes say the TARGET PE must use the point-to-point routines (wait_until /
//    test) "to guarantee ordering of its memory accesses", and signal updates are only atomic with
//    respect to those routines (Signaling Operations, atomicity). The documentation does not call
//    the test's own read an acquire, so a successful test is followed by a system-scope acquire
//    fence (what the contract's acquire-poll promises for data written by NVLink / same-GPU stores). The loop adds the
//    deadline and ErrorSink record of the contract (NVSHMEM's wait_until has no timeout).
//  * flush is nvshmem_quiet(): completion of every earlier put / AMO / store of the calling thread
//    (remote completion, stronger than the contract's local completion; no weaker public call).
//
// Scopes: put_warp / put_signal_warp call NVSHMEM's *_warp routines, which every lane of a
// converged warp must call with the same arguments; signal / put_value / wait_ge / flush are
// single-thread routines (nvshmem_fence, nvshmemx_signal_op, nvshmem_uint64_p, nvshmem_uint64_g,
// nvshmem_uint64_atomic_fetch_add, nvshmem_uint64_test, nvshmem_quiet); peer_ptr (nvshmem_ptr) any thread.
#pragma once

#include <cstdint>

#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/kernels/common.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"

namespace deepep_portable::transport {

struct NvshmemTransport {
    uint64_t base;    // this PE's address of the window start (from nvshmem_malloc)
    int rank;         // nvshmem_my_pe() in NVSHMEM_TEAM_WORLD (== the library rank)
    int num_ranks;    // nvshmem_n_pes()
    // [num_ranks] nvshmem_ptr(base, r) per PE (0: behind a network), filled by the host; peers with an
    // entry take the load/store path. nullptr: every primitive goes through the NVSHMEM routines (the
    // self-test uses that to exercise them between P2P peers).
    const uint64_t* peer_bases;

    // peer_load_store is only known at run time (nvshmem_ptr per peer: NVLink / same GPU -> non-null,
    // network -> null), so it is declared false here; kernels must test peer_ptr's result.
    // remote_atomics: fetch_add is an NVSHMEM AMO for peers behind a network.
    // network: whichever NVSHMEM picked (P2P, IBGDA, IBRC, UCX, libfabric): kOther.
    static constexpr Capabilities capabilities() {
        Capabilities c{};
        c.peer_load_store = false;
        c.remote_atomics = true;
        c.ordered_delivery = false;
        c.max_channels = 1;
        c.graph_safe = true;
        c.network = Network::kOther;
        return c;
    }

    // fetch_add is cheap enough to use once per (expert, sender): a system-scope atomic on NVSHMEM's
    // VMM mapping for P2P peers (measured on the H200 emulation), one network AMO otherwise.
    static constexpr bool kCheapFetchAdd = true;

    // A network peer's puts are the NVSHMEM routines', ordered by nvshmem_fence per calling thread as far
    // as its documentation says: a kernel fences on every lane before one lane signals.
    static constexpr bool kSignalCoversWarp = false;

    template <typename U = void>
    DEEPEP_DEVICE U* local_ptr(int64_t off) const {
        return reinterpret_cast<U*>(base + static_cast<uint64_t>(off));
    }

    // Load/store pointer into `peer`'s window, or nullptr when the peer is not P2P-reachable
    // (nvshmem_ptr's documented null result). For peer == rank it is the local address.
    template <typename U = void>
    DEEPEP_DEVICE U* peer_ptr(int64_t off, int peer) const {
        return static_cast<U*>(nvshmem_ptr(local_ptr<const void>(off), peer));
    }

    // The load/store address of `peer`'s window at `off` when that peer takes the load/store path.
    template <typename U = void>
    DEEPEP_DEVICE U* direct_ptr(int64_t off, int peer) const {
        if (peer_bases == nullptr || peer_bases[peer] == 0)
            return nullptr;
        return reinterpret_cast<U*>(peer_bases[peer] + static_cast<uint64_t>(off));
    }

    // Whole warp, same arguments on every lane. No order, no visibility promise. A peer reachable by
    // load/store (NVLink, same GPU) gets the warp's own stores, as in the nvlink backend (NVSHMEM's
    // putmem_warp would do the same copy behind a call per put); others an NVSHMEM put. Ends with a
    // __syncwarp so a later signal()/flush() from any lane of this warp follows every lane's part.
    DEEPEP_DEVICE void put_warp(int /*ch*/, int peer, int64_t dst_off, const void* src, int64_t bytes,
                                int lane) const {
        if (void* dst = direct_ptr(dst_off, peer))
            warp_copy_bytes(dst, src, bytes, lane);
        else
            nvshmemx_putmem_nbi_warp(local_ptr(dst_off), src, static_cast<size_t>(bytes), peer);
        __syncwarp();
    }

    // Whole warp: one source, two destinations (see the contract). Load/store peers: one round of loads;
    // others: two NVSHMEM puts.
    DEEPEP_DEVICE void put2_warp(int /*ch*/, int peer, int64_t off0, int64_t n0, int64_t off1, const void* src,
                                 int64_t n1, int lane) const {
        void* dst0 = direct_ptr(off0, peer);
        if (dst0 != nullptr) {
            warp_copy_split(dst0, n0, direct_ptr(off1, peer), src, n1, lane);
        } else {
            nvshmemx_putmem_nbi_warp(local_ptr(off0), src, static_cast<size_t>(n0), peer);
            nvshmemx_putmem_nbi_warp(local_ptr(off1), static_cast<const char*>(src) + n0, static_cast<size_t>(n1), peer);
        }
        __syncwarp();
    }

    // Whole warp. Once `peer` reads v at sig_off, the data of this put is visible there.
    DEEPEP_DEVICE void put_signal_warp(int ch, int peer, int64_t dst_off, const void* src, int64_t bytes,
                                       int64_t sig_off, uint64_t v, int lane) const {
        if (direct_ptr(dst_off, peer) != nullptr) {
            put_warp(ch, peer, dst_off, src, bytes, lane);
            if (lane == 0)
                signal(ch, peer, sig_off, v);
            __syncwarp();
            return;
        }
        nvshmemx_putmem_signal_nbi_warp(local_ptr(dst_off), src, static_cast<size_t>(bytes),
                                        local_ptr<uint64_t>(sig_off), v, NVSHMEM_SIGNAL_SET, peer);
        __syncwarp();
    }

    // One thread. Strong: once v is visible at the peer, every earlier op of this thread (and of its
    // warp, see put_warp) to that peer is delivered. Load/store peers: system fence + release store
    // (every earlier store of the warp went through the same path: reachability is fixed per peer).
    DEEPEP_DEVICE void signal(int /*ch*/, int peer, int64_t sig_off, uint64_t v) const {
        if (uint64_t* sig = direct_ptr<uint64_t>(sig_off, peer)) {
            __threadfence_system();
            st_release_sys(sig, v);
            return;
        }
        nvshmem_fence();
        nvshmemx_signal_op(local_ptr<uint64_t>(sig_off), v, NVSHMEM_SIGNAL_SET, peer);
    }

    // One thread. Small inline write, no order promise.
    DEEPEP_DEVICE void put_value(int /*ch*/, int peer, int64_t dst_off, uint64_t v) const {
        if (volatile uint64_t* dst = direct_ptr<volatile uint64_t>(dst_off, peer))
            *dst = v;
        else
            nvshmem_uint64_p(local_ptr<uint64_t>(dst_off), v, peer);
    }

    // One thread. Remote read: a load for load/store peers, a blocking NVSHMEM get (RDMA read) otherwise.
    DEEPEP_DEVICE uint64_t get_value(int /*ch*/, int peer, int64_t off) const {
        if (const volatile uint64_t* src = direct_ptr<const volatile uint64_t>(off, peer))
            return *src;
        return nvshmem_uint64_g(local_ptr<const uint64_t>(off), peer);
    }

    // One thread. Atomic add returning the old value. fetch_adds on one word must all go through ONE
    // mechanism: a GPU atomic and a NIC's AMO on the same address are not atomic with respect to each
    // other. So the load/store path (a system-scope atomic on the peer's mapping) is taken only when
    // every peer is load/store; as soon as one peer is behind a network, every fetch_add is NVSHMEM's
    // fetching AMO (atomic with respect to the other AMOs on that object: the library's promise).
    // A later signal() orders it: the fence before the signal covers AMOs (Memory Ordering).
    DEEPEP_DEVICE uint64_t fetch_add(int /*ch*/, int peer, int64_t off, uint64_t v) const {
        if (every_peer_load_store())
            return atomicAdd_system(direct_ptr<unsigned long long>(off, peer), static_cast<unsigned long long>(v));
        return nvshmem_uint64_atomic_fetch_add(local_ptr<uint64_t>(off), v, peer);
    }

    DEEPEP_DEVICE bool every_peer_load_store() const {
        if (peer_bases == nullptr)
            return false;
        for (int r = 0; r < num_ranks; ++r)
            if (peer_bases[r] == 0)
                return false;
        return true;
    }

    // One thread. Acquire-poll (nvshmem_uint64_test + acquire fence, see the header comment) of MY
    // window's copy of the signal; false and an error record naming `peer` once deadline_ns
    // (globaltimer) passes.
    DEEPEP_DEVICE bool wait_ge(int64_t sig_off, uint64_t v, uint64_t deadline_ns, const ErrorSink& sink,
                               int peer) const {
        uint64_t* sig = local_ptr<uint64_t>(sig_off);
        while (!nvshmem_uint64_test(sig, NVSHMEM_CMP_GE, v)) {
            if (deepep_portable::globaltimer_ns() > deadline_ns) {
                deepep_portable::report_error(sink, deepep_portable::kErrorTimeout, peer, static_cast<int>(v));
                return false;
            }
        }
        // The test is not documented as an acquire: this fence makes it one at system scope, so reads
        // after wait_ge (and, through a later __syncthreads, other threads' reads) see the data.
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        return true;
    }

    // One thread. Earlier ops of this thread are complete (sources reusable); nvshmem_quiet also
    // completes them remotely, which the contract does not promise. Skipped when every peer takes the
    // load/store path (stores are complete once issued): a quiet may involve NVSHMEM's proxy thread.
    DEEPEP_DEVICE void flush(int /*ch*/) const {
        if (!every_peer_load_store())
            nvshmem_quiet();
    }

    DEEPEP_DEVICE void forget_signals(int64_t /*begin*/, int64_t /*end*/) const {}   // SET is a real write
};

}  // namespace deepep_portable::transport
