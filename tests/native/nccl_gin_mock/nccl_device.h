// The tests' mock of the part of NCCL's device API that csrc/backends/nccl_gin/device.cuh uses, so its GIN
// branches (puts, SET-over-ADD signals, put_value, get, flush) run between ranks that share one GPU, where
// NCCL itself refuses to run (tests/nccl_gin_mock.py builds the window; nothing here is NCCL's code).
//
// "GIN" here is every rank's window mapped into this process (shareable VMM memory, as the nvlink window),
// with GIN's promises and no more:
//   * a put's bytes land in no particular order: the 16-byte pieces are stored last to first, after a
//     pseudo-random delay, with plain stores;
//   * signals only ADD (VA signal add): an atomicAdd_system on the peer's word. A signal is strong: it is
//     issued after a system fence that follows every store of the put it rides on (put with a signal) or of
//     the calling thread and its synchronized warp (standalone signal), as NCCL promises for a context;
//   * put_value is a plain store with no order; get reads the peer's word into my window; flush is a fence
//     (every mock operation is complete when its call returns, as after NCCL's flush).
// The LSA team is myself alone (lsaSize = 1), so every peer goes through the GIN branches; or, for the
// internode kernels, my logical node (reached by load/store through ncclGetPeerPointer, the rest by GIN).
#pragma once

#include <cstddef>
#include <cstdint>

#include "nccl.h"

struct ncclWindow_vidmem {
    const unsigned long long* bases;   // [nRanks]: every rank's window as mapped in this process
    int rank;
    int nRanks;
};

struct ncclDevComm {
    int rank;
    int nRanks;
    int lsaRank;
    int lsaSize;
    int ginContextCount;
    int delayNs;                       // upper bound of the pseudo-random delay before a put's stores
};

struct ncclTeam {
    int nRanks;
    int rank;
    int stride;
};

struct ncclCoopThread {
    static constexpr int kThreads = 1;
};
struct ncclCoopWarp {
    static constexpr int kThreads = 32;
};

struct ncclGin_None {};
struct ncclGin_VASignalAdd {
    ncclWindow_t win;
    size_t offset;
    uint64_t value;
};
struct ncclGin_StrongVASignalAdd {
    ncclWindow_t win;
    size_t offset;
    uint64_t value;
};

#ifdef __CUDACC__

__device__ inline ncclTeam ncclTeamWorld(const ncclDevComm& comm) { return ncclTeam{comm.nRanks, comm.rank, 1}; }

__device__ inline void* ncclGetPeerPointer(ncclWindow_t w, size_t offset, int peer) {
    return reinterpret_cast<char*>(w->bases[peer]) + offset;
}

namespace nccl_gin_mock {

__device__ inline uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ inline void delay(const ncclDevComm& comm, uint64_t salt) {
    if (comm.delayNs <= 0)
        return;
    const uint64_t until = now_ns() + (salt * 0x9E3779B97F4A7C15ull >> 40) % static_cast<uint64_t>(comm.delayNs);
    while (now_ns() < until) {
    }
}

template <typename Coop>
__device__ inline int rank_in_coop() {
    return Coop::kThreads == 1 ? 0 : static_cast<int>(threadIdx.x % 32);
}

template <typename Coop>
__device__ inline void coop_sync() {
    if (Coop::kThreads > 1)
        __syncwarp();
}

__device__ inline void add(ncclWindow_t win, int peer, size_t offset, uint64_t value) {
    __threadfence_system();   // strong: after the stores it follows
    atomicAdd_system(reinterpret_cast<unsigned long long*>(win->bases[peer] + offset),
                     static_cast<unsigned long long>(value));
}

template <typename Action>
__device__ inline void signal_after(const Action&, int) {}
__device__ inline void signal_after(const ncclGin_VASignalAdd& s, int peer) { add(s.win, peer, s.offset, s.value); }
__device__ inline void signal_after(const ncclGin_StrongVASignalAdd& s, int peer) {
    add(s.win, peer, s.offset, s.value);
}

}  // namespace nccl_gin_mock

class ncclGin {
public:
    __device__ ncclGin(const ncclDevComm& comm, int context) : comm_(comm), context_(context) {}

    // Every thread of `coop` calls it with the same arguments.
    template <typename Remote, typename Local, typename Coop>
    __device__ void put(ncclTeam, int peer, ncclWindow_t dst_win, size_t dst_off, ncclWindow_t src_win, size_t src_off,
                        size_t bytes, Remote remote, Local, Coop) const {
        const int me = nccl_gin_mock::rank_in_coop<Coop>();
        char* dst = reinterpret_cast<char*>(dst_win->bases[peer]) + dst_off;
        const char* src = reinterpret_cast<const char*>(src_win->bases[src_win->rank]) + src_off;
        nccl_gin_mock::delay(comm_, dst_off ^ (static_cast<uint64_t>(peer) << 48) ^ context_);
        if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
            const int64_t pieces = static_cast<int64_t>(bytes / 16);
            for (int64_t i = pieces - 1 - me; i >= 0; i -= Coop::kThreads)
                reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
        } else {
            for (int64_t i = static_cast<int64_t>(bytes) - 1 - me; i >= 0; i -= Coop::kThreads)
                dst[i] = src[i];
        }
        __threadfence_system();
        nccl_gin_mock::coop_sync<Coop>();
        if (me == 0)
            nccl_gin_mock::signal_after(remote, peer);
        nccl_gin_mock::coop_sync<Coop>();
    }

    template <typename Signal, typename Coop>
    __device__ void signal(ncclTeam, int peer, Signal s, Coop) const {
        if (nccl_gin_mock::rank_in_coop<Coop>() == 0)
            nccl_gin_mock::signal_after(s, peer);
        nccl_gin_mock::coop_sync<Coop>();
    }

    __device__ void putValue(ncclTeam, int peer, ncclWindow_t win, size_t off, uint64_t v) const {
        *reinterpret_cast<volatile uint64_t*>(win->bases[peer] + off) = v;
    }

    template <typename Coop>
    __device__ void get(ncclTeam, int peer, ncclWindow_t src_win, size_t src_off, ncclWindow_t dst_win, size_t dst_off,
                        size_t bytes, Coop) const {
        if (nccl_gin_mock::rank_in_coop<Coop>() == 0)
            for (size_t i = 0; i < bytes; ++i)
                reinterpret_cast<volatile char*>(dst_win->bases[dst_win->rank] + dst_off)[i] =
                    reinterpret_cast<const volatile char*>(src_win->bases[peer] + src_off)[i];
        nccl_gin_mock::coop_sync<Coop>();
    }

    template <typename Coop>
    __device__ void flush(Coop) const {
        __threadfence_system();
    }

private:
    const ncclDevComm& comm_;
    int context_;
};

#endif  // __CUDACC__
