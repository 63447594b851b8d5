// The `ibgda` transport's device side: every primitive of common/kernels/transport.cuh as WQEs the GPU
// writes into its own mlx5 queue pairs (ops.cuh over sq.cuh, encoder mlx5.cuh), one RC QP per (peer,
// channel); peers with a load/store address in `peer_bases` (the ranks of my node, mapped by the host:
// CUDA IPC on a real NIC) take the nvlink protocol instead, and the host may make no QP to them.
//
// "A signal never overtakes its data" for a load/store peer is the nvlink backend's argument: put_warp's
// lanes store the data and synchronize (__syncwarp), then signal's lane fences at system scope (cumulative,
// so it covers what the warp stored before the barrier) and stores the value with a system-scope release; a
// reader that acquires it sees the data. kSignalCoversWarp stays false (the NIC path needs every lane's
// fence), which only adds fences on this path. A given (table, peer) always takes one path, never both.
//
// "A signal never overtakes its data" on the network path: a put's WRITEs and the signal's inline WRITE
// go to the same RC QP, in that order (the signal is posted after the warp's puts were posted: __syncwarp,
// then lane 0 posts both, or the signal later from the same lane). An RC QP executes its requests in
// order, and the NIC's writes into the receiver's memory are PCIe posted writes that stay in order as
// long as the memory is registered WITHOUT relaxed ordering (IBV_ACCESS_RELAXED_ORDERING lets the root
// complex reorder them; the host registers the windows without it). So once the receiver's acquire load
// sees the signal value, every byte of the earlier WRITEs on that QP is in its memory. This rests on
// RC ordering and PCIe posted-write ordering, not on the PRM's fence modes; a first run on real hardware
// must check it (docs/IBGDA.md). Two puts on one QP also land in order, but the contract never relies on
// it; different channels are different QPs with no order at all.
//
// Completions: every WQE asks for a CQE (ops.cuh), so get_value / fetch_add wait for their own WQE and
// flush(ch) waits for everything posted on that channel's QPs. An error CQE or a wait past timeout_ns
// (ring full, a QP stuck) is recorded once in `nic_error` and makes the primitive give up; the next wait_ge
// of any thread reports it (kErrorNic: op, rank, peer, the failed QP's channel, syndrome), so a dead link
// becomes an exception, never a hang or a trap. After a failure every wait inside a primitive gives up at
// once (a post that finds ring space posts anyway: harmless, the op is lost). On a collapsed CQ a later
// WQE's WR_FLUSH (0x05) entry can overwrite the error entry before a poller reads it: the recorded syndrome
// may then be 0x05; the host can ask the QP's state for the first cause.
//
// fetch_add goes through the NIC wherever this rank has a QP to the peer, load/store peer or not (a GPU
// atomic and a NIC atomic on one word are not atomic with respect to each other), always on channel 0 (NIC
// atomics are atomic only against atomics of the same responder NIC, and channels may map to different NICs).
// Where the host made no QP to a peer (a load/store peer of the low-latency table: my node, self included,
// under allow_nvlink_for_low_latency_mode) it is a system-scope GPU atomic on the mapping, as in the nvlink
// backend; it is then atomic against the fetch_adds of the ranks that share that mapping, not against NIC
// atomics of other nodes' ranks on the same word. No kernel over this backend fetch_adds (kCheapFetchAdd is
// false: the LL dispatch takes its path without it); the conformance test does, on one node or with every
// peer behind the NIC. The old value of a NIC atomic comes back in the byte order the HCA reports
// (atomic_req_8B_endianness_mode): `atomic_result_be` says which.
//
// Scopes: put_warp / put2_warp / put_signal_warp are warp-collective (the lanes synchronize, lane 0
// posts); signal / put_value / get_value / fetch_add / wait_ge / flush are one-thread calls. Several
// warps may post on one QP at once (sq.cuh's reserve / turn protocol).
#pragma once

#include <cstdint>

#include "backends/ibgda/ops.cuh"
#include "common/kernels/common.cuh"
#include "common/kernels/errors.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"

