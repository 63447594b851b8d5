// Low-latency (LL) protocol shared by low_latency/dispatch.cu and low_latency/combine.cu.
//
// Buffer (one per rank, same size everywhere, offsets from deepep_portable/layout.py LowLatencyLayout):
//   [ control | signals of half 0 | signals of half 1 | data of half 0 | data of half 1 ]
//   control: SENT (u64, calls whose send kernel finished), RECVD (u64, calls whose receive kernel
//            finished), two block-arrival words, the error claim word.
//   signals of a half: dispatch [E_local][R] u64 (slot (e, s) written only by source rank s),
//                      combine  [E] u64 (slot g written only by the rank that owns expert g).
//   data of a half: dispatch receive slots [E_local][R][T] messages, sharing bytes with the
//                   combine send area [E_local][R*T][H] bf16 (the zero-copy buffer), then the
//                   combine receive slots [E][T][H] bf16.
//
// Calls: every LL op (dispatch or combine) is one call, numbered 1, 2, ... on every rank in the same
// order. A call is two kernels: SEND (never waits) and RECEIVE (waits for the peers' signals). The
// send kernel takes seq = SENT + 1 and its last block to finish stores SENT = seq; the receive kernel
// does the same with RECVD. So sends and receives pair up first-in first-out, even when hooks delay
// receives, and a captured CUDA graph keeps counting on replay (the counters live in device memory).
// half = seq & 1; every signal of call seq is SET to (seq << 32) | count, so no signal is ever
// zeroed between calls; a receiver waits until the value reaches seq << 32 and reports an overrun if
// it is already past seq (a peer two calls ahead: the caller broke the double-buffering rule).
//
// Safety of the double buffer: a peer writes my half h for call seq + 2 only after its receive of
// call seq + 1 finished, which needs my send of call seq + 1, which my stream runs after my receive of
// call seq (hooks: call each hook before the next-but-one LL op). Every wait is bounded and reports
// (op, rank, peer) to the ErrorSink; a kernel whose wait failed skips its copies but still finishes
// its bookkeeping, so no other block of any rank is left spinning forever.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/signal.cuh"
#include "common/kernels/transport.cuh"

#if defined(DEEPEP_TRANSPORT_NVLINK)
#include "backends/nvlink/device.cuh"
namespace deepep_portable::low_latency {
using Transport = transport::NvlinkTransport;
DEEPEP_DEVICE Transport make_transport(const uint64_t* peer_bases, int64_t rank, int64_t num_ranks) {
    return Transport{peer_bases, static_cast<int>(rank), static_cast<int>(num_ranks)};
}
}  // namespace deepep_portable::low_latency
#else
#error "low_latency kernels need a transport: -DDEEPEP_TRANSPORT_NVLINK"
#endif

namespace deepep_portable::low_latency {

constexpr int kThreads = 512;          // __launch_bounds__ of every LL kernel (host: low_latency.THREADS)
constexpr int kOpDispatch = 3;         // ErrorSink op codes (host: low_latency.OP_NAMES)
constexpr int kOpCombine = 4;
constexpr int kErrorOverrun = 3;       // a signal already carries a later call: hooks called too late
constexpr int kFp8Block = 128;         // channels per FP8 scale
constexpr int kMsgHeader = 16;         // bytes before the payload of a dispatch message (int32 source token)

// Fields shared by every LL params struct (all 64-bit; mirrored in deepep_portable/low_latency.py).
struct Common {
    const uint64_t* peer_bases;      // [R] base of every rank's LL buffer, mapped here
    int64_t rank;
    int64_t num_ranks;
    int64_t ctrl_sent;               // byte offsets in my buffer (control area)
    int64_t ctrl_recvd;
    int64_t ctrl_send_arrive;
    int64_t ctrl_recv_arrive;
    int64_t dispatch_signal_offset;  // half 0; half 1 is + signal_half_stride
    int64_t combine_signal_offset;
    int64_t signal_half_stride;
    int64_t dispatch_recv_offset;    // half 0; half 1 is + data_half_stride (combine send area: same bytes)
    int64_t combine_recv_offset;
    int64_t data_half_stride;
    int64_t num_experts;
    int64_t num_max_tokens;          // T
    int64_t msg_bytes;               // one dispatch message
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
};

DEEPEP_DEVICE ErrorSink sink_of(const Common& c, int op) {
    return ErrorSink{c.error_claim, c.error_host, op, static_cast<int>(c.rank)};
}

template <typename U>
DEEPEP_DEVICE U* own(const Common& c, int64_t off) {
    return reinterpret_cast<U*>(c.peer_bases[c.rank] + static_cast<uint64_t>(off));
}

// Sequence number of this kernel's call: counter + 1 (read by every block before any block can
// finish, see end_call). Every thread of the block gets the same value.
DEEPEP_DEVICE uint64_t begin_call(const Common& c, int64_t counter_off) {
    __shared__ uint64_t s_seq;
    if (threadIdx.x == 0)
        s_seq = *own<volatile uint64_t>(c, counter_off) + 1;
    __syncthreads();
    return s_seq;
}

// The last block of the grid to get here stores counter = seq (all blocks read it in begin_call
// before arriving) and re-arms the arrival word for the next launch.
DEEPEP_DEVICE void end_call(const Common& c, int64_t counter_off, int64_t arrive_off, uint64_t seq) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned int prev = atomicAdd(own<unsigned int>(c, arrive_off), 1u);
        if (prev == gridDim.x - 1) {
            atomicExch(own<unsigned int>(c, arrive_off), 0u);
            *own<volatile uint64_t>(c, counter_off) = seq;
            __threadfence();
        }
    }
}

