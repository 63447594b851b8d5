// The nccl_gin backend's SET-over-ADD emulation (csrc/backends/nccl_gin/signal_shadow.cuh) on host threads,
// against a mock of GIN's VA signals: add-only words, each add delivered late and out of order (a queue per
// receiver that delivers a random pending add). Writers SET increasing values to many (peer, word) pairs, up to
// 8 threads writing distinct words through one shared table; after everything is delivered every word must hold
// the last value set, and at no time more than it. A full table must refuse (nullptr) and change nothing; a
// reset (forget) of a range starts its words again from 0 and leaves the others alone.
// Compiled and run by tests/test_nccl_gin_device.py (run_native).
#include <atomic>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "backends/nccl_gin/signal_shadow.cuh"

using deepep_portable::transport::SignalShadow;

namespace {

struct MockGin {   // add-only words of every receiver's window, adds delivered in random order
    std::vector<std::atomic<uint64_t>> words;
    std::vector<std::pair<int, uint64_t>> pending;   // (word index, delta)
    std::mutex m;
    std::mt19937_64 rng{7};
    explicit MockGin(size_t n) : words(n) {}
    void add(int word, uint64_t delta) {
        std::lock_guard<std::mutex> g(m);
        pending.emplace_back(word, delta);
    }
    bool deliver_one() {
        std::lock_guard<std::mutex> g(m);
        if (pending.empty()) return false;
        const size_t i = rng() % pending.size();
        words[pending[i].first].fetch_add(pending[i].second);
        pending[i] = pending.back();
        pending.pop_back();
        return true;
    }
};

}  // namespace

int main() {
    int failures = 0;
    constexpr int kPeers = 16, kWordsPerPeer = 64, kThreads = 8, kRounds = 200;
    constexpr uint32_t kCapacity = 4096;
    std::vector<unsigned long long> keys(kCapacity, 0);
    std::vector<uint64_t> values(kCapacity, 0);
    SignalShadow shadow{keys.data(), values.data(), kCapacity};
    MockGin gin(kPeers * kWordsPerPeer);
    std::vector<std::atomic<uint64_t>> last(kPeers * kWordsPerPeer);
    std::atomic<bool> done{false};
    std::thread nic([&] {
        while (!done.load() || gin.deliver_one())
            if (!gin.deliver_one()) std::this_thread::yield();
    });
    std::vector<std::thread> writers;
    for (int t = 0; t < kThreads; ++t)
        writers.emplace_back([&, t] {
            std::mt19937_64 rng(100 + t);
            for (int round = 1; round <= kRounds; ++round)
                for (int w = t; w < kPeers * kWordsPerPeer; w += kThreads) {   // each word: one writer
                    const int peer = w / kWordsPerPeer;
                    const int64_t off = 8 * (w % kWordsPerPeer) + 4096;
                    const uint64_t v = (static_cast<uint64_t>(round) << 24) | (rng() & 0xffffff);
                    uint64_t delta = 0;
                    if (!shadow.delta_for(peer, off, v, &delta)) {
                        printf("table full too early at word %d\n", w);
                        ++failures;
                        continue;
                    }
                    last[w].store(v);
                    gin.add(w, delta);
                    if (gin.words[w].load() > v) {
                        printf("word %d reads %llu above the last value set %llu\n", w,
                               (unsigned long long)gin.words[w].load(), (unsigned long long)v);
                        ++failures;
                    }
                }
        });
    for (auto& th : writers) th.join();
    done.store(true);
    nic.join();
    for (int w = 0; w < kPeers * kWordsPerPeer; ++w)
        if (gin.words[w].load() != last[w].load()) {
            printf("word %d holds %llu, last set %llu\n", w, (unsigned long long)gin.words[w].load(),
                   (unsigned long long)last[w].load());
            ++failures;
        }
    // A full table refuses a new pair and leaves the old entries alone.
    std::vector<unsigned long long> k2(4, 0);
    std::vector<uint64_t> v2(4, 0);
    SignalShadow small{k2.data(), v2.data(), 4};
    uint64_t d = 0;
    for (int p = 0; p < 4; ++p)
        if (!small.delta_for(p, 8, 10 + p, &d) || d != static_cast<uint64_t>(10 + p)) ++failures;
    if (small.delta_for(9, 8, 5, &d)) {
        printf("a full table took a fifth pair\n");
        ++failures;
    }
    if (!small.delta_for(2, 8, 20, &d) || d != 8) {
        printf("an existing pair's delta after a refusal: %llu\n", (unsigned long long)d);
        ++failures;
    }
    // A reset (transport.cuh): forget [16, 32) in two strided passes; pairs there start again from 0, the
    // others keep their last value.
    std::vector<unsigned long long> k3(64, 0);
    std::vector<uint64_t> v3(64, 0);
    SignalShadow reset{k3.data(), v3.data(), 64};
    for (int p = 0; p < 3; ++p)
        for (int64_t off = 8; off < 48; off += 8)
            reset.delta_for(p, off, 1000 + off, &d);
    reset.forget(16, 32, 0, 2);
    reset.forget(16, 32, 1, 2);
    for (int p = 0; p < 3; ++p)
        for (int64_t off = 8; off < 48; off += 8) {
            const uint64_t want = off >= 16 && off < 32 ? 7 : 7 - (1000 + off);   // delta of SET 7 (wraps)
            if (!reset.delta_for(p, off, 7, &d) || d != want) {
                printf("after forget [16, 32): peer %d offset %lld delta %llu, want %llu\n", p,
                       static_cast<long long>(off), (unsigned long long)d, (unsigned long long)want);
                ++failures;
            }
        }
    printf("failures %d\n", failures);
    return failures != 0;
}
