// A software model of an mlx5 NIC's send side, driving csrc/backends/ibgda/sq.cuh's posting code from
// host threads (compiled by tests/test_ibgda_sq.py; host code only). The model watches the doorbell, then
// executes the WQEs up to the doorbell record, checking what hardware would reject (WQE index, opcode,
// keys and bounds), and writes collapsed CQEs (bytes 0-59 first, then the word at 60 in one store).
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "backends/ibgda/sq.cuh"

using namespace deepep_portable::ibgda;
namespace m = deepep_portable::ibgda::mlx5;

struct Region {
    uint64_t base, len;
};

struct Model {
    SendQueue q;
    std::vector<Region> keys;   // key k -> keys[k]
    uint8_t* cqe;
    uint64_t hw_ci = 0;
    std::atomic<bool> stop{false};
    int problems = 0, doorbells = 0;
    uint64_t unwrapped_pi = 0;

    bool key_ok(uint32_t key, uint64_t addr, uint64_t len) const {
        return key < keys.size() && addr >= keys[key].base && addr + len <= keys[key].base + keys[key].len;
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
    void run() {
        uint64_t last_db = 0;
        uint16_t db_pi = 0;
        bool in_error = false;
        while (!stop.load(std::memory_order_acquire)) {
            const uint64_t db = reinterpret_cast<std::atomic<uint64_t>*>(q.doorbell)->load(std::memory_order_acquire);
            if (db != last_db) {
                last_db = db;
                const uint16_t pi = static_cast<uint16_t>(m::be32(static_cast<uint32_t>(db)) >> 8);
                const uint32_t qpn = m::be32(static_cast<uint32_t>(db >> 32)) >> 8;
                const uint16_t step = static_cast<uint16_t>(pi - db_pi);
                if (qpn != q.qpn || step == 0 || step > q.depth) {
                    printf("doorbell went backwards or skipped: pi %u after %u (qpn %u)\n", pi, db_pi, qpn);
                    ++problems;
                }
                unwrapped_pi += step;
                db_pi = pi;
                ++doorbells;
            }
            const uint16_t dbr = static_cast<uint16_t>(
                m::be32(reinterpret_cast<std::atomic<uint32_t>*>(q.dbr)->load(std::memory_order_acquire)));
            if (dbr != db_pi || static_cast<uint16_t>(hw_ci) == db_pi) {   // nothing rung yet (or the record ran ahead)
                std::this_thread::yield();   // host threads share few cores: let the posters run
                continue;
            }
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
                uint8_t syndrome = 0;
                if (in_error) {
                    syndrome = 0x05;   // flushed: the QP is in error
                } else if (opcode == m::kOpRdmaWrite && (qd & 0x3f) == 3) {
                    m::RaddrSeg r;
                    m::DataSeg d;
                    memcpy(&r, w + 16, 16);
                    memcpy(&d, w + 32, 16);
                    const uint64_t raddr = m::be64(r.raddr), laddr = m::be64(d.addr);
                    const uint32_t len = m::be32(d.byte_count);
                    if (!key_ok(m::be32(d.lkey), laddr, len)) syndrome = 0x04;
                    else if (!key_ok(m::be32(r.rkey), raddr, len)) syndrome = 0x13;
                    else memcpy(reinterpret_cast<void*>(raddr), reinterpret_cast<const void*>(laddr), len);
                } else {
                    syndrome = 0x02;   // an opcode this model does not execute
                }
                if (syndrome && !in_error) {
                    in_error = true;
                    complete(index, opcode, m::kCqeReqErr, syndrome);
                } else if (!syndrome && (ctrl.fm_ce_se & m::kCqUpdate)) {
                    complete(index, opcode, m::kCqeReq, 0);
                }
                ++hw_ci;
            }
        }
    }
};

struct Queue {
    std::vector<uint8_t> ring;
    Word reserve = 0, turn = 0, completed = 0, doorbell = 0;
    uint32_t dbr = 0;
    alignas(64) uint8_t cqe[64];
    Queue(uint32_t depth) : ring(depth * 64) { memset(cqe, 0xff, 64); }
    SendQueue sq(uint32_t depth, uint32_t qpn) {
        return SendQueue{ring.data(), depth, qpn, &reserve, &turn, &completed, &dbr, &doorbell, cqe};
    }
};

// A poster's give_up(): on the host the spinning threads share few cores, so yield, then check the deadline.
static bool late(std::chrono::steady_clock::time_point deadline) {
    std::this_thread::yield();
    return std::chrono::steady_clock::now() > deadline;
}