DEEPEP_DEVICE uint64_t signal_value(uint64_t seq, uint32_t count) {
    return (seq << 32) | count;
}

// Wait (one thread) until my signal at `off` carries call `seq`; returns the count, or -1 after
// reporting a timeout or an overrun (naming `peer`).
template <typename Tr>
DEEPEP_DEVICE int64_t wait_signal(const Tr& tr, const Common& c, int64_t off, uint64_t seq, uint64_t deadline,
                                  const ErrorSink& sink, int peer) {
    if (!tr.wait_ge(off, seq << 32, deadline, sink, peer))
        return -1;
    const uint64_t v = ld_acquire_sys(own<const uint64_t>(c, off));
    if ((v >> 32) != seq) {
        report_error(sink, kErrorOverrun, peer, static_cast<int>(v >> 32));
        return -1;
    }
    return static_cast<int64_t>(v & 0xffffffffull);
}

DEEPEP_DEVICE int64_t dispatch_signal_off(const Common& c, int half, int local_expert, int src) {
    return c.dispatch_signal_offset + half * c.signal_half_stride + 8 * (static_cast<int64_t>(local_expert) * c.num_ranks + src);
}

DEEPEP_DEVICE int64_t combine_signal_off(const Common& c, int half, int expert) {
    return c.combine_signal_offset + half * c.signal_half_stride + 8 * static_cast<int64_t>(expert);
}

// Message of token slot `slot` from `src` to `local_expert`, in the receiver's buffer.
DEEPEP_DEVICE int64_t dispatch_msg_off(const Common& c, int half, int local_expert, int src, int64_t slot) {
    return c.dispatch_recv_offset + half * c.data_half_stride +
           ((static_cast<int64_t>(local_expert) * c.num_ranks + src) * c.num_max_tokens + slot) * c.msg_bytes;
}

// Combine row of (global expert, token) in the source rank's buffer; `hidden_bytes` per row.
DEEPEP_DEVICE int64_t combine_row_off(const Common& c, int half, int expert, int64_t token, int64_t hidden_bytes) {
    return c.combine_recv_offset + half * c.data_half_stride +
           (static_cast<int64_t>(expert) * c.num_max_tokens + token) * hidden_bytes;
}

// ---- FP8 cast (bit-exact with tests/oracle.py fp8_cast on the CPU) ------------------------------------
// amax = max |x| over 128 channels, clamped to >= 1e-4f; scale = amax / 448 (correctly rounded);
// round_scale: the smallest power of two >= scale (from the bits: scale is a positive normal float);
// data = e4m3(x / scale), round to nearest even (|x / scale| <= 448 up to rounding: no saturation hit).
DEEPEP_HOST_DEVICE float fp8_scale(float amax, bool round_scale) {
    amax = amax < 1e-4f ? 1e-4f : amax;
#ifdef __CUDA_ARCH__
    float scale = __fdiv_rn(amax, 448.0f);
#else
    float scale = amax / 448.0f;
#endif
    if (round_scale) {
        uint32_t bits;
        memcpy(&bits, &scale, 4);
        uint32_t e = (bits >> 23) & 0xffu;
        if (bits & 0x7fffffu)
            e += 1;
        bits = e << 23;
        memcpy(&scale, &bits, 4);
    }
    return scale;
}

DEEPEP_HOST_DEVICE uint16_t fp8x2(float a, float b, float scale) {
#ifdef __CUDA_ARCH__
    const float2 q = make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale));
#else
    const float2 q = make_float2(a / scale, b / scale);
#endif
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace deepep_portable::low_latency
