// One RDMA operation on one queue pair, start to finish: the ibgda backend's verbs, as host + device code
// over sq.cuh's posting protocol. device.cuh maps the transport contract onto them; the tests run them on
// host threads against a software NIC (tests/native/ibgda_transport_model.cu), every rank a thread.
//
// Every WQE asks for a CQE (kCqUpdate): the CQ is collapsed (one entry the NIC rewrites), so a CQE costs
// the NIC one 64-byte write and lets `completed` follow every WQE. That is what makes "this WQE is done"
// (get_value, fetch_add: their results) and "everything I posted is done" (flush) simple waits.
#pragma once

#include <cstdint>

#include "backends/ibgda/mlx5.cuh"
#include "backends/ibgda/sq.cuh"

namespace deepep_portable::ibgda {

// My queue pair to one peer on one channel, with what its WQEs name: the peer's window as its NIC
// addresses it (raddr_base + offset, rkey) and my window's key (sources of writes, targets of reads).
struct Endpoint {
    SendQueue q;
    uint64_t raddr_base;
    uint32_t rkey;
    uint32_t lkey;
};

// RDMA WRITE (kOpRdmaWrite: my `laddr` -> the peer's window at `roff`) or READ (kOpRdmaRead: the other way)
// of `bytes`, one WQE of ctrl + raddr + data segments.
template <typename GiveUp>
DEEPEP_HOST_DEVICE Word post_rdma(const Endpoint& e, uint8_t opcode, uint64_t laddr, uint64_t roff, uint32_t bytes,
                                  GiveUp give_up, CqStatus* error) {
    return post(e.q, [&](uint8_t* w, uint16_t pi) {
        mlx5::write_rdma(w, opcode, pi, e.q.qpn, mlx5::kCqUpdate, e.raddr_base + roff, e.rkey, laddr, e.lkey, bytes);
    }, give_up, error);
}

template <typename GiveUp>
DEEPEP_HOST_DEVICE Word post_write(const Endpoint& e, uint64_t laddr, uint64_t roff, uint32_t bytes, GiveUp give_up,
                                   CqStatus* error) {
    return post_rdma(e, mlx5::kOpRdmaWrite, laddr, roff, bytes, give_up, error);
}

// RDMA WRITE of one 8-byte value carried in the WQE (no local memory): signals and put_value.
template <typename GiveUp>
DEEPEP_HOST_DEVICE Word post_value(const Endpoint& e, uint64_t roff, uint64_t value, GiveUp give_up, CqStatus* error) {
    return post(e.q, [&](uint8_t* w, uint16_t pi) {
        mlx5::write_inline(w, pi, e.q.qpn, mlx5::kCqUpdate, e.raddr_base + roff, e.rkey, &value, 8);
    }, give_up, error);
}

template <typename GiveUp>
DEEPEP_HOST_DEVICE Word post_read(const Endpoint& e, uint64_t roff, uint64_t laddr, uint32_t bytes, GiveUp give_up,
                                  CqStatus* error) {
    return post_rdma(e, mlx5::kOpRdmaRead, laddr, roff, bytes, give_up, error);
}

// 8-byte FETCH_ADD on the peer's window at `roff`; the old value lands big-endian at my `laddr`.
template <typename GiveUp>
DEEPEP_HOST_DEVICE Word post_fetch_add(const Endpoint& e, uint64_t roff, uint64_t add, uint64_t laddr, GiveUp give_up,
                                       CqStatus* error) {
    return post(e.q, [&](uint8_t* w, uint16_t pi) {
        mlx5::write_atomic(w, mlx5::kOpAtomicFa, pi, e.q.qpn, mlx5::kCqUpdate, e.raddr_base + roff, e.rkey, add, 0,
                           laddr, e.lkey);
    }, give_up, error);
}

// Wait until every WQE before index `end` completed (completed >= end). False on an error CQE (in `*error`)
// or when give_up() says so.
template <typename GiveUp>
DEEPEP_HOST_DEVICE bool wait_completed(const SendQueue& q, Word end, GiveUp give_up, CqStatus* error) {
    SysAtomic<Word> completed(*q.completed);
    while (completed.load(cuda::memory_order_acquire) < end) {
        const CqStatus st = poll_cq(q);
        if (st.error) {
            *error = st;
            return false;
        }
        if (give_up())
            return false;
    }
    return true;
}

// Everything posted on this queue so far is complete (its sources reusable, its results landed).
template <typename GiveUp>
DEEPEP_HOST_DEVICE bool drain(const SendQueue& q, GiveUp give_up, CqStatus* error) {
    return wait_completed(q, SysAtomic<Word>(*q.turn).load(cuda::memory_order_acquire), give_up, error);
}

// Posting stops on a queue that failed (an error CQE, or a give-up while it held a reserved slot): sq.cuh's
// post returns this index.
constexpr Word kNotPosted = ~Word(0);

}  // namespace deepep_portable::ibgda
