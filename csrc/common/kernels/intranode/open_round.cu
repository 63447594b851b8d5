// Opens the next round of an intranode buffer ahead of its op, for a zero-copy input: the round's
// prologue alone (begin_round, protocol.cuh). Once it has run, no peer reads my send area any more, so
// the caller may write the op's input there itself (Buffer.get_next_dispatch_buffer: my tokens;
// Buffer.get_next_combine_buffer: my expert outputs) and the op's stage kernel skips those rows.
// begin_round is idempotent within a round (it only waits, and rewrites the same CURRENT), so the op's
// own stage kernel runs it again at no cost. It is no barrier: peers tell DONE at the end of their last
// pull, so it waits only while a peer still reads my last op. Shape-free (no -D): one module serves every op and
// shape. No "dispatch" or "combine" in its name: profiler tables find an op's kernel by that word.
#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/intranode/protocol.cuh"
#include "common/kernels/signal.cuh"

struct OpenRoundParams {
    const uint64_t* peer_bases;
    int64_t rank;
    int64_t num_ranks;
    deepep_portable::intranode::ControlLayout ctrl;
    int64_t op;                   // OpId the round is opened for (errors.cuh): a timeout names it
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
};

namespace deepep_portable::intranode {

__global__ void __launch_bounds__(kThreads) open_round(const __grid_constant__ OpenRoundParams p) {
    const int rank = static_cast<int>(p.rank);
    begin_round(PeerBuffers{p.peer_bases, rank, static_cast<int>(p.num_ranks)}, p.ctrl, p.timeout_ns,
                ErrorSink{p.error_claim, p.error_host, static_cast<int>(p.op), rank});
}

}  // namespace deepep_portable::intranode
