// Intranode combine, staged and pulled in one launch: each staged row is flagged as soon as it is in my
// send area, and the rank it belongs to pulls it while it is still in L2 (all ranks of the one-GPU
// emulation share it) instead of after a barrier over every rank's whole staging copy. On real NVLink
// the staging copy hides behind the pulls the same way. Sum and parameters: combine_sum.cuh.
// Every combine takes it, the zero-copy one included (x == nullptr: only the weights are staged), so all
// ranks of a round run the same protocol whatever each one's input (a rank with no rows is never "in place").
// It must: a round in which some ranks ran this kernel and others combine.cu's two would never finish.
//
// Work items, the same sequence on every rank: for each token index b, one stage item per source s
// ("my row holding source s's token b": copy it and its top-k weights into my send area, then flag
// [s][b]), then the pull of my token b - L (wait for the flags of its rows at the ranks it went to,
// then sum them). Item i goes to warp i mod W (W warps in the grid), which takes its items in order.
//   position(stage b, s) = (R+1) b + s,   position(pull b) = (R+1)(b + L) + R,   L = ceil(W / (R+1))
// Deadlock freedom: a pull waits only for stage items at earlier positions of the same sequence on
// other ranks, and stage items wait for nothing; by induction over positions every item completes
// (every warp of every rank is resident: the engine caps grids so that all ranks fit at once). The lag
// L lets the stage items of a token index, which W warps take at once, finish before its pull starts.
//
// The round (protocol.cuh): begin_round; then, before any peer may look at my flags, each block zeroes
// its share of them and builds its share of the row lookup table, the blocks meet (STAGE_TICKET counts
// them: this kernel draws no tickets), and block 0 says READY = n. A puller reads a peer's flags only
// after that peer's READY >= n; flags are set by a system-scope release after the row's stores (every
// lane fences, the warp synchronizes), read by an acquire. DONE = n at the end, as every pull kernel.
//
// Compile-time (-D): NUM_RANKS, HIDDEN (bf16 elements, multiple of 8), NUM_TOPK (0 for none).
#include <cstdint>

#include "common/kernels/intranode/combine_sum.cuh"

using namespace deepep_portable;
using namespace deepep_portable::intranode;

