// The mlx5 work-queue formats the ibgda backend writes from the GPU, and the host reads back (CQEs):
// one encoder for host and device code. Layouts are the NIC's (rdma-core
// `providers/mlx5/mlx5dv.h` structs `mlx5_wqe_ctrl_seg`, `_raddr_seg`, `_data_seg`, `_atomic_seg`,
// `_inl_data_seg`, `mlx5_cqe64`; every multi-byte field big-endian). tests/test_ibgda_mlx5.py compiles
// this header on the host next to rdma-core's own `mlx5dv_set_ctrl_seg` / `mlx5dv_set_data_seg` and the
// mlx5dv.h structs and compares the bytes, and compares against pyverbs' serialisers where they exist.
//
// A WQE is a run of 16-byte segments in 64-byte basic blocks (WQEBBs) of a ring; the builders below
// write one WQE that fits one WQEBB (every RC operation the contract needs does) and return the number
// of 16-byte segments (ds). Ring addressing, posting order and doorbells are the send queue's business
// (a later file); nothing here touches memory the NIC reads except the segments given.
#pragma once

#include <cstdint>

#include "common/kernels/common.cuh"

namespace deepep_portable::ibgda::mlx5 {

// Opcodes (ctrl segment byte 3) and ctrl flags (byte 11, `fm_ce_se`).
constexpr uint8_t kOpNop = 0x00;
constexpr uint8_t kOpRdmaWrite = 0x08;
constexpr uint8_t kOpRdmaWriteImm = 0x09;
constexpr uint8_t kOpRdmaRead = 0x10;
constexpr uint8_t kOpAtomicCs = 0x11;
constexpr uint8_t kOpAtomicFa = 0x12;
constexpr uint8_t kCqUpdate = 0x08;         // MLX5_WQE_CTRL_CQ_UPDATE: this WQE produces a CQE
constexpr uint8_t kFence = 0x80;            // MLX5_WQE_CTRL_FENCE: wait for earlier reads/atomics of this QP
constexpr uint32_t kInline = 0x80000000u;   // MLX5_INLINE_SEG: the inline segment's byte-count flag
constexpr int kSegBytes = 16;
constexpr int kWqebbBytes = 64;
constexpr int kMaxInlineInOneWqebb = kWqebbBytes - 2 * kSegBytes - 4;   // ctrl + raddr + inline header

// CQE (64 bytes) fields the poller reads; opcodes of op_own >> 4.
constexpr int kCqeBytes = 64;
constexpr int kCqeVendorSyndrome = 54;
constexpr int kCqeSyndrome = 55;
constexpr int kCqeSopDropQpn = 56;          // be32: [31:24] opcode of the WQE, [23:0] QPN
constexpr int kCqeWqeCounter = 60;          // be16: index of the completed (signalled) WQE
constexpr int kCqeOpOwn = 63;               // [7:4] opcode, [3:2] format, [0] owner
constexpr uint8_t kCqeReq = 0x0;
constexpr uint8_t kCqeReqErr = 0xd;
constexpr uint8_t kCqeRespErr = 0xe;
constexpr uint8_t kCqeInvalid = 0xf;

DEEPEP_HOST_DEVICE uint16_t be16(uint16_t v) {
    return static_cast<uint16_t>((v >> 8) | (v << 8));
}

DEEPEP_HOST_DEVICE uint32_t be32(uint32_t v) {
    return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

DEEPEP_HOST_DEVICE uint64_t be64(uint64_t v) {
    return (static_cast<uint64_t>(be32(static_cast<uint32_t>(v))) << 32) | be32(static_cast<uint32_t>(v >> 32));
}

// The segments, as the NIC reads them (field names as in mlx5dv.h).
struct CtrlSeg {
    uint32_t opmod_idx_opcode;   // be32: [31:24] opmod, [23:8] WQE index (producer index in WQEBBs), [7:0] opcode
    uint32_t qpn_ds;             // be32: [31:8] QPN, [5:0] ds (16-byte segments of the WQE, ctrl included)
    uint8_t signature;
    uint8_t dci_stream_channel_id[2];
    uint8_t fm_ce_se;            // [7:5] fence mode, 0x08 CQE requested, 0x02 solicited
    uint32_t imm;                // WRITE_IMM's immediate, stored as given (already big-endian)
};

struct RaddrSeg {
    uint64_t raddr;              // be64
    uint32_t rkey;               // be32
    uint32_t reserved;
};

struct DataSeg {
    uint32_t byte_count;         // be32
    uint32_t lkey;               // be32
    uint64_t addr;               // be64
};

struct AtomicSeg {
    uint64_t swap_add;           // be64: the add of FETCH_ADD, the swap of COMPARE_SWAP
    uint64_t compare;            // be64
};

static_assert(sizeof(CtrlSeg) == kSegBytes && sizeof(RaddrSeg) == kSegBytes && sizeof(DataSeg) == kSegBytes &&
                  sizeof(AtomicSeg) == kSegBytes, "mlx5 segments are 16 bytes");

DEEPEP_HOST_DEVICE void set_ctrl(CtrlSeg* seg, uint16_t pi, uint8_t opcode, uint8_t opmod, uint32_t qpn,
                                 uint8_t fm_ce_se, uint8_t ds, uint32_t imm = 0) {
    seg->opmod_idx_opcode = be32((static_cast<uint32_t>(opmod) << 24) | (static_cast<uint32_t>(pi) << 8) | opcode);
    seg->qpn_ds = be32((qpn << 8) | ds);
    seg->signature = 0;
    seg->dci_stream_channel_id[0] = seg->dci_stream_channel_id[1] = 0;
    seg->fm_ce_se = fm_ce_se;
    seg->imm = imm;
}

DEEPEP_HOST_DEVICE void set_raddr(RaddrSeg* seg, uint64_t raddr, uint32_t rkey) {
    seg->raddr = be64(raddr);
    seg->rkey = be32(rkey);
    seg->reserved = 0;
}

DEEPEP_HOST_DEVICE void set_data(DataSeg* seg, uint32_t byte_count, uint32_t lkey, uint64_t addr) {
    seg->byte_count = be32(byte_count);
    seg->lkey = be32(lkey);
    seg->addr = be64(addr);
}

// RDMA WRITE (or READ with kOpRdmaRead) of `bytes` from local (laddr, lkey) to remote (raddr, rkey):
// ctrl + raddr + data, ds = 3. Returns ds.
DEEPEP_HOST_DEVICE int write_rdma(void* wqe, uint8_t opcode, uint16_t pi, uint32_t qpn, uint8_t fm_ce_se,
                                  uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t bytes) {
    auto* seg = static_cast<uint8_t*>(wqe);
    set_ctrl(reinterpret_cast<CtrlSeg*>(seg), pi, opcode, 0, qpn, fm_ce_se, 3);
    set_raddr(reinterpret_cast<RaddrSeg*>(seg + kSegBytes), raddr, rkey);
    set_data(reinterpret_cast<DataSeg*>(seg + 2 * kSegBytes), bytes, lkey, laddr);
    return 3;
}

// RDMA WRITE of a small value carried in the WQE itself (no local key): ctrl + raddr + inline header
// and data, padded to 16 bytes. `bytes` <= kMaxInlineInOneWqebb. Returns ds.
DEEPEP_HOST_DEVICE int write_inline(void* wqe, uint16_t pi, uint32_t qpn, uint8_t fm_ce_se, uint64_t raddr,
                                    uint32_t rkey, const void* data, uint32_t bytes) {
    auto* seg = static_cast<uint8_t*>(wqe);
    const int ds = 2 + (4 + static_cast<int>(bytes) + kSegBytes - 1) / kSegBytes;
    set_ctrl(reinterpret_cast<CtrlSeg*>(seg), pi, kOpRdmaWrite, 0, qpn, fm_ce_se, static_cast<uint8_t>(ds));
    set_raddr(reinterpret_cast<RaddrSeg*>(seg + kSegBytes), raddr, rkey);
    uint8_t* inl = seg + 2 * kSegBytes;
    *reinterpret_cast<uint32_t*>(inl) = be32(bytes | kInline);
    for (uint32_t i = 0; i < bytes; ++i)
        inl[4 + i] = static_cast<const uint8_t*>(data)[i];
    for (int i = 4 + static_cast<int>(bytes); i < (ds - 2) * kSegBytes; ++i)
        inl[i] = 0;
    return ds;
}

// 8-byte FETCH_ADD (or COMPARE_SWAP with kOpAtomicCs: `operand` is the swap value) on remote (raddr, rkey);
// the old value lands at local (laddr, lkey) as the NIC delivers it (big-endian for 8 bytes: the caller
// swaps). ctrl + raddr + atomic + data, ds = 4. Returns ds.
DEEPEP_HOST_DEVICE int write_atomic(void* wqe, uint8_t opcode, uint16_t pi, uint32_t qpn, uint8_t fm_ce_se,
                                    uint64_t raddr, uint32_t rkey, uint64_t operand, uint64_t compare,
                                    uint64_t laddr, uint32_t lkey) {
    auto* seg = static_cast<uint8_t*>(wqe);
    set_ctrl(reinterpret_cast<CtrlSeg*>(seg), pi, opcode, 0, qpn, fm_ce_se, 4);
    set_raddr(reinterpret_cast<RaddrSeg*>(seg + kSegBytes), raddr, rkey);
    auto* atomic = reinterpret_cast<AtomicSeg*>(seg + 2 * kSegBytes);
    atomic->swap_add = be64(operand);
    atomic->compare = be64(opcode == kOpAtomicCs ? compare : 0);
    set_data(reinterpret_cast<DataSeg*>(seg + 3 * kSegBytes), 8, lkey, laddr);
    return 4;
}

// The 8 bytes a doorbell writes to the UAR (the first 8 bytes of a ctrl segment with opcode and ds 0, as
// the posting libraries ring it), as a value whose in-memory bytes are those: {be32(pi << 8), be32(qpn << 8)}.
DEEPEP_HOST_DEVICE uint64_t doorbell(uint16_t pi, uint32_t qpn) {
    return static_cast<uint64_t>(be32(static_cast<uint32_t>(pi) << 8)) |
           (static_cast<uint64_t>(be32(qpn << 8)) << 32);
}

// The send queue's doorbell record word: the next free WQEBB index.
DEEPEP_HOST_DEVICE uint32_t send_dbr(uint32_t next_wqebb) {
    return be32(next_wqebb & 0xffffu);
}

// Reading a CQE (64 bytes as the NIC wrote them).
struct Cqe {
    uint8_t opcode;        // kCqeReq, kCqeReqErr, ...
    uint8_t owner;
    uint8_t syndrome;      // error CQEs
    uint8_t vendor_syndrome;
    uint8_t wqe_opcode;    // of the WQE this CQE completes
    uint32_t qpn;
    uint16_t wqe_counter;
};

// The CQE's last 32-bit word (bytes 60-63: be16 wqe_counter, signature, op_own), which the NIC writes in one
// store after the rest of the entry: read it once (one load), then decode it, so an opcode and a counter
// can never come from two different entries.
DEEPEP_HOST_DEVICE uint8_t cqe_opcode(uint32_t tail) { return static_cast<uint8_t>(tail >> 28); }
DEEPEP_HOST_DEVICE uint16_t cqe_counter(uint32_t tail) {
    return static_cast<uint16_t>(((tail & 0xffu) << 8) | ((tail >> 8) & 0xffu));   // bytes 60 (high), 61 (low)
}

// The whole entry; its fields other than the tail are meaningful once the tail named it (read behind an acquire).
DEEPEP_HOST_DEVICE Cqe read_cqe(const void* cqe) {
    const auto* b = static_cast<const uint8_t*>(cqe);
    const uint32_t sop = be32(*reinterpret_cast<const uint32_t*>(b + kCqeSopDropQpn));
    return Cqe{static_cast<uint8_t>(b[kCqeOpOwn] >> 4), static_cast<uint8_t>(b[kCqeOpOwn] & 1), b[kCqeSyndrome],
               b[kCqeVendorSyndrome], static_cast<uint8_t>(sop >> 24), sop & 0xffffffu,
               be16(*reinterpret_cast<const uint16_t*>(b + kCqeWqeCounter))};
}

}  // namespace deepep_portable::ibgda::mlx5
