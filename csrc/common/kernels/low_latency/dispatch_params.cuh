// The LL dispatch's compile-time shape and placement, its kernel parameters (host mirror:
// deepep_portable/engines/low_latency.py, checked by tests/test_mirrors.py) and the message geometry.
// Private to the dispatch's translation unit (dispatch.cu).
//
// Compile-time (-D): HIDDEN (bf16 elements, multiple of 128), NUM_TOPK, PACK_ON_RECEIVE; the transport
// (selected_transport.cuh).
#pragma once

#include <cstdint>

#include "common/kernels/low_latency/protocol.cuh"

#ifndef HIDDEN
#error "low_latency/dispatch.cu needs -DHIDDEN"
#endif
#ifndef NUM_TOPK
#error "low_latency/dispatch.cu needs -DNUM_TOPK"
#endif

using namespace deepep_portable;
using namespace deepep_portable::low_latency;
using namespace deepep_portable::fp8;

namespace {
constexpr int kHidden = HIDDEN;
constexpr int kNumTopk = NUM_TOPK;
constexpr int kNumScales = kHidden / kFp8Block;
constexpr int kRowInt4 = kHidden * 2 / 16;      // bf16 row in 16-byte words
// Side message bytes: the int32 source token in a 16-byte head, then (FP8) the float32 scales.
constexpr int kSideFp8 = kMsgHeader + (kNumScales * 4 + 15) / 16 * 16;
constexpr int kSideBf16 = kMsgHeader;
enum class Placement { kReserveRows, kPackOnReceive };
// PACK_ON_RECEIVE=1 (shrink mode) takes the second placement whatever the transport: there every
// source writes only its own (expert, source) slots, so a masked rank that is still running (masked by
// hand, or slow and timed out) cannot move rows of the live sources, as its reservations would.
#ifndef PACK_ON_RECEIVE
#define PACK_ON_RECEIVE 0
#endif
constexpr Placement kPlacement = Transport::kCheapFetchAdd && !PACK_ON_RECEIVE ? Placement::kReserveRows
                                                                               : Placement::kPackOnReceive;
static_assert(kHidden % kFp8Block == 0, "LL hidden must be a multiple of 128");
static_assert(kNumTopk >= 1 && kNumTopk <= 128, "bad top-k");
}  // namespace

struct LLDispatchParams {
    Common c;
    // send
    const int4* x;                    // [N, HIDDEN] bf16
    const int64_t* topk_idx;          // [N, NUM_TOPK], -1 = none
    int64_t num_tokens;
    int64_t use_fp8;
    int64_t round_scale;
    int64_t send_stage_offset;        // my send stage: [T] messages
    int64_t stage_flags_offset;       // my stage flags: u64 [kMaxStageBlocks] in the control area (protocol.cuh)
    // receive
    int4* recv_x;                     // kPackOnReceive: [E_local, R*T, HIDDEN] bf16 or fp8 (kReserveRows: in the buffer)
    int64_t expect_half;              // kReserveRows: the half whose recv_x the host handed out (checked on the device)
    void* recv_scales;                // fp32 [E_local][S][R*T] or int32 [E_local][S/4][R*T] (column-major views)
    int* src_info;                    // [E_local, R*T]
    int64_t* layout_range;            // [E_local, R]
    int* recv_count;                  // [E_local]
    int* cumulative_recv_stats;       // [E_local] or null
    int64_t* wait_stats;              // [R] or null: clock64 cycles spent waiting per source
    int64_t use_ue8m0;
};

namespace {

// A message's two parts (multiples of 16): the side message, and the payload (one recv_x row).
DEEPEP_DEVICE int64_t side_bytes(bool use_fp8) {
    return use_fp8 ? kSideFp8 : kSideBf16;
}

DEEPEP_DEVICE int64_t row_bytes(bool use_fp8) {
    return use_fp8 ? kHidden : kRowInt4 * 16;
}

}  // namespace
