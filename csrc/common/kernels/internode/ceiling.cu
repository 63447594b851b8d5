// The internode bench's ceiling (tools/internode_ceiling.py): an op's own rank-to-rank traffic moved in
// one launch with the op's blocks and nothing else. Rows that cross the network go through the transport's
// put_warp to the rank the op sends them to; rows that stay in the node are copied by load/store into the
// node peer's window, as the op's NVLink part moves them. No handshake, no signals, no waits, no staging:
// the op cannot move the same bytes faster through the same paths.
//
// Compile-time (-D): NUM_RANKS, RANKS_PER_NODE (for protocol.cuh's Common and node tables).
#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/internode/protocol.cuh"
#include "common/kernels/transport.cuh"

using namespace deepep_portable;
using namespace deepep_portable::internode;

// One piece of traffic: 4 int64 words. Host mirror: tools/internode_ceiling.traffic_pieces.
//   [0] destination | via << 32   via 0: transport put to global rank `destination`;
//                                 via 1: load/store into the node peer of local index `destination`
//   [1] destination byte offset in its window, [2] source byte offset in my window, [3] bytes (multiple of 16)
struct TrafficCeilingParams {
    Common common;
    const int64_t* pieces;
    int64_t num_pieces;
};

namespace deepep_portable::internode {

__global__ void __launch_bounds__(kThreads) traffic_ceiling(const __grid_constant__ TrafficCeilingParams p) {
    const Common& c = p.common;
    const int lane = threadIdx.x % 32;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; i < p.num_pieces; i += warps) {
        const int64_t* piece = p.pieces + 4 * i;
        const int destination = static_cast<int>(piece[0] & 0xffffffff);
        const char* src = local<const char>(c, piece[2]);
        if ((piece[0] >> 32) != 0)
            transport::warp_copy_bytes(node_peer<char>(c, destination, piece[1]), src, piece[3], lane);
        else
            c.transport.put_warp(channel_of(c, destination / kRanksPerNode, static_cast<int>(i % kMaxChunks)),
                                 destination, piece[1], src, piece[3], lane);
    }
    // Timed until every put is locally complete, as the op's last kernel waits for its own.
    __threadfence_system();
    __syncwarp();
    if (lane == 0)
        for (int ch = 0; ch < c.num_channels; ++ch)
            c.transport.flush(ch);
}

}  // namespace deepep_portable::internode
