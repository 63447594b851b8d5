// A software model of an mlx5 NIC's send side, for tests only (host code): it plays the NIC for queues
// that sq.cuh / ops.cuh post to from host threads. Per queue it watches the doorbell, executes the WQEs up
// to the doorbell record in order, checks what hardware would reject (WQE index, QPN, opcode, keys and
// bounds, a doorbell record that ran ahead of the doorbell), and writes collapsed CQEs (bytes 0-59 first,
// then the word at 60 in one store). Executes RDMA WRITE (gather or inline), RDMA READ and 8-byte
// FETCH_ADD (old value big-endian, or in host order with atomic_be = false: HCAs report which). After an
// error CQE the queue is in error: later WQEs are not executed, and each signalled one completes with a
// WR_FLUSH (syndrome 0x05) error entry, as hardware does (overwriting the first error on a collapsed CQ).
// Checked as hardware would: WQE index and QPN, keys and bounds, the segment count of each opcode, and
// that a doorbell never runs ahead of its doorbell record. Chaos (optional): a WRITE's 16-byte pieces land in random order, and the NIC pauses
// between WQEs; the order of WQEs on one queue is kept (what RC guarantees and ibgda/device.cuh relies on).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "backends/ibgda/sq.cuh"

namespace nic_model {

using namespace deepep_portable::ibgda;
namespace m = deepep_portable::ibgda::mlx5;

// A registered region: `base` is the address its owner registered (what WQEs name), `local` where this
// process reaches the same bytes (0: at `base` itself; another process's window mapped here otherwise).
struct Region {
    uint64_t base, len, local = 0;
};

// The memory behind one queue: ring, posting words, doorbell record, doorbell, collapsed CQE.
struct Queue {
    std::vector<uint8_t> ring;
    Word reserve = 0, turn = 0, completed = 0, doorbell = 0;
    uint32_t dbr = 0;
    alignas(64) uint8_t cqe[64];
    uint32_t depth;
    explicit Queue(uint32_t depth_) : ring(depth_ * 64), depth(depth_) { memset(cqe, 0xff, 64); }
    SendQueue sq(uint32_t qpn) { return SendQueue{ring.data(), depth, qpn, &reserve, &turn, &completed, &dbr, &doorbell, cqe}; }
};

struct Model {
    SendQueue q;
    const std::vector<Region>* keys = nullptr;   // key k -> (*keys)[k]
    uint8_t* cqe = nullptr;
    bool chaos = false;
    bool atomic_be = true;
    std::mt19937_64 rng{1};
    uint64_t hw_ci = 0, last_db = 0, unwrapped_pi = 0;
    uint16_t db_pi = 0;
    bool in_error = false;
    int problems = 0, doorbells = 0;

