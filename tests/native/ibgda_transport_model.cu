// The ibgda backend's operations (csrc/backends/ibgda/ops.cuh: what device.cuh's contract primitives post)
// end to end between ranks, every rank a host thread with its own window and NIC (mlx5_nic_model.hpp, with
// chaos: a WRITE's pieces land in random order), one RC queue per (rank, peer), self included. Compiled by
// tests/test_ibgda_transport.py; host code only.
//
// Each round, every rank: waits until each peer acknowledged the previous round (so its block there is
// free), refills its staging rows (after draining its queues: the NIC read the previous ones), WRITEs a
// 4 KB block to every peer and then SETs its signal word there on the same queue (the ordering device.cuh
// relies on: RC keeps a queue's WQEs in order); waits for every peer's signal and checks every byte of the
// block it signalled; READs a peer's signal word back; FETCH_ADDs (1 + rank) on rank 0's counter; then
// acknowledges. Small rings force wrap-arounds, and enough rounds wrap the 16-bit WQE index. Then a WRITE
// with a bad remote key comes back as an error CQE to the poster, the queue then flushes what follows.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "backends/ibgda/ops.cuh"
#include "mlx5_nic_model.hpp"

using namespace nic_model;

namespace {

constexpr int kBlock = 4096;
constexpr int kDeadlineS = 60;   // a rank that waits longer than this for a peer reports it
constexpr uint64_t kWindow = 1 << 20;
// Window layout (bytes): blocks [R][kBlock] | signals u64 [R] | acks u64 [R] | counter | results | staging
constexpr uint64_t kSignals = 256 * 1024, kAcks = kSignals + 4096, kCounter = kAcks + 4096, kResults = kCounter + 64;
constexpr uint64_t kStaging = 512 * 1024;

struct World {
    int ranks;
    std::vector<uint8_t*> windows;
    std::vector<Region> keys;                         // key r + 1 = rank r's window (key 0 is never valid)
    std::vector<std::unique_ptr<Queue>> queues;       // [r * ranks + p]
    std::vector<std::unique_ptr<Model>> models;
    std::vector<std::unique_ptr<Nic>> nics;           // rank r's NIC serves its queues
    std::vector<Endpoint> eps;

