// One rank's view of every rank's window when all of them are mapped here (CUDA IPC / shareable VMM
// memory between the ranks of a node): window bases by rank, addressed by byte offset. The intranode
// kernels use it directly; the nvlink backend's Transport is built on it.
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"

namespace deepep_portable {

struct PeerBuffers {
    const uint64_t* bases;   // [num_ranks] base address of each rank's window, mapped here (own included)
    int rank;
    int num_ranks;

    template <typename T>
    DEEPEP_DEVICE T* at(int peer, int64_t offset) const {
        return reinterpret_cast<T*>(bases[peer] + static_cast<uint64_t>(offset));
    }
};

}  // namespace deepep_portable