    void attach(Queue& qu, uint32_t qpn, const std::vector<Region>* key_table) {
        attach(qu.sq(qpn), qu.cqe, key_table);
    }
    void attach(const SendQueue& sq, uint8_t* cqe_, const std::vector<Region>* key_table) {
        q = sq;
        cqe = cqe_;
        keys = key_table;
    }
    bool key_ok(uint32_t key, uint64_t addr, uint64_t len) const {
        return key < keys->size() && (*keys)[key].len > 0 && addr >= (*keys)[key].base &&
               addr + len <= (*keys)[key].base + (*keys)[key].len;
    }
    // Where this process reaches `addr` of the region `key` names (checked by key_ok first).
    template <typename T>
    T* at(uint32_t key, uint64_t addr) const {
        const Region& r = (*keys)[key];
        return reinterpret_cast<T*>((r.local ? r.local : r.base) + (addr - r.base));
    }
    void complete(uint16_t index, uint8_t opcode, uint8_t status, uint8_t syndrome) {
        uint8_t tmp[64];
        memset(tmp, 0, 60);
        tmp[m::kCqeSyndrome] = syndrome;
        const uint32_t sop = m::be32((static_cast<uint32_t>(opcode) << 24) | q.qpn);
        memcpy(tmp + m::kCqeSopDropQpn, &sop, 4);
        memcpy(cqe, tmp, 60);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        uint8_t last[4];
        const uint16_t counter = m::be16(index);
        memcpy(last, &counter, 2);
        last[2] = 0;
        last[3] = static_cast<uint8_t>(status << 4);
        uint32_t word;
        memcpy(&word, last, 4);
        reinterpret_cast<std::atomic<uint32_t>*>(cqe + 60)->store(word, std::memory_order_release);
    }
    // A WRITE's bytes, in 16-byte pieces, in random order under chaos (placement inside one message is
    // not ordered on real hardware either).
    void place(uint8_t* dst, const uint8_t* src, uint32_t len) {
        if (!chaos || len <= 16) {
            memcpy(dst, src, len);
            return;
        }
        std::vector<uint32_t> pieces((len + 15) / 16);
        for (uint32_t i = 0; i < pieces.size(); ++i) pieces[i] = i;
        std::shuffle(pieces.begin(), pieces.end(), rng);
        for (uint32_t i : pieces) memcpy(dst + 16 * i, src + 16 * i, std::min<uint32_t>(16, len - 16 * i));
    }
    uint8_t execute(const uint8_t* w, uint8_t opcode, uint32_t ds) {
        m::RaddrSeg r;
        memcpy(&r, w + 16, 16);
        const uint64_t raddr = m::be64(r.raddr);
        const uint32_t rkey = m::be32(r.rkey);
        if (opcode == m::kOpRdmaWrite && ds >= 3) {
            uint32_t head;
            memcpy(&head, w + 32, 4);
            head = m::be32(head);
            if (head & m::kInline) {   // inline data right after its 4-byte header
                const uint32_t len = head & ~m::kInline;
                if (len > static_cast<uint32_t>(m::kMaxInlineInOneWqebb)) return 0x02;
                if (ds != 2 + (4 + len + 15) / 16) return 0x02;   // the segment count must cover the inline data
                if (!key_ok(rkey, raddr, len)) return 0x13;
                if (len == 8) {   // one aligned 8-byte value lands whole (a signal)
                    uint64_t v;
                    memcpy(&v, w + 36, 8);
                    at<std::atomic<uint64_t>>(rkey, raddr)->store(v, std::memory_order_release);
                } else {
                    memcpy(at<void>(rkey, raddr), w + 36, len);
                }
                return 0;
            }
            if (ds != 3) return 0x02;
            m::DataSeg d;
            memcpy(&d, w + 32, 16);
            const uint64_t laddr = m::be64(d.addr);
            const uint32_t len = m::be32(d.byte_count);
            if (len == 0 || (len & m::kInline)) return 0x02;   // 0 would mean 2 GiB; bit 31 is not a length bit
            if (!key_ok(m::be32(d.lkey), laddr, len)) return 0x04;
            if (!key_ok(rkey, raddr, len)) return 0x13;
            place(at<uint8_t>(rkey, raddr), at<const uint8_t>(m::be32(d.lkey), laddr), len);
            std::atomic_thread_fence(std::memory_order_release);
            return 0;
        }
        if (opcode == m::kOpRdmaRead && ds == 3) {
            m::DataSeg d;
            memcpy(&d, w + 32, 16);
            const uint64_t laddr = m::be64(d.addr);
            const uint32_t len = m::be32(d.byte_count);
            if (!key_ok(m::be32(d.lkey), laddr, len)) return 0x04;
            if (!key_ok(rkey, raddr, len)) return 0x13;
            std::atomic_thread_fence(std::memory_order_acquire);
            memcpy(at<void>(m::be32(d.lkey), laddr), at<const void>(rkey, raddr), len);
            return 0;
        }
        if (opcode == m::kOpAtomicFa && ds == 4) {
            m::AtomicSeg a;
            m::DataSeg d;
            memcpy(&a, w + 32, 16);
            memcpy(&d, w + 48, 16);
            const uint64_t laddr = m::be64(d.addr);
            if (!key_ok(m::be32(d.lkey), laddr, 8)) return 0x04;
            if (!key_ok(rkey, raddr, 8) || raddr % 8 != 0) return 0x13;
            const uint64_t old = at<std::atomic<uint64_t>>(rkey, raddr)->fetch_add(m::be64(a.swap_add));
            const uint64_t delivered = atomic_be ? m::be64(old) : old;
            memcpy(at<void>(m::be32(d.lkey), laddr), &delivered, 8);
            return 0;
        }
        return 0x02;   // an opcode (or shape) this model does not execute
    }
    // Execute what the doorbell published since the last call; false when there was nothing to do.
    bool step() {
        const uint64_t db = reinterpret_cast<std::atomic<uint64_t>*>(q.doorbell)->load(std::memory_order_acquire);
        if (db != last_db) {
            last_db = db;
            const uint16_t pi = static_cast<uint16_t>(m::be32(static_cast<uint32_t>(db)) >> 8);
            const uint32_t qpn = m::be32(static_cast<uint32_t>(db >> 32)) >> 8;
            const uint16_t stepped = static_cast<uint16_t>(pi - db_pi);
            if (qpn != q.qpn || stepped == 0 || stepped > q.depth) {
                printf("doorbell went backwards or skipped: pi %u after %u (qpn %u)\n", pi, db_pi, qpn);
                ++problems;
            }
            unwrapped_pi += stepped;
            db_pi = pi;
            ++doorbells;
            // The record is written before the doorbell: seen after it, it covers at least the doorbell's WQEs.
            const uint16_t dbr = static_cast<uint16_t>(
                m::be32(reinterpret_cast<std::atomic<uint32_t>*>(q.dbr)->load(std::memory_order_acquire)));
            if (static_cast<int16_t>(static_cast<uint16_t>(dbr - pi)) < 0) {
                printf("doorbell pi %u ahead of its doorbell record %u (qpn %u)\n", pi, dbr, q.qpn);
                ++problems;
            }
        }
        if (static_cast<uint16_t>(hw_ci) == db_pi)   // nothing rung since the last step
            return false;
        while (static_cast<uint16_t>(hw_ci) != db_pi) {
            const uint8_t* w = q.ring + (hw_ci & (q.depth - 1)) * m::kWqebbBytes;
            m::CtrlSeg ctrl;
            memcpy(&ctrl, w, 16);
            const uint32_t oio = m::be32(ctrl.opmod_idx_opcode), qd = m::be32(ctrl.qpn_ds);
            const uint8_t opcode = oio & 0xff;
            const uint16_t index = static_cast<uint16_t>(oio >> 8);
            if (index != static_cast<uint16_t>(hw_ci) || (qd >> 8) != q.qpn) {
                printf("WQE at %llu carries index %u / qpn %u\n", (unsigned long long)hw_ci, index, qd >> 8);
                ++problems;
            }
            const uint8_t syndrome = in_error ? 0x05 : execute(w, opcode, qd & 0x3f);   // 0x05: flushed
            if (syndrome && !in_error) {
                in_error = true;
                complete(index, opcode, m::kCqeReqErr, syndrome);
            } else if (syndrome && (ctrl.fm_ce_se & m::kCqUpdate)) {
                complete(index, opcode, m::kCqeReqErr, syndrome);   // WR_FLUSH of a WQE after the error
            } else if (!syndrome && (ctrl.fm_ce_se & m::kCqUpdate)) {
                complete(index, opcode, m::kCqeReq, 0);
            }
            ++hw_ci;
            // Chaos: now and then the NIC stalls after a WQE, long enough for a reader spinning on what it
            // just wrote (a signal) to look at what the next WQEs will write (a poster that signals first fails).
            if (chaos && rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        return true;
    }
};

// A NIC: a thread that serves several queues until stopped.
struct Nic {
    std::vector<Model*> queues;
    std::atomic<bool> stop{false};
    std::thread thread;
    void start() {
        thread = std::thread([this] {
            while (!stop.load(std::memory_order_acquire)) {
                bool busy = false;
                for (Model* q : queues) busy |= q->step();
                if (!busy) std::this_thread::yield();   // host threads share few cores: let the posters run
            }
        });
    }
    void join() {
        stop.store(true);
        thread.join();
    }
};

// A poster's give_up(): on the host the spinning threads share few cores, so yield, then check the deadline.
inline bool late(std::chrono::steady_clock::time_point deadline) {
    std::this_thread::yield();
    return std::chrono::steady_clock::now() > deadline;
}

}  // namespace nic_model
