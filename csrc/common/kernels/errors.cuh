// What a kernel can report to the host, and which op reports it: the one table of error codes and op
// ids. The host reads these two enums from this file (deepep_portable/errors.py: one decoder turns a
// recorded [code, op, rank, peer, channel, detail] into the exception), so keep each entry on its
// own line as `kName = value,`.
#pragma once

namespace deepep_portable {

enum ErrorCode : int {
    kErrorNone = 0,
    kErrorTimeout = 1,     // a wait passed its deadline (peer: the rank waited for; its own rank: its own blocks)
    kErrorCapacity = 2,    // more rows arrived than the output holds (detail: rows; num_worst_tokens too small)
    kErrorOverrun = 3,     // LL: a signal already carries a later call (detail: it); peer -1: the half handed out differs
    kErrorOverwrite = 4,   // LL: a send found its destination still receiving the half's previous call (detail: call)
    kErrorNic = 5,         // ibgda: an error completion or a stuck queue pair (peer: its peer; detail: syndrome, -1 = stuck)
    kErrorUnsupported = 6, // nccl_gin: a call this NCCL cannot make for a GIN peer (peer; detail: nccl_gin/device.cuh fail())
};

enum OpId : int {
    kOpDispatch = 1,            // Buffer.dispatch (intranode kernels)
    kOpCombine = 2,             // Buffer.combine
    kOpLowLatencyDispatch = 3,  // Buffer.low_latency_dispatch
    kOpLowLatencyCombine = 4,   // Buffer.low_latency_combine
    kOpTransportSelftest = 5,   // transport_selftest.cu (the contract's conformance kernel)
    kOpLowLatencyClean = 6,     // Buffer.clean_low_latency_buffer (low_latency/clean.cu)
};

}  // namespace deepep_portable
