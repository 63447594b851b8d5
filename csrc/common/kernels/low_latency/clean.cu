// clean_low_latency_buffer on the device (DeepEP's order): a barrier over the live ranks, zero my
// control words and stage flags and both halves' signals (and forget what I set in the peers' signals: transport.cuh's
// reset), a second barrier. The first barrier means every live peer
// has finished the LL calls it made before (its stream runs them before this kernel), so nobody
// signals into my buffer any more; the second that nobody starts signalling before everyone is clean.
// One block. Shrink mode: a peer that does not reach a barrier in time is masked (report_error) and
// not waited for again; without it the timeout is reported and the host raises.
//
// Over a network a signal may still be in flight after its kernel ended: the LL kernels and this barrier signal
// on channel 0 only, so a peer's barrier signal, once seen, orders every earlier signal it sent here.
// The barrier: each rank keeps in its slot of its own barrier words (Common::barrier_offset, u64 [R],
// never cleaned) how many barriers it has entered; entering the n-th, it SETs its slot at every live
// peer to n (a contract signal: the zeroing before it is ordered first) and waits until every live
// peer's slot here reaches n. Slots only grow (single writer), so no word is ever reset.
//
// Compile-time (-D): the transport (selected_transport.cuh); HIDDEN and NUM_TOPK are not used.
#include <cstdint>

#include "common/kernels/low_latency/protocol.cuh"

using namespace deepep_portable;
using namespace deepep_portable::low_latency;

struct LLCleanParams {
    Common c;
    int64_t control_bytes;    // [0, control_bytes) is zeroed: the control words (error claim excepted), the stage flags
    int64_t signals_begin;    // and the signals of both halves, [signals_begin, signals_end)
    int64_t signals_end;
};

namespace {

DEEPEP_DEVICE void barrier(const LLCleanParams& p, const Transport& tr) {
    const Common& c = p.c;
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    const int me = static_cast<int>(c.rank), num_ranks = static_cast<int>(c.num_ranks);
    __shared__ uint64_t s_count;
    __threadfence_system();   // every thread's earlier stores (the zeroing) before the signals below
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile uint64_t* mine = own<volatile uint64_t>(c, c.barrier_offset + 8 * me);
        s_count = *mine + 1;
        *mine = s_count;
    }
    __syncthreads();
    const uint64_t n = s_count;
    const ErrorSink sink = sink_of(c, kOpLowLatencyClean);
    for (int q = threadIdx.x; q < num_ranks; q += blockDim.x)
        if (q != me && !rank_masked(c, q))
            tr.signal(0, q, c.barrier_offset + 8 * me, n);
    for (int q = threadIdx.x; q < num_ranks; q += blockDim.x)
        if (q != me && !rank_masked(c, q))
            tr.wait_ge(c.barrier_offset + 8 * q, n, deadline, sink, q);
    __syncthreads();
}

}  // namespace

namespace deepep_portable::low_latency {

__global__ void __launch_bounds__(kThreads) clean_buffer(const __grid_constant__ LLCleanParams p) {
    const Common& c = p.c;
    const Transport tr = c.transport;
    barrier(p, tr);
    // The error claim stays: the host saw it clear before launching, and a timeout of the first barrier
    // (without shrink) must reach the host intact.
    uint64_t* words = own<uint64_t>(c, 0);
    for (int64_t i = threadIdx.x; i < p.control_bytes / 8; i += blockDim.x)
        if (reinterpret_cast<uint64_t>(words + i) != (reinterpret_cast<uint64_t>(c.error_claim) & ~7ull))
            words[i] = 0;
    for (int64_t i = p.signals_begin / 8 + threadIdx.x; i < p.signals_end / 8; i += blockDim.x)
        own<uint64_t>(c, 0)[i] = 0;
    // Every peer zeroes the same range of its window meanwhile: a backend that sets signals as adds of
    // differences must start again from 0 there (transport.cuh).
    tr.forget_signals(p.signals_begin, p.signals_end);
    barrier(p, tr);
}

}  // namespace deepep_portable::low_latency
