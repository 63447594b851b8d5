// The internode normal mode's protocol (docs/INTERNODE.md), shared by its dispatch and combine kernels.
//
// Words: R ranks in M nodes of P (NUM_RANKS, RANKS_PER_NODE); rank r is node r / P, local index r % P.
// A token of source s = (n, l) crosses the network once per destination node m, to the *landing rank*
// (m, l); the ranks of node m pull it from there over NVLink. Combine reverses it: the landing rank sums
// its node's expert outputs and sends one partial per (token, node) back over the network.
//
// Two kinds of access, never mixed up:
//  * network: the transport's put / signal / wait_ge only (common/kernels/transport.cuh), to any rank;
//  * NVLink: loads and stores through `node_bases`, the window bases of MY NODE's ranks only. No kernel
//    here can form a load/store address of a rank of another node (the table does not have one; the host
//    also gives the transport a peer table without them, so even its puts take the network path:
//    that is how logical nodes on one machine test the network path).
//
// Ops. Every op (dispatch, cached dispatch, combine) is one step n of a per-Buffer counter kept in the
// window (ROUND: the last op numbered, see end_op; CURRENT = n, written by the op's first kernel),
// so CUDA-graph replays keep counting. An op starts with a *handshake*: every rank signals HS[me] = n to
// every rank (the dispatch's counts ride on it, as a put-with-signal) and waits until every rank's HS
// >= n. A rank signals n only after its op n-1 ended (stream order), so after the handshake nobody still
// reads anything of op n-1: every area below can be rewritten without credits, and every signal is a
// single-writer value that only grows.
//
// Deadlock freedom: each op is a few kernels on one stream; each wait is on a signal that a peer emits
// in the same or an earlier kernel of the same op, before any wait of its own in that kernel (the
// handshake), or unconditionally after waits that are themselves satisfied (arrivals follow sends that
// wait for nothing; forward flags follow arrivals). With every block of every rank resident at once (the
// grid cap of ranks sharing a GPU) every wait is eventually satisfied; each is still bounded (timeout_ns)
// and a timeout is recorded (op, rank, peer, block) instead of hanging.
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"
#include "common/kernels/errors.cuh"
#include "common/kernels/selected_transport.cuh"
#include "common/kernels/signal.cuh"

#ifndef NUM_RANKS
#error "internode kernels need -DNUM_RANKS"
#endif
#ifndef RANKS_PER_NODE
#error "internode kernels need -DRANKS_PER_NODE"
#endif