// Many threads post RDMA WRITEs of distinct values through one small ring, past the 16-bit index wrap.
static int concurrent_writes(int threads, int per_thread, uint32_t depth, int signal_every) {
    Queue qu(depth);
    const int total = threads * per_thread;
    std::vector<uint64_t> src(total), dst(total, 0);
    for (int i = 0; i < total; ++i) src[i] = 0x1000000000ull + i;
    Model nic;
    nic.q = qu.sq(depth, 0x1234);
    nic.cqe = qu.cqe;
    nic.keys = {{0, 0}, {reinterpret_cast<uint64_t>(src.data()), total * 8ull},
                {reinterpret_cast<uint64_t>(dst.data()), total * 8ull}};
    std::thread model([&] { nic.run(); });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::atomic<int> failed{0};
    std::vector<std::thread> posters;
    for (int t = 0; t < threads; ++t)
        posters.emplace_back([&, t] {
            for (int j = 0; j < per_thread; ++j) {
                const int i = t * per_thread + j;
                CqStatus err{};
                const Word idx = post(
                    nic.q,
                    [&](uint8_t* wqe, uint16_t pi) {
                        const bool signal = signal_every <= 1 || pi % signal_every == signal_every - 1;
                        m::write_rdma(wqe, m::kOpRdmaWrite, pi, 0x1234, signal ? m::kCqUpdate : 0,
                                      reinterpret_cast<uint64_t>(&dst[i]), 2, reinterpret_cast<uint64_t>(&src[i]), 1, 8);
                    },
                    [&] { return late(deadline); }, &err);
                if (idx == ~Word(0)) {
                    failed.fetch_add(1);
                    return;
                }
            }
        });
    for (auto& p : posters) p.join();
    while (static_cast<uint16_t>(nic.hw_ci) != static_cast<uint16_t>(qu.reserve) && !late(deadline))
        std::this_thread::yield();
    nic.stop.store(true);
    model.join();
    int bad = 0;
    for (int i = 0; i < total; ++i) bad += dst[i] != src[i];
    printf("concurrent_writes threads=%d posts=%d depth=%u signal_every=%d: doorbells %d, unwrapped pi %llu, "
           "wrong %d, abandoned %d, model problems %d\n", threads, total, depth, signal_every, nic.doorbells,
           (unsigned long long)nic.unwrapped_pi, bad, failed.load(), nic.problems);
    return bad + failed.load() + nic.problems + (nic.unwrapped_pi != static_cast<uint64_t>(total));
}

// A WRITE with a bad remote key: the NIC reports an error CQE; a poster waiting for space gets it back.
static int error_cqe() {
    const uint32_t depth = 8;
    Queue qu(depth);
    uint64_t src = 7, dst = 0;
    Model nic;
    nic.q = qu.sq(depth, 0x77);
    nic.cqe = qu.cqe;
    nic.keys = {{0, 0}, {reinterpret_cast<uint64_t>(&src), 8}, {reinterpret_cast<uint64_t>(&dst), 8}};
    std::thread model([&] { nic.run(); });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    CqStatus err{};
    Word idx = 0;
    for (int j = 0; j < 64 && idx != ~Word(0); ++j)
        idx = post(
            nic.q,
            [&](uint8_t* wqe, uint16_t pi) {
                m::write_rdma(wqe, m::kOpRdmaWrite, pi, 0x77, m::kCqUpdate, reinterpret_cast<uint64_t>(&dst),
                              j == 1 ? 9 : 2, reinterpret_cast<uint64_t>(&src), 1, 8);
            },
            [&] { return late(deadline); }, &err);
    nic.stop.store(true);
    model.join();
    const bool ok = idx == ~Word(0) && err.error && err.cqe.syndrome == 0x13 && err.cqe.qpn == 0x77 &&
                    err.cqe.wqe_counter == 1 && dst == 7;
    printf("error_cqe: abandoned %d, error %d, syndrome %#x, qpn %#x, wqe %u, first write landed %d\n",
           idx == ~Word(0), err.error, err.cqe.syndrome, err.cqe.qpn, err.cqe.wqe_counter, dst == 7);
    return ok ? 0 : 1;
}

int main() {
    int failures = 0;
    failures += concurrent_writes(1, 70000, 16, 1);     // one poster past the 16-bit wrap
    failures += concurrent_writes(4, 17000, 16, 1);     // four posters, every WQE signalled, past the wrap too
    failures += concurrent_writes(8, 3000, 64, 8);      // selective signalling: every 8th WQE
    failures += error_cqe();
    printf("failures %d\n", failures);
    return failures != 0;
}
