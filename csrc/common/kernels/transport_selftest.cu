// Conformance of a backend to the transport contract (transport.cuh): every primitive and its promise,
// on the GPU, written once against transport::Selected. Any backend runs it by building this file for
// its window (deepep_portable/engines/transport_selftest.py; tests/mpi/test_transport_selftest_gpu_mpi.py).
//
// One block of kThreads on every rank, all ranks at once. Warps [0, kSenders) send, the others receive;
// senders never wait for a peer, so every wait is for work that is already under way (no deadlock), and
// every wait is bounded (wait_ge with a deadline).
//
// Round r of a run carries seq_r = seq_base + r, and seq_base grows run to run, so a word or signal of an
// earlier round or run is told apart from this one's. Sender warp, for each peer p (itself included) and
// round r = 1..rounds, from its stage (a range of its own window, so a network peer can read it) holding
// words {me, p, seq_r, i ^ kMagic}:
//   put_warp(A) + put2_warp(C0 | C1, the two halves of the stage), the warp fenced and synchronized (the
//   contract's condition for a warp's puts to count as the signalling thread's), then on one lane
//   put_value(V = seq_r) + fetch_add(counter, 1) + get_value(id word) + signal(sigA = seq_r)
//                                                       -- "signal: once visible, every earlier op on
//                                                          (ch, p) is visible";
//   put_signal_warp(B, sigB = seq_r)                    -- "once p reads v, this put's data is there";
//   flush, then the stage is poisoned (seq 0)           -- "flush: sources reusable": a put still reading
//                                                          the stage would deliver poison.
// Receiver warp, for each source s and round r: wait_ge(sigA >= seq_r) first (B, signalled later, must
// not be what makes A visible), then every word of A, C0 and C1 must be {s, me, seq in [seq_r, last seq
// of the run], i ^ kMagic} and V >= seq_r; then wait_ge(sigB >= seq_r) and the same for B. Data of a later
// round may already be there (senders run ahead); data older than the signal, or poison, never. The host
// checks the rest: every peer_ptr, each counter's fetch_add results (all distinct: the adds are atomic)
// and final value, and in mode 1 that a wait on a word nobody writes times out with an error record
// naming the peer.
#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/errors.cuh"
#include "common/kernels/selected_transport.cuh"
#include "common/kernels/signal.cuh"

using namespace deepep_portable;
using Transport = transport::Selected;

namespace {
constexpr int kThreads = 512;              // host: engines/transport_selftest.THREADS
constexpr int kSenders = kThreads / 64;    // half the warps send, half receive
constexpr int kMagic = 0x5e1f7e57;
// out[] (int64, host mirror: engines/transport_selftest.py OUT_*)
constexpr int kOutMismatches = 0;          // received words that broke a promise
constexpr int kOutGetValue = 1;            // get_value results that were not the peer's id word
constexpr int kOutWaits = 2;               // waits that succeeded
constexpr int kOutTimedOut = 3;            // mode 1: 1 when the wait on the silent word returned false
constexpr int kOutPeerPtr = 4;             // [num_ranks]: 1 when peer_ptr(0, p) is not null
// then [num_ranks][rounds]: what fetch_add returned for (peer, round), -1 where it was not asked
}  // namespace

struct SelftestParams {
    Transport transport;       // the backend's struct (the window's transport_params)
    uint64_t local_base;       // my window
    int64_t rank;
    int64_t num_ranks;
    int64_t rounds;
    int64_t bytes;             // bytes per put: a multiple of 32 (two halves of 16-byte words)
    uint64_t seq_base;         // round r's words and signals carry seq_base + r (the host grows it run to run)
    int64_t mode;              // 0: the rounds; 1: wait on the silent word (must time out)
    int64_t timeout_peer;      // mode 1: the peer the timeout record names
    int64_t timeout_ns;        // every wait gives up this long after the kernel starts
    unsigned int* error_claim;
    int* error_host;
    int64_t* out;
    // window layout (deepep_portable/layout.py SelftestLayout)
    int64_t id_off;            // u64: rank * 1000 + 7, written by the host before the launch
    int64_t counter_off;       // u64: every rank fetch_adds 1 per round
    int64_t silent_off;        // u64: nobody writes it
    int64_t sig_a_off;         // u64 [num_ranks]: slot s written by s only
    int64_t sig_b_off;
    int64_t value_off;         // u64 [num_ranks]
    int64_t zone_a_off;        // [num_ranks][bytes]
    int64_t zone_b_off;
    int64_t zone_c0_off;       // [num_ranks][bytes / 2]
    int64_t zone_c1_off;
    int64_t stage_off;         // [num_ranks][bytes]: my stage for each peer
};