    bool atomic_be;
    World(int ranks_, uint32_t depth, bool chaos, bool atomic_be_ = true) : ranks(ranks_), atomic_be(atomic_be_) {
        keys.push_back({0, 0});
        for (int r = 0; r < ranks; ++r) {
            windows.push_back(static_cast<uint8_t*>(aligned_alloc(4096, kWindow)));
            memset(windows.back(), 0, kWindow);
            keys.push_back({reinterpret_cast<uint64_t>(windows.back()), kWindow});
        }
        for (int r = 0; r < ranks; ++r) {
            nics.emplace_back(new Nic);
            for (int p = 0; p < ranks; ++p) {
                queues.emplace_back(new Queue(depth));
                models.emplace_back(new Model);
                Model& m = *models.back();
                m.attach(*queues.back(), 0x100 + r * ranks + p, &keys);
                m.chaos = chaos;
                m.atomic_be = atomic_be;
                m.rng.seed(1234 + r * ranks + p);
                nics.back()->queues.push_back(&m);
                eps.push_back(Endpoint{m.q, reinterpret_cast<uint64_t>(windows[p]), static_cast<uint32_t>(p + 1),
                                       static_cast<uint32_t>(r + 1)});
            }
        }
        for (auto& n : nics) n->start();
    }
    ~World() {
        for (auto& n : nics) n->join();
        for (auto* w : windows) free(w);
    }
    Endpoint& ep(int r, int p) { return eps[r * ranks + p]; }
    uint64_t load(int r, uint64_t off) {
        return reinterpret_cast<std::atomic<uint64_t>*>(windows[r] + off)->load(std::memory_order_acquire);
    }
    int problems() {
        int n = 0;
        for (auto& m : models) n += m->problems;
        return n;
    }
};

uint64_t pattern(int source, int round, int i) {
    return (static_cast<uint64_t>(source + 1) << 48) ^ (static_cast<uint64_t>(round) << 20) ^ static_cast<uint64_t>(i);
}

// Spin (yielding) until the word at `off` of rank r's window reaches v; false after the deadline.
bool wait_word(World& w, int r, uint64_t off, uint64_t v, std::chrono::steady_clock::time_point deadline) {
    while (w.load(r, off) < v)
        if (late(deadline)) return false;
    return true;
}

int rank_main(World& w, int me, int rounds, std::atomic<int>& errors) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kDeadlineS);
    auto give_up = [&] { return late(deadline); };
    auto fail = [&](const char* what, int peer, int round) {
        if (errors.fetch_add(1) < 10) printf("rank %d, peer %d, round %d: %s\n", me, peer, round, what);
        return 1;
    };
    uint8_t* win = w.windows[me];
    for (int round = 1; round <= rounds; ++round) {
        for (int p = 0; p < w.ranks; ++p)   // each peer checked my previous block (its ack, in my window)
            if (!wait_word(w, me, kAcks + 8 * p, round - 1, deadline)) return fail("no ack", p, round);
        for (int p = 0; p < w.ranks; ++p) {   // the NIC read my previous staging rows: they may be rewritten
            CqStatus st{};
            if (!drain(w.ep(me, p).q, give_up, &st)) return fail("drain failed", p, round);
        }
        for (int p = 0; p < w.ranks; ++p) {
            auto* rows = reinterpret_cast<uint64_t*>(win + kStaging + static_cast<uint64_t>(p) * kBlock);
            for (int i = 0; i < kBlock / 8; ++i) rows[i] = pattern(me, round, i) ^ static_cast<uint64_t>(p);
        }
        std::atomic_thread_fence(std::memory_order_seq_cst);
        for (int p = 0; p < w.ranks; ++p) {
            CqStatus st{};
            const uint64_t src = reinterpret_cast<uint64_t>(win + kStaging + static_cast<uint64_t>(p) * kBlock);
            if (post_write(w.ep(me, p), src, static_cast<uint64_t>(me) * kBlock, kBlock, give_up, &st) == kNotPosted ||
                post_value(w.ep(me, p), kSignals + 8 * me, round, give_up, &st) == kNotPosted)
                return fail("post failed", p, round);
        }
        for (int s = 0; s < w.ranks; ++s) {   // the signal says the block is whole
            if (!wait_word(w, me, kSignals + 8 * s, round, deadline)) return fail("no signal", s, round);
            const auto* block = reinterpret_cast<const uint64_t*>(win + static_cast<uint64_t>(s) * kBlock);
            for (int i = 0; i < kBlock / 8; ++i)
                if (block[i] != (pattern(s, round, i) ^ static_cast<uint64_t>(me)))
                    return fail("signal seen before its data", s, round);
        }
        {   // READ a peer's signal word of me: it is this round's or later
            const int p = (me + round) % w.ranks;
            CqStatus st{};
            const uint64_t result = reinterpret_cast<uint64_t>(win + kResults);
            const Word idx = post_read(w.ep(me, p), kSignals + 8 * me, result, 8, give_up, &st);
            if (idx == kNotPosted || !wait_completed(w.ep(me, p).q, idx + 1, give_up, &st))
                return fail("read failed", p, round);
            if (w.load(me, kResults) < static_cast<uint64_t>(round)) return fail("read an old value", p, round);
        }
        {   // FETCH_ADD on rank 0's counter: the old value comes back big-endian
            CqStatus st{};
            const uint64_t result = reinterpret_cast<uint64_t>(win + kResults + 8);
            const Word idx = post_fetch_add(w.ep(me, 0), kCounter, 1 + me, result, give_up, &st);
            if (idx == kNotPosted || !wait_completed(w.ep(me, 0).q, idx + 1, give_up, &st))
                return fail("fetch_add failed", 0, round);
            const uint64_t raw = w.load(me, kResults + 8);
            const uint64_t old = w.atomic_be ? m::be64(raw) : raw;   // device.cuh: atomic_result_be
            const uint64_t most = static_cast<uint64_t>(round) * w.ranks * (w.ranks + 1) / 2;
            if (old >= most) return fail("fetch_add returned an impossible value", 0, round);
        }
        for (int p = 0; p < w.ranks; ++p) {   // I checked your block of this round: ack in your window, slot me
            CqStatus st{};
            if (post_value(w.ep(me, p), kAcks + 8 * me, round, give_up, &st) == kNotPosted)
                return fail("ack failed", p, round);
        }
    }
    return 0;
}