namespace deepep_portable::transport {

struct IbgdaTransport {
    const ibgda::Endpoint* endpoints;   // [num_ranks * channels]: my QP to (peer, channel); a zero queue where the
                                        // host made none (a load/store peer)
    const uint64_t* peer_bases;         // [num_ranks] load/store address of a peer's window here, 0 = network
    uint64_t base;                      // my window here (also what my lkey registers)
    int64_t scratch_offset;             // u64 [kScratchWords] in my window: where READ / FETCH_ADD results land
    unsigned int* scratch_ticket;       // device word handing out scratch words
    int* nic_error;                     // device int32 [6]: claim, peer, syndrome, wqe index, code (published
                                        // last), channel (the failed QP is my QP to (peer, channel))
    int32_t rank;
    int32_t num_ranks;
    int32_t channels;
    int32_t atomic_result_be;           // 1: the HCA returns 8-byte atomic results big-endian
    int64_t timeout_ns;                 // bound of every wait inside a primitive (ring space, its own completion)

    static constexpr int kScratchWords = 8192;
    static constexpr int64_t kMaxMessage = int64_t(1) << 30;   // bytes of one WRITE (log_msg_max 30; < the inline flag)

    // Known at run time only (which peers are load/store, the NIC's link layer, the channels the host made):
    // declared conservatively here; the host's record says what this Buffer has.
    static constexpr Capabilities capabilities() {
        Capabilities c{};
        c.peer_load_store = false;
        c.remote_atomics = true;
        c.ordered_delivery = true;
        c.max_channels = 1;
        c.graph_safe = true;
        c.network = Network::kOther;
        return c;
    }

    // A network FETCH_ADD costs a round trip per call: the LL dispatch takes its path without it.
    static constexpr bool kCheapFetchAdd = false;

    // The NIC reads what the lanes stored: every lane fences before one lane posts the signal.
    static constexpr bool kSignalCoversWarp = false;

    template <typename U = void>
    DEEPEP_DEVICE U* local_ptr(int64_t off) const {
        return reinterpret_cast<U*>(base + static_cast<uint64_t>(off));
    }

    template <typename U = void>
    DEEPEP_DEVICE U* peer_ptr(int64_t off, int peer) const {
        return peer_bases[peer] == 0 ? nullptr : reinterpret_cast<U*>(peer_bases[peer] + static_cast<uint64_t>(off));
    }

    DEEPEP_DEVICE const ibgda::Endpoint& endpoint(int ch, int peer) const {
        return endpoints[peer * channels + (ch % channels)];
    }

    // Record the first failure of this rank's queues: claim, fields, then the code (readers test the code).
    DEEPEP_DEVICE void fail(int ch, int peer, int syndrome, int wqe_index) const {
        if (atomicCAS(nic_error, 0, 1) == 0) {
            nic_error[1] = peer;
            nic_error[2] = syndrome;
            nic_error[3] = wqe_index;
            nic_error[5] = ch % channels;
            __threadfence();
            atomicExch(nic_error + 4, static_cast<int>(kErrorNic));
        }
    }

    DEEPEP_DEVICE bool failed() const { return *reinterpret_cast<const volatile int*>(nic_error + 4) != 0; }

    // A deadline-bound give_up for sq.cuh's waits; after a failure of this rank's queues every wait gives up.
    struct Deadline {
        uint64_t at;
        const int* error;
        DEEPEP_DEVICE bool operator()() const {
            return *reinterpret_cast<const volatile int*>(error + 4) != 0 || deepep_portable::globaltimer_ns() > at;
        }
    };
    DEEPEP_DEVICE Deadline deadline() const {
        return Deadline{deepep_portable::globaltimer_ns() + static_cast<uint64_t>(timeout_ns), nic_error};
    }

    // The outcome of one posting or waiting step: record a failure that is not already recorded.
    DEEPEP_DEVICE bool check(bool ok, int ch, int peer, const ibgda::CqStatus& st) const {
        if (!ok && !failed())
            fail(ch, peer, st.error ? st.cqe.syndrome : -1, st.error ? st.cqe.wqe_counter : -1);
        return ok;
    }