namespace {

template <typename U>
DEEPEP_DEVICE U* own(const SelftestParams& p, int64_t off) {
    return reinterpret_cast<U*>(p.local_base + static_cast<uint64_t>(off));
}

DEEPEP_DEVICE ErrorSink sink_of(const SelftestParams& p) {
    return ErrorSink{p.error_claim, p.error_host, kOpTransportSelftest, static_cast<int>(p.rank)};
}

DEEPEP_DEVICE int4 word(int src, int dst, int seq, int i) {
    return make_int4(src, dst, seq, i ^ kMagic);
}

// Words [first, first + n) of a zone from `src`: each must be src's word i of a round with seq in
// [lo, hi] (un-cached loads: a later round rewrites the same bytes).
DEEPEP_DEVICE int count_bad(const int4* zone, int first, int n, int src, int me, int lo, int hi, int lane) {
    int bad = 0;
    for (int i = lane; i < n; i += 32) {
        const int4 w = __ldcv(zone + i);
        bad += !(w.x == src && w.y == me && w.z >= lo && w.z <= hi && (w.w ^ kMagic) == first + i);
    }
    return bad;
}

DEEPEP_DEVICE bool warp_wait(const Transport& tr, int64_t off, uint64_t v, uint64_t deadline, const ErrorSink& sink,
                             int peer, int lane) {
    int ok = 0;
    if (lane == 0)
        ok = tr.wait_ge(off, v, deadline, sink, peer) ? 1 : 0;
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();   // lane 0's acquire orders the other lanes' reads after it
    return ok != 0;
}

DEEPEP_DEVICE void send(const SelftestParams& p, const Transport& tr, int peer, int lane) {
    const int me = static_cast<int>(p.rank);
    const int n = static_cast<int>(p.bytes / 16);
    const int64_t half_bytes = p.bytes / 2;
    int4* stage = own<int4>(p, p.stage_off + peer * p.bytes);
    int64_t* fetched = p.out + kOutPeerPtr + p.num_ranks + peer * p.rounds;
    for (int r = 1; r <= p.rounds; ++r) {
        const uint64_t seq = p.seq_base + r;
        for (int i = lane; i < n; i += 32)
            stage[i] = word(me, peer, static_cast<int>(seq), i);
        __threadfence_system();   // a NIC may read the stage
        __syncwarp();
        tr.put_warp(0, peer, p.zone_a_off + me * p.bytes, stage, p.bytes, lane);
        tr.put2_warp(0, peer, p.zone_c0_off + me * half_bytes, half_bytes, p.zone_c1_off + me * half_bytes, stage,
                     half_bytes, lane);
        __threadfence_system();   // every lane's puts before lane 0's signal (the contract's warp condition)
        __syncwarp();
        if (lane == 0) {
            tr.put_value(0, peer, p.value_off + 8 * me, seq);
            // A backend without network atomics (remote_atomics false: nccl_gin's GIN) is not asked for one
            // over its network: -1, which the host leaves out of the count.
            const bool atomic = Transport::capabilities().remote_atomics || tr.peer_ptr(0, peer) != nullptr;
            fetched[r - 1] = atomic ? static_cast<int64_t>(tr.fetch_add(0, peer, p.counter_off, 1)) : -1;
            if (tr.get_value(0, peer, p.id_off) != static_cast<uint64_t>(peer) * 1000 + 7)
                atomicAdd(reinterpret_cast<unsigned long long*>(p.out + kOutGetValue), 1ull);
            tr.signal(0, peer, p.sig_a_off + 8 * me, seq);
        }
        __syncwarp();
        tr.put_signal_warp(0, peer, p.zone_b_off + me * p.bytes, stage, p.bytes, p.sig_b_off + 8 * me, seq, lane);
        __threadfence_system();   // flush's warp condition, as signal's
        __syncwarp();
        if (lane == 0)
            tr.flush(0);
        __syncwarp();
        for (int i = lane; i < n; i += 32)
            stage[i] = word(-1, -1, 0, i);   // poison: a put that still read the stage would deliver it
        __syncwarp();
    }
}

DEEPEP_DEVICE void receive(const SelftestParams& p, const Transport& tr, int src, uint64_t deadline, int lane) {
    const int me = static_cast<int>(p.rank), rounds = static_cast<int>(p.rounds);
    const int n = static_cast<int>(p.bytes / 16), half = n / 2;
    const ErrorSink sink = sink_of(p);
    const int4* a = own<const int4>(p, p.zone_a_off + src * p.bytes);
    const int4* b = own<const int4>(p, p.zone_b_off + src * p.bytes);
    const int4* c0 = own<const int4>(p, p.zone_c0_off + src * p.bytes / 2);
    const int4* c1 = own<const int4>(p, p.zone_c1_off + src * p.bytes / 2);
    const int last = static_cast<int>(p.seq_base) + rounds;   // the run's last seq
    int bad = 0, waits = 0;
    for (int r = 1; r <= rounds; ++r) {
        const uint64_t seq = p.seq_base + r;
        const int lo = static_cast<int>(seq);
        if (!warp_wait(tr, p.sig_a_off + 8 * src, seq, deadline, sink, src, lane))
            break;
        ++waits;
        bad += count_bad(a, 0, n, src, me, lo, last, lane);
        bad += count_bad(c0, 0, half, src, me, lo, last, lane);
        bad += count_bad(c1, half, n - half, src, me, lo, last, lane);
        if (lane == 0)
            bad += __ldcv(own<const unsigned long long>(p, p.value_off + 8 * src)) < seq;
        if (!warp_wait(tr, p.sig_b_off + 8 * src, seq, deadline, sink, src, lane))
            break;
        ++waits;
        bad += count_bad(b, 0, n, src, me, lo, last, lane);
    }
    for (int off = 16; off >= 1; off /= 2)
        bad += __shfl_xor_sync(0xffffffffu, bad, off);
    if (lane == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(p.out + kOutMismatches), static_cast<unsigned long long>(bad));
        atomicAdd(reinterpret_cast<unsigned long long*>(p.out + kOutWaits), static_cast<unsigned long long>(waits));
    }
}

}  // namespace

namespace deepep_portable::selftest {

__global__ void __launch_bounds__(kThreads) transport_selftest(const __grid_constant__ SelftestParams p) {
    const Transport tr = p.transport;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int num_ranks = static_cast<int>(p.num_ranks);
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(p.timeout_ns);
    if (p.mode == 1) {
        if (threadIdx.x == 0)
            p.out[kOutTimedOut] = tr.wait_ge(p.silent_off, 1, deadline, sink_of(p), static_cast<int>(p.timeout_peer)) ? 0 : 1;
        return;
    }
    if (threadIdx.x < num_ranks)
        p.out[kOutPeerPtr + threadIdx.x] = tr.peer_ptr<void>(0, threadIdx.x) != nullptr ? 1 : 0;
    if (warp < kSenders) {
        for (int peer = warp; peer < num_ranks; peer += kSenders)
            send(p, tr, peer, lane);
    } else {
        for (int src = warp - kSenders; src < num_ranks; src += kThreads / 32 - kSenders)
            receive(p, tr, src, deadline, lane);
    }
}

}  // namespace deepep_portable::selftest
