// Posting to an mlx5 send queue from many threads at once, and reading its completions: the part of the
// ibgda backend that has to be right under concurrency. Host and device code: the GPU's warps
// post with it, and tests/test_ibgda_sq.py runs the same code on host threads against a software model
// of the NIC (doorbell watcher, WQE parser, executor, CQE writer), wrap-arounds of the ring and of the
// 16-bit WQE index included.
//
// Protocol for one WQE (R = shared/research/IBGDA.md §2.2; NVSHMEM and DOCA post the same way):
//   1. reserve:  idx = fetch_add(reserve, 1)                        (a slot of its own, any order)
//   2. space:    wait until idx - completed < depth                  (completed: from CQEs, see poll_cq)
//   3. write:    the WQE at ring[idx % depth], its WQE index = idx & 0xffff
//   4. publish:  wait for turn == idx; doorbell record = next WQEBB; doorbell = {idx + 1, qpn};
//                turn = idx + 1
// Step 4 in turn order means the NIC only ever sees a doorbell record and doorbell that cover WQEs
// already written (each is written before its poster's turn ends, and the fences below order the
// WQE stores, then the record, then the doorbell for an observer outside the GPU), and doorbells never
// go backwards (the NIC would stop at the older index). One ring per WQE keeps the argument local;
// batching (one ring for several published WQEs) is an optimisation for later.
// Completions: every WQE that asks for a CQE (kCqUpdate) retires itself and all earlier ones (RC
// completes in order); the CQ is collapsed (the NIC always writes entry 0), so its 16-bit wqe_counter
// is widened against the last value seen. An error CQE is returned to the caller, never spun on.
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "backends/ibgda/mlx5.cuh"

namespace deepep_portable::ibgda {

using Word = unsigned long long;

template <typename T>
using SysAtomic = cuda::atomic_ref<T, cuda::thread_scope_system>;

struct SendQueue {
    uint8_t* ring;          // depth WQEBBs of 64 bytes (memory the NIC reads)
    uint32_t depth;         // a power of two, <= 16384 (poll_cq's 16-bit differences stay exact; the host checks)
    uint32_t qpn;
    Word* reserve;          // next WQEBB to hand out
    Word* turn;             // WQEBBs published, in order
    Word* completed;        // WQEBBs the NIC reported complete (widened from the CQ)
    uint32_t* dbr;          // send doorbell record: big-endian (next WQEBB & 0xffff)
    Word* doorbell;         // the doorbell register (one 8-byte store per ring)
    const uint8_t* cq;      // the collapsed CQ's entry (64 bytes the NIC writes)
};

// What poll_cq found: the completions moved (or not), or the NIC reported an error.
struct CqStatus {
    bool error;
    mlx5::Cqe cqe;          // the entry read (on error: syndrome, QPN, WQE index)
};

// Read the collapsed CQE and advance `completed` to just past the WQE it names (monotonic, widened from
// 16 bits, never past what was published). Any thread may call it at any time. The entry's tail word is
// loaded once with an acquire (the NIC writes it last, in one store): an opcode and a counter from two
// different entries cannot mix; the rest of an error entry is read after that acquire.
DEEPEP_HOST_DEVICE CqStatus poll_cq(const SendQueue& q) {
    const uint32_t tail = SysAtomic<uint32_t>(*const_cast<uint32_t*>(reinterpret_cast<const uint32_t*>(
        q.cq + mlx5::kCqeWqeCounter))).load(cuda::memory_order_acquire);
    const uint8_t opcode = mlx5::cqe_opcode(tail);
    if (opcode == mlx5::kCqeReqErr || opcode == mlx5::kCqeRespErr) {
        mlx5::Cqe cqe = mlx5::read_cqe(q.cq);
        cqe.opcode = opcode;
        cqe.wqe_counter = mlx5::cqe_counter(tail);
        return CqStatus{true, cqe};
    }
    mlx5::Cqe cqe{};
    cqe.opcode = opcode;
    cqe.wqe_counter = mlx5::cqe_counter(tail);
    if (opcode != mlx5::kCqeReq)   // still the 0xff fill: nothing completed yet
        return CqStatus{false, cqe};
    SysAtomic<Word> completed(*q.completed);
    const Word published = SysAtomic<Word>(*q.turn).load(cuda::memory_order_acquire);
    Word seen = completed.load(cuda::memory_order_acquire);
    for (;;) {
        // The completed WQE's distance from the last one counted (seen - 1), from 16 bits: in-flight WQEs
        // are fewer than the depth (<= 2^14), so a signed 16-bit difference is exact; <= 0 means this CQE
        // was already counted (another poller moved `seen` past it). A CQE read long before another poller
        // moved `seen` 2^15 further could alias forward: never count past what was published.
        const int16_t delta = static_cast<int16_t>(static_cast<uint16_t>(cqe.wqe_counter - static_cast<uint16_t>(seen - 1)));
        if (delta <= 0 || seen + static_cast<Word>(delta) > published ||
            completed.compare_exchange_weak(seen, seen + static_cast<Word>(delta), cuda::memory_order_acq_rel))
            return CqStatus{false, cqe};
    }
}

// Post one WQE: `fill(wqe, index16)` writes its segments (the mlx5.cuh builders); `give_up()` is asked
// while waiting for ring space or for the turn (return true to abandon: a deadline passed). Returns
// the WQE's 64-bit index, or ~0 if abandoned before it was published (a reserved but unpublished slot
// blocks the queue: the caller reports the error and the queue is not used again), or if the CQ reported
// an error (`*error` then holds it).
template <typename Fill, typename GiveUp>
DEEPEP_HOST_DEVICE Word post(const SendQueue& q, Fill fill, GiveUp give_up, CqStatus* error) {
    const Word idx = SysAtomic<Word>(*q.reserve).fetch_add(1, cuda::memory_order_relaxed);
    SysAtomic<Word> completed(*q.completed);
    while (idx - completed.load(cuda::memory_order_acquire) >= q.depth) {
        const CqStatus st = poll_cq(q);
        if (st.error) {
            *error = st;
            return ~Word(0);
        }
        if (give_up())
            return ~Word(0);
    }
    fill(q.ring + (idx & (q.depth - 1)) * mlx5::kWqebbBytes, static_cast<uint16_t>(idx));
    SysAtomic<Word> turn(*q.turn);
    while (turn.load(cuda::memory_order_acquire) != idx)
        if (give_up())
            return ~Word(0);
    // The WQE's stores before the record, the record before the doorbell, for an observer outside.
    cuda::atomic_thread_fence(cuda::memory_order_seq_cst, cuda::thread_scope_system);
    SysAtomic<uint32_t>(*q.dbr).store(mlx5::send_dbr(static_cast<uint32_t>(idx + 1)), cuda::memory_order_relaxed);
    cuda::atomic_thread_fence(cuda::memory_order_seq_cst, cuda::thread_scope_system);
    SysAtomic<Word>(*q.doorbell).store(mlx5::doorbell(static_cast<uint16_t>(idx + 1), q.qpn),
                                       cuda::memory_order_relaxed);
    turn.store(idx + 1, cuda::memory_order_release);
    return idx;
}

}  // namespace deepep_portable::ibgda