    // A WRITE of any size: pieces of at most kMaxMessage bytes, in order on the one QP.
    DEEPEP_DEVICE void write(int ch, int peer, uint64_t laddr, int64_t dst_off, int64_t bytes) const {
        for (int64_t done = 0; done < bytes; done += kMaxMessage) {
            const int64_t n = bytes - done < kMaxMessage ? bytes - done : kMaxMessage;
            ibgda::CqStatus st{};
            const ibgda::Word idx = ibgda::post_write(endpoint(ch, peer), laddr + static_cast<uint64_t>(done),
                                                      static_cast<uint64_t>(dst_off + done), static_cast<uint32_t>(n),
                                                      deadline(), &st);
            if (!check(idx != ibgda::kNotPosted, ch, peer, st))
                return;
        }
    }

    // Whole warp. No order, no visibility promise. The source must lie in my window for a network peer
    // (the NIC reads it with my lkey), and its stores must be visible to the NIC: the lanes' stores are
    // ordered before lane 0's post by the __syncwarp and sq.cuh's system-scope fence before the doorbell.
    DEEPEP_DEVICE void put_warp(int ch, int peer, int64_t dst_off, const void* src, int64_t bytes, int lane) const {
        if (void* dst = peer_ptr(dst_off, peer)) {
            warp_copy_bytes(dst, src, bytes, lane);
        } else {
            __syncwarp();
            if (lane == 0 && bytes > 0)
                write(ch, peer, reinterpret_cast<uint64_t>(src), dst_off, bytes);
        }
        __syncwarp();
    }

    DEEPEP_DEVICE void put2_warp(int ch, int peer, int64_t off0, int64_t n0, int64_t off1, const void* src, int64_t n1,
                                 int lane) const {
        if (void* dst0 = peer_ptr(off0, peer)) {
            warp_copy_split(dst0, n0, peer_ptr(off1, peer), src, n1, lane);
        } else {
            __syncwarp();
            if (lane == 0) {
                if (n0 > 0)
                    write(ch, peer, reinterpret_cast<uint64_t>(src), off0, n0);
                if (n1 > 0)
                    write(ch, peer, reinterpret_cast<uint64_t>(src) + static_cast<uint64_t>(n0), off1, n1);
            }
        }
        __syncwarp();
    }

    // Whole warp. The signal is posted after the data on the same QP (see the top of the file).
    DEEPEP_DEVICE void put_signal_warp(int ch, int peer, int64_t dst_off, const void* src, int64_t bytes,
                                       int64_t sig_off, uint64_t v, int lane) const {
        put_warp(ch, peer, dst_off, src, bytes, lane);
        if (lane == 0)
            signal(ch, peer, sig_off, v);
        __syncwarp();
    }

    // One thread. Load/store peers: system fence + release store (the nvlink protocol). Network peers: an
    // inline WRITE on the (channel, peer) QP after everything this thread (and, after the contract's
    // fence + __syncwarp, its warp's lane 0) posted there.
    DEEPEP_DEVICE void signal(int ch, int peer, int64_t sig_off, uint64_t v) const {
        if (uint64_t* sig = peer_ptr<uint64_t>(sig_off, peer)) {
            __threadfence_system();
            st_release_sys(sig, v);
            return;
        }
        put_value(ch, peer, sig_off, v);
    }

    DEEPEP_DEVICE void put_value(int ch, int peer, int64_t dst_off, uint64_t v) const {
        if (volatile uint64_t* dst = peer_ptr<volatile uint64_t>(dst_off, peer)) {
            *dst = v;
            return;
        }
        ibgda::CqStatus st{};
        const ibgda::Word idx = ibgda::post_value(endpoint(ch, peer), static_cast<uint64_t>(dst_off), v, deadline(), &st);
        check(idx != ibgda::kNotPosted, ch, peer, st);
    }

    // A scratch word of my window for one READ / FETCH_ADD result, in rotation: two results share a word only
    // if kScratchWords others were handed out during one call's life (the kernels here take at most a few
    // per (expert, peer) and launch; a call that failed may still land later, but its queue is dead then).
    DEEPEP_DEVICE volatile uint64_t* scratch() const {
        const unsigned int i = atomicAdd(scratch_ticket, 1u) % kScratchWords;
        return local_ptr<volatile uint64_t>(scratch_offset + 8 * static_cast<int64_t>(i));
    }

