// csrc/backends/ibgda/sq.cuh's posting code from host threads against the software NIC of
// mlx5_nic_model.hpp (compiled by tests/test_ibgda_sq.py; host code only): many posters on one small ring,
// past the 16-bit index wrap, selective signalling, and an error CQE.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "mlx5_nic_model.hpp"

using namespace nic_model;

// Many threads post RDMA WRITEs of distinct values through one small ring, past the 16-bit index wrap.
static int concurrent_writes(int threads, int per_thread, uint32_t depth, int signal_every) {
    Queue qu(depth);
    const int total = threads * per_thread;
    std::vector<uint64_t> src(total), dst(total, 0);
    for (int i = 0; i < total; ++i) src[i] = 0x1000000000ull + i;
    const std::vector<Region> keys = {{0, 0}, {reinterpret_cast<uint64_t>(src.data()), total * 8ull},
                                      {reinterpret_cast<uint64_t>(dst.data()), total * 8ull}};
    Model nic;
    nic.attach(qu, 0x1234, &keys);
    Nic model;
    model.queues = {&nic};
    model.start();
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
    model.join();
    int bad = 0;
    for (int i = 0; i < total; ++i) bad += dst[i] != src[i];
    printf("concurrent_writes threads=%d posts=%d depth=%u signal_every=%d: doorbells %d, unwrapped pi %llu, "
           "wrong %d, abandoned %d, model problems %d\n", threads, total, depth, signal_every, nic.doorbells,
           (unsigned long long)nic.unwrapped_pi, bad, failed.load(), nic.problems);
    return bad + failed.load() + nic.problems + (nic.unwrapped_pi != static_cast<uint64_t>(total));
}

// A WRITE with a bad remote key: the NIC reports an error CQE (and flushes what follows); a poster waiting
// for space gets an error back.
static int error_cqe() {
    const uint32_t depth = 8;
    Queue qu(depth);
    uint64_t src = 7, dst = 0;
    const std::vector<Region> keys = {{0, 0}, {reinterpret_cast<uint64_t>(&src), 8}, {reinterpret_cast<uint64_t>(&dst), 8}};
    Model nic;
    nic.attach(qu, 0x77, &keys);
    Nic model;
    model.queues = {&nic};
    model.start();
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
    model.join();
    // The poster sees the bad write's entry (0x13, WQE 1) or, on the collapsed CQ, a later WQE's WR_FLUSH (0x05).
    const bool ok = idx == ~Word(0) && err.error && err.cqe.qpn == 0x77 && dst == 7 &&
                    ((err.cqe.syndrome == 0x13 && err.cqe.wqe_counter == 1) ||
                     (err.cqe.syndrome == 0x05 && err.cqe.wqe_counter > 1));
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