int exchange(int ranks, int rounds, uint32_t depth, bool chaos, bool atomic_be = true) {
    World w(ranks, depth, chaos, atomic_be);
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) threads.emplace_back([&, r] { rank_main(w, r, rounds, errors); });
    for (auto& t : threads) t.join();
    const uint64_t counter = w.load(0, kCounter);
    const uint64_t expected = static_cast<uint64_t>(rounds) * ranks * (ranks + 1) / 2;
    uint64_t most_posts = 0;
    for (auto& q : w.queues) most_posts = std::max<uint64_t>(most_posts, q->reserve);
    printf("exchange ranks=%d rounds=%d depth=%u chaos=%d atomic_be=%d: errors %d, counter %llu (expected %llu), most "
           "WQEs on one queue %llu, model problems %d\n", ranks, rounds, depth, chaos, atomic_be, errors.load(),
           (unsigned long long)counter, (unsigned long long)expected, (unsigned long long)most_posts, w.problems());
    return errors.load() + (counter != expected) + w.problems();
}

// A WRITE with a bad remote key: the poster waiting for it gets the error CQE (syndrome 0x13, its QPN and
// WQE index); a later WQE on that queue is flushed (never executed) and its waiter gets an error too (the
// WR_FLUSH entry, 0x05, or still the first error: on a collapsed CQ either may be the one read).
int error_completion() {
    World w(2, 16, false);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    auto give_up = [&] { return late(deadline); };
    Endpoint bad = w.ep(0, 1);
    bad.rkey = 77;
    CqStatus st{}, later{};
    const Word first = post_write(bad, reinterpret_cast<uint64_t>(w.windows[0] + kStaging), 0, 64, give_up, &st);
    const bool waited = wait_completed(w.ep(0, 1).q, first + 1, give_up, &st);
    const Word after = post_value(w.ep(0, 1), kSignals, 5, give_up, &later);
    const bool waited_later = wait_completed(w.ep(0, 1).q, after + 1, give_up, &later);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const bool ok = first == 0 && after == 1 && !waited && st.error && st.cqe.syndrome == 0x13 &&
                    st.cqe.qpn == w.ep(0, 1).q.qpn && st.cqe.wqe_counter == 0 && !waited_later && later.error &&
                    (later.cqe.syndrome == 0x05 || later.cqe.syndrome == 0x13) && w.load(1, kSignals) == 0;
    printf("error_completion: waited %d, error %d, syndrome %#x, qpn %#x, wqe %u; later WQE: waited %d, syndrome "
           "%#x, flushed %d\n", waited, st.error, st.cqe.syndrome, st.cqe.qpn, st.cqe.wqe_counter, waited_later,
           later.cqe.syndrome, w.load(1, kSignals) == 0);
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    const int wrap_rounds = argc > 1 ? atoi(argv[1]) : 15000;   // ~4.5 WQEs per round on queue (0, 0)
    int failures = 0;
    failures += exchange(3, 300, 64, true);           // chaos: pieces of a WRITE land in random order
    if (wrap_rounds > 0) failures += exchange(2, wrap_rounds, 32, false);
    failures += exchange(3, 100, 64, false, false);   // an HCA that returns atomic results in host order  // > 65536 WQEs on one queue: the 16-bit index wraps
    failures += error_completion();
    printf("failures %d\n", failures);
    return failures != 0;
}