namespace {

DEEPEP_DEVICE void st_release_sys_u32(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

DEEPEP_DEVICE unsigned int ld_acquire_sys_u32(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of this grid arrives; false (and an error record naming my own rank) past the deadline.
DEEPEP_DEVICE bool blocks_meet(unsigned int* arrive, uint64_t deadline, const ErrorSink& sink) {
    __shared__ int s_ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        s_ok = 1;
        __threadfence();
        atomicAdd(arrive, 1u);
        while (ld_acquire_sys_u32(arrive) < gridDim.x) {
            if (globaltimer_ns() > deadline) {
                report_error(sink, kErrorTimeout, sink.rank, -1);
                s_ok = 0;
                break;
            }
        }
    }
    __syncthreads();
    return s_ok != 0;
}

// Stage item: my row holding source s's token b (if I received it) and its weights into my send area
// (the row only when x is not already there: x == nullptr, a zero-copy combine), then its flag.
DEEPEP_DEVICE void stage_row(const CombineParams& p, const PeerBuffers& bufs, const int* last, int s, int64_t b,
                             int lane) {
    if (b > last[s])
        return;
    const int j = p.row_of[s * p.capacity + b];
    if (j < 0)
        return;
    float weight[kTopkPerLane > 0 ? kTopkPerLane : 1];
    const bool has_weights = kNumTopk > 0 && p.topk_weights != nullptr;
#pragma unroll
    for (int u = 0; u < kTopkPerLane; ++u)
        if (has_weights && lane + 32 * u < kNumTopk)
            weight[u] = p.topk_weights[static_cast<int64_t>(j) * kNumTopk + lane + 32 * u];
    if (p.x != nullptr) {   // the weights' loads above are in flight with the row's first chunk
        int4* dst = bufs.at<int4>(bufs.rank, p.send_area_offset) + static_cast<int64_t>(j) * kHiddenInt4;
        const int4* src = p.x + static_cast<int64_t>(j) * kHiddenInt4;
        RowCopy<kHiddenInt4> row;
        row.load(src, 0, lane);
        row.store(dst, 0, lane);
        row.copy_rest(dst, src, lane);
    }
    float* weights = bufs.at<float>(bufs.rank, p.weights_area_offset);
#pragma unroll
    for (int u = 0; u < kTopkPerLane; ++u)
        if (has_weights && lane + 32 * u < kNumTopk)
            weights[static_cast<int64_t>(j) * kNumTopk + lane + 32 * u] = weight[u];
    __threadfence_system();
    __syncwarp();
    if (lane == 0)
        st_release_sys_u32(bufs.at<unsigned int>(bufs.rank, p.flags_offset) + s * p.capacity + b, 1u);
}

// Pull item: my token t, once every rank it went to has flagged its row.
DEEPEP_DEVICE bool pull_token(const CombineParams& p, const PeerBuffers& bufs, int64_t t, int lane,
                              uint64_t deadline, const ErrorSink& sink) {
    const int my_row = load_send_row(p, t, lane);
    bool ok = true;
    if (my_row >= 0) {
        const unsigned int* flag = bufs.at<const unsigned int>(lane, p.flags_offset) + bufs.rank * p.capacity + t;
        while (ld_acquire_sys_u32(flag) == 0u) {
            if (globaltimer_ns() > deadline) {
                report_error(sink, kErrorTimeout, lane, static_cast<int>(t));
                ok = false;
                break;
            }
        }
    }
    if (!__all_sync(0xffffffffu, ok))
        return false;
    __syncwarp();   // orders lane r's acquire before every lane's loads of rank r's row
    sum_token(p, bufs, t, my_row, lane);
    return true;
}

}  // namespace

namespace deepep_portable::intranode::streamed {

__global__ void __launch_bounds__(kThreads) combine(const __grid_constant__ CombineParams p) {
    static_assert(kNumRanks <= 32, "the streamed combine keeps one rank per lane");
    const PeerBuffers bufs = bufs_of(p);
    const ErrorSink sink{p.error_claim, p.error_host, kOpCombine, static_cast<int>(p.rank)};
    const uint64_t n = begin_round(bufs, p.ctrl, p.timeout_ns, sink);
    if (n == 0)
        return;
    const int me = bufs.rank;
    // My rows from source s are [seg[s], seg[s+1]), in the source's token order; last[s]: the last one's token.
    __shared__ int seg[kNumRanks + 1];
    __shared__ int last[kNumRanks];
    if (threadIdx.x == 0) {
        seg[0] = 0;
        for (int s = 0; s < kNumRanks; ++s)
            seg[s + 1] = p.rank_prefix_matrix[s * kNumRanks + me];
    }
    __syncthreads();
    for (int s = threadIdx.x; s < kNumRanks; s += blockDim.x)
        last[s] = seg[s + 1] > seg[s] ? p.recv_src_idx[seg[s + 1] - 1] : -1;
    // My share of the lookup table (row_of[s][b] for b <= last[s]; tokens of a source rise with its rows)
    // and of my flags (no peer reads them before my READY = n below).
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t j = tid; j < seg[kNumRanks]; j += threads) {
        int s = 0;
        while (seg[s + 1] <= j)
            ++s;
        const int b = p.recv_src_idx[j];
        const int prev = j > seg[s] ? p.recv_src_idx[j - 1] : -1;
        for (int k = prev + 1; k < b; ++k)
            p.row_of[s * p.capacity + k] = -1;
        p.row_of[s * p.capacity + b] = static_cast<int>(j);
    }
    unsigned int* my_flags = bufs.at<unsigned int>(me, p.flags_offset);
    for (int64_t i = tid; i < kNumRanks * p.capacity; i += threads)
        my_flags[i] = 0u;
    const uint64_t deadline = globaltimer_ns() + p.timeout_ns;
    unsigned int* arrive = bufs.at<unsigned int>(me, p.ctrl.stage_ticket);
    if (!blocks_meet(arrive, deadline, sink))
        return;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(bufs.at<uint64_t>(me, p.ctrl.ready), n);
    }
    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    for (int r = threadIdx.x; r < kNumRanks; r += blockDim.x)
        if (!wait_ge(bufs.at<const uint64_t>(r, p.ctrl.ready), n, deadline, sink, r))
            s_ok = 0;
    __syncthreads();
    __threadfence_system();
    if (s_ok == 0)
        return;

    const int lane = threadIdx.x % 32;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
    const int64_t lag = (warps + kNumRanks) / (kNumRanks + 1);
    int64_t stage_slots = 0;
    for (int s = 0; s < kNumRanks; ++s)
        stage_slots = last[s] + 1 > stage_slots ? last[s] + 1 : stage_slots;
    const int64_t slots = stage_slots > p.num_tokens + lag ? stage_slots : p.num_tokens + lag;
    bool ok = true;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
         ok && i < slots * (kNumRanks + 1); i += warps) {
        const int64_t b = i / (kNumRanks + 1);
        const int k = static_cast<int>(i % (kNumRanks + 1));
        if (k < kNumRanks)
            stage_row(p, bufs, last, k, b, lane);
        else if (b >= lag && b - lag < p.num_tokens)
            ok = pull_token(p, bufs, b - lag, lane, deadline, sink);
    }
    if (__syncthreads_or(!ok))
        return;
    end_round(bufs, p.ctrl, n, arrive);
}

}  // namespace deepep_portable::intranode::streamed
