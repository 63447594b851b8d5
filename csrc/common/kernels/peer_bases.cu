// Every peer's window address as this rank's device code reaches it: Transport::peer_ptr(0, peer), or 0 where
// the peer has no load/store path. For backends whose host API cannot say (NCCL before 2.29 answers only on
// the device); the engines then take peer bases from here, so host and kernels agree by construction.
#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/selected_transport.cuh"

using namespace deepep_portable;
using Transport = transport::Selected;

struct PeerBasesParams {
    Transport transport;   // the backend's struct (the window's transport_params)
    int64_t num_ranks;
    uint64_t* out;         // [num_ranks]
};

namespace deepep_portable::windows {

__global__ void peer_bases(PeerBasesParams p) {
    for (int64_t peer = threadIdx.x; peer < p.num_ranks; peer += blockDim.x)
        p.out[peer] = reinterpret_cast<uint64_t>(p.transport.template peer_ptr<void>(0, static_cast<int>(peer)));
}

}  // namespace deepep_portable::windows