    // One thread. Blocking read of a u64 of the peer's window. On a failure: ~0 (the failure is recorded and
    // the next wait_ge reports it; ~0 passes the "has the peer moved on" checks callers make with it).
    DEEPEP_DEVICE uint64_t get_value(int ch, int peer, int64_t off) const {
        if (const volatile uint64_t* src = peer_ptr<const volatile uint64_t>(off, peer))
            return *src;
        volatile uint64_t* result = scratch();
        const ibgda::Endpoint& e = endpoint(ch, peer);
        ibgda::CqStatus st{};
        const ibgda::Word idx = ibgda::post_read(e, static_cast<uint64_t>(off), reinterpret_cast<uint64_t>(result), 8,
                                                 deadline(), &st);
        if (!check(idx != ibgda::kNotPosted, ch, peer, st) ||
            !check(ibgda::wait_completed(e.q, idx + 1, deadline(), &st), ch, peer, st))
            return ~0ull;
        return *result;   // the CQE was written after the data (the NIC's order; acquire in poll_cq)
    }

    // One thread. Atomic add on the peer's window, returning the old value: through the NIC on channel 0
    // where I have a QP to `peer`, else a GPU atomic on its load/store mapping (see the top of the file); a
    // peer with neither records a failure.
    DEEPEP_DEVICE uint64_t fetch_add(int /*ch*/, int peer, int64_t off, uint64_t v) const {
        const ibgda::Endpoint& e = endpoint(0, peer);
        if (e.q.ring == nullptr) {
            if (unsigned long long* word = peer_ptr<unsigned long long>(off, peer))
                return atomicAdd_system(word, static_cast<unsigned long long>(v));
            fail(0, peer, -2, -1);
            return 0;
        }
        volatile uint64_t* result = scratch();
        ibgda::CqStatus st{};
        const ibgda::Word idx = ibgda::post_fetch_add(e, static_cast<uint64_t>(off), v, reinterpret_cast<uint64_t>(result),
                                                      deadline(), &st);
        if (!check(idx != ibgda::kNotPosted, 0, peer, st) ||
            !check(ibgda::wait_completed(e.q, idx + 1, deadline(), &st), 0, peer, st))
            return 0;
        return atomic_result_be ? ibgda::mlx5::be64(*result) : *result;
    }

    // One thread. Acquire-poll of MY window; a failure of my queues is reported here too (kErrorNic).
    DEEPEP_DEVICE bool wait_ge(int64_t sig_off, uint64_t v, uint64_t deadline_ns, const ErrorSink& sink, int peer) const {
        const uint64_t* sig = local_ptr<const uint64_t>(sig_off);
        while (ld_acquire_sys(sig) < v) {
            if (failed()) {
                const volatile int* e = nic_error;
                ErrorSink on_qp = sink;   // the record names the failed QP's channel, not the waiting one's
                on_qp.channel = e[5];
                report_error(on_qp, kErrorNic, e[1], e[2]);   // fields written before the code (fail)
                return false;
            }
            if (deepep_portable::globaltimer_ns() > deadline_ns) {
                report_error(sink, kErrorTimeout, peer, static_cast<int>(v));
                return false;
            }
        }
        return true;
    }

    // One thread. Everything posted on channel ch is complete (sources reusable, results landed).
    DEEPEP_DEVICE void flush(int ch) const {
        for (int peer = 0; peer < num_ranks; ++peer) {
            if (peer_bases[peer] != 0)
                continue;
            const ibgda::Endpoint& e = endpoint(ch, peer);
            ibgda::CqStatus st{};
            if (!check(ibgda::drain(e.q, deadline(), &st), ch, peer, st))
                return;
        }
    }

    DEEPEP_DEVICE void forget_signals(int64_t /*begin*/, int64_t /*end*/) const {}   // SET is an RDMA WRITE
};

}  // namespace deepep_portable::transport
