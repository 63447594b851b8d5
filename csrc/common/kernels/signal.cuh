// Signals between ranks: single-writer, monotonically increasing 64-bit sequence numbers.
//
// Ordering rules (the part of the transport contract that load/store peers implement):
//  * signal_set(addr, v): a system-scope release store. Every write this thread made before it,
//    and every write it observed (cumulativity: e.g. a previous kernel's writes, complete at the
//    kernel boundary), is visible to a thread that reads v with an acquire.
//  * wait_ge(addr, v, ...): system-scope acquire loads until *addr >= v or the deadline passes.
//    Setting the same value twice is harmless (SET, not ADD), so no signal needs remote atomics (the
//    LL dispatch's row reservation is the one fetch_add, transport.cuh).
//  * A timed-out wait records (op, rank, peer, channel) once per buffer and returns false; the
//    caller skips the rest of its work instead of hanging or trapping (a trap would kill the
//    CUDA context of every rank sharing it). The host turns the record into an exception.
//  * Shrink mode (a sink with a mask, the LL kernels of a Buffer made with enable_shrink=True): a
//    timed-out wait on a peer masks that peer instead (mask[peer] = 1, no error record); the caller
//    counts the peer as absent and goes on. Masks only grow until the host clears them.
#pragma once

#include <cstdint>
#include <cstdio>

#include "common/kernels/common.cuh"
#include "common/kernels/errors.cuh"

namespace deepep_portable {

DEEPEP_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

DEEPEP_DEVICE void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

DEEPEP_DEVICE int ld_acquire_sys_i32(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

DEEPEP_DEVICE uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Where a failed wait is reported. `claim` is a word in device memory (first writer wins);
// `host` is mapped pinned memory the host polls: [code, op, rank, peer, channel, detail] (codes and
// op ids: errors.cuh).
struct ErrorSink {
    unsigned int* claim;
    int* host;
    int op;
    int rank;
    int* mask = nullptr;   // shrink mode: int32 [ranks], 1 = masked (see the top of the file)
    int channel = -1;      // the transport channel a wait is on, for the record (-1: the block index instead)
};

DEEPEP_DEVICE void report_error(const ErrorSink& sink, int code, int peer, int detail) {
    if (code == kErrorTimeout && sink.mask != nullptr && peer >= 0 && peer != sink.rank) {
        if (atomicExch(sink.mask + peer, 1) == 0)
            printf("deepep_portable: rank %d masked rank %d (op %d): no answer within the timeout\n", sink.rank,
                   peer, sink.op);
        __threadfence_system();
        return;
    }
    if (atomicCAS(sink.claim, 0u, static_cast<unsigned int>(code)) != 0u)
        return;  // someone already reported: keep the first cause
    volatile int* h = sink.host;
    h[1] = sink.op;
    h[2] = sink.rank;
    h[3] = peer;
    h[4] = sink.channel >= 0 ? sink.channel : static_cast<int>(blockIdx.x);
    h[5] = detail;
    __threadfence_system();
    h[0] = code;  // written last: the host reads the record only once the code is set
    __threadfence_system();
}

// Spin until *addr >= v; false (and an error record naming `peer`) once `deadline_ns` passes.
DEEPEP_DEVICE bool wait_ge(const uint64_t* addr, uint64_t v, uint64_t deadline_ns, const ErrorSink& sink,
                           int peer) {
    while (ld_acquire_sys(addr) < v) {
        if (globaltimer_ns() > deadline_ns) {
            report_error(sink, kErrorTimeout, peer, static_cast<int>(v));
            return false;
        }
    }
    return true;
}

}  // namespace deepep_portable