namespace deepep_portable::internode {

constexpr int kThreads = 512;       // every internode launch (host: engines/internode.THREADS)
constexpr int kWarps = kThreads / 32;
constexpr int kChunkTokens = 64;    // a source's tokens travel in chunks of this many (layout.INTERNODE_CHUNK_TOKENS)
constexpr int kMaxChunks = 512;     // signal slots per source node: up to 32768 tokens per rank and call
constexpr int kNumRanks = NUM_RANKS;
constexpr int kRanksPerNode = RANKS_PER_NODE;
constexpr int kNumNodes = kNumRanks / kRanksPerNode;
static_assert(kNumRanks % kRanksPerNode == 0 && kNumNodes >= 1, "every node has RANKS_PER_NODE ranks");

// Count message (int32 words) that rank s sends to rank r at the start of a dispatch:
//   [0, R) s's tokens per rank | [R, R+M) s's tokens per node | R+M: s's token count |
//   R+M+1: the rows s can receive (0: learned by s's host; else num_worst_tokens or s's cached handle) |
//   R+M+2: s's tokens in the whole call (more than its token count when the call runs in rounds) |
//   [R+M+3, R+M+3+E/R) s's tokens per expert of r's experts
constexpr int kCountNodesAt = kNumRanks;
constexpr int kCountTokensAt = kNumRanks + kNumNodes;
constexpr int kCountCapacityAt = kNumRanks + kNumNodes + 1;
constexpr int kCountCallTokensAt = kNumRanks + kNumNodes + 2;
constexpr int kCountExpertsAt = kNumRanks + kNumNodes + 3;

// The window regions every op uses, fixed for the Buffer's life (layout.InternodeLayout; host mirror:
// engines/internode.py). All byte offsets in every rank's window (symmetric).
struct Common {
    transport::Selected transport;  // the backend's struct; its peer table has no rank of another node
    const uint64_t* node_bases;     // [P] load/store base of each rank of my node's window (mine included)
    uint64_t local_base;            // my window here
    int64_t rank;
    int64_t ctrl_round;             // u64: last completed op
    int64_t ctrl_current;           // u64: the op in progress
    int64_t hs_offset;              // u64 [R]: HS[s] = the op rank s has started
    int64_t arrive_offset;          // u64 [M][kMaxChunks]: stamp(n, rows landed through chunk k) (sender-written)
    int64_t forward_offset;         // u64 [M][kMaxChunks]: stamp(n, hi) once chunk k is readable here (own)
    int64_t range_offset;           // i64 [M][kMaxChunks]: (lo << 32) | hi slots of chunk k (own, before the flag)
    int64_t combine_arrive_offset;  // u64 [M][kMaxChunks]: n once node m's partials of chunk k landed here
    int64_t staged_offset;          // u64: n once my combine rows of op n are staged (own; node peers read it)
    int64_t counts_offset;          // int32 [2][R][count_words]: count messages by op parity and source
    int64_t count_out_offset;       // int32 [R][count_words]: my outgoing count messages (a put's source)
    int64_t count_words;
    int64_t data_offset;            // start of the per-op data region (dispatch or combine layout)
    int64_t max_tokens;             // N: landing slots per source node in this op's layout
    int64_t num_channels;
    unsigned int* error_claim;
    int* error_host;
    int64_t timeout_ns;
};

template <typename U>
DEEPEP_DEVICE U* local(const Common& c, int64_t off) {
    return reinterpret_cast<U*>(c.local_base + static_cast<uint64_t>(off));
}

// NVLink access: only ranks of my node, by local index.
template <typename U>
DEEPEP_DEVICE U* node_peer(const Common& c, int local_index, int64_t off) {
#if defined(DEEPEP_CHECK_NODE_LOCAL)
    if (local_index < 0 || local_index >= kRanksPerNode)
        __trap();   // debug builds: a load/store outside my node is a bug, never a shortcut
#endif
    return reinterpret_cast<U*>(c.node_bases[local_index] + static_cast<uint64_t>(off));
}

DEEPEP_DEVICE int my_node(const Common& c) { return static_cast<int>(c.rank) / kRanksPerNode; }
DEEPEP_DEVICE int my_local(const Common& c) { return static_cast<int>(c.rank) % kRanksPerNode; }

// A chunk signal: the op number in the high 40 bits, a row count (< kMaxChunks * kChunkTokens <= 2^24) in the
// low 24. Values grow with the op, so `>= stamp(n, 0)` means "op n or later" for 2^40 ops (a 32-bit op field
// would wrap after 2^32 dispatches on one Buffer, weeks at a kHz, and let stale signals pass).
constexpr int kCountBits = 24;
static_assert(kMaxChunks * kChunkTokens < (1 << kCountBits), "a chunk signal's row count has 24 bits");
DEEPEP_HOST_DEVICE uint64_t stamp(uint64_t n, uint32_t count) { return (n << kCountBits) | count; }
DEEPEP_HOST_DEVICE uint32_t stamp_count(uint64_t v) { return static_cast<uint32_t>(v & ((1u << kCountBits) - 1u)); }

DEEPEP_DEVICE int64_t chunk_slot(int node, int chunk) { return 8 * (static_cast<int64_t>(node) * kMaxChunks + chunk); }

DEEPEP_DEVICE int channel_of(const Common& c, int node, int chunk) {
    return static_cast<int>((static_cast<int64_t>(node) * kMaxChunks + chunk) % c.num_channels);
}

DEEPEP_DEVICE ErrorSink sink_of(const Common& c, int op) {
    return ErrorSink{c.error_claim, c.error_host, op, static_cast<int>(c.rank)};
}

// First kernel of an op: n = ROUND + 1 (ROUND is written only by the previous op, end_op).
DEEPEP_DEVICE uint64_t begin_op(const Common& c) {
    const uint64_t n = *local<volatile uint64_t>(c, c.ctrl_round) + 1;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *local<volatile uint64_t>(c, c.ctrl_current) = n;
    return n;
}

// Later kernels of the op.
DEEPEP_DEVICE uint64_t current_op(const Common& c) { return *local<volatile uint64_t>(c, c.ctrl_current); }

// The op is complete as far as the next op's numbering goes (read by the next op's first kernel only).
// Written by a kernel launched together with the first one, so a host error before the op's last launch
// cannot leave the counter behind the signals this rank already sent.
DEEPEP_DEVICE void end_op(const Common& c, uint64_t n) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *local<volatile uint64_t>(c, c.ctrl_round) = n;
}

// Whether this rank's op already failed (a wait timed out, or the counts did not fit: its record claimed the
// error word). The later kernels of the op then do nothing: without the handshake they must not write into
// any peer's areas. Block-uniform (read once per block), so a caller may return before a __syncthreads.
DEEPEP_DEVICE bool op_failed(const Common& c) {
    __shared__ int s_failed;
    if (threadIdx.x == 0)
        s_failed = *reinterpret_cast<volatile unsigned int*>(c.error_claim) != 0u;
    __syncthreads();
    return s_failed != 0;
}

// The handshake's wait, by the threads of one block: every rank's HS >= n. Returns whether all arrived
// (a timeout is recorded naming the rank).
DEEPEP_DEVICE bool await_handshake(const Common& c, uint64_t n, const ErrorSink& sink) {
    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    const uint64_t deadline = globaltimer_ns() + static_cast<uint64_t>(c.timeout_ns);
    for (int q = threadIdx.x; q < kNumRanks; q += blockDim.x)
        if (!c.transport.wait_ge(c.hs_offset + 8 * q, n, deadline, sink, q))
            s_ok = 0;
    __syncthreads();
    const bool ok = s_ok != 0;
    __syncthreads();   // s_ok may be reused by a later call
    return ok;
}

// Count message words of source s in my window for op n (parity buffered: a rank writes parity n % 2 only
// after every rank started op n - 1, so nobody still reads that parity's op n - 2).
DEEPEP_DEVICE const volatile int* counts_of(const Common& c, uint64_t n, int s) {
    return local<const volatile int>(c, c.counts_offset + 4 * ((static_cast<int64_t>(n % 2) * kNumRanks + s) * c.count_words));
}

DEEPEP_DEVICE int num_chunks(int num_tokens) { return (num_tokens + kChunkTokens - 1) / kChunkTokens; }

}  // namespace deepep_portable::internode
