// SET signals over GIN's add-only signals (nccl_gin/device.cuh): the writer keeps, per (peer, word offset), the
// value it last set there, and sends the difference as a VA signal add. Host and device code, so the emulation
// is tested on host threads against a mock of add-only signals (tests/native/nccl_gin_shadow_model.cu).
//
// Why it is right: the window starts at zero; a signal word has one writer (the contract); its values only
// grow; the writer alone updates the shadow entry of (peer, word). So after the writer's k-th SET of v_k, the
// adds it sent sum to v_k, and once the receiver has all of them its word reads v_k; every delta is
// non-negative, so the word never reads more than the last value set. What a partial sum could do is reach a
// waited-for v_k through a later add that overtook an earlier one (v_k's own add, whose put it guards, still
// in flight). That cannot happen when a word's adds travel on one GIN context: a strong signal's visibility
// implies every earlier put and signal of that context to that peer (NCCL's promise). The kernels keep a
// word's signals on one channel, and besides never SET a word again before its receiver consumed the previous
// value (every next value follows a round trip: the handshake, the LL call halves).
#pragma once

#include <cstdint>

#include <cuda/atomic>

#include "common/kernels/common.cuh"

namespace deepep_portable::transport {

// keys[i]: 0 = empty, else (peer << 40 | offset) + 1, claimed with a CAS and never removed (insert-only: a
// word's entry lives as long as the window); values[i]: the last value set there. capacity: a power of two.
struct SignalShadow {
    unsigned long long* keys;
    uint64_t* values;
    uint32_t capacity;

    // The entry of (peer, off), inserted if new; nullptr when the table is full.
    DEEPEP_HOST_DEVICE uint64_t* slot(int peer, int64_t off) const {
        const unsigned long long key = ((static_cast<unsigned long long>(peer) << 40) | static_cast<uint64_t>(off)) + 1;
        const uint64_t h = key * 0x9E3779B97F4A7C15ull;
        for (uint32_t probe = 0; probe < capacity; ++probe) {
            const uint32_t i = static_cast<uint32_t>((h >> 32) + probe) & (capacity - 1);
            unsigned long long seen = 0ull;
            cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> k(keys[i]);
            if (k.compare_exchange_strong(seen, key, cuda::memory_order_relaxed) || seen == key)
                return values + i;
        }
        return nullptr;
    }

    // The add that SETs (peer, off) to v; false when the table is full (nothing changed).
    DEEPEP_HOST_DEVICE bool delta_for(int peer, int64_t off, uint64_t v, uint64_t* delta) const {
        uint64_t* last = slot(peer, off);
        if (last == nullptr)
            return false;
        *delta = v - *last;
        *last = v;
        return true;
    }

    // Entries [first, capacity) step `stride` (the threads of a block share the scan): the last value set at
    // every peer's word offsets in [begin, end) becomes 0 (their owners zeroed them: transport.cuh's reset).
    // Keys stay: an entry is never removed.
    DEEPEP_HOST_DEVICE void forget(int64_t begin, int64_t end, int first, int stride) const {
        for (uint32_t i = static_cast<uint32_t>(first); i < capacity; i += static_cast<uint32_t>(stride)) {
            const unsigned long long key = keys[i];
            const int64_t off = static_cast<int64_t>((key - 1) & ((1ull << 40) - 1));
            if (key != 0 && off >= begin && off < end)
                values[i] = 0;
        }
    }
};

}  // namespace deepep_portable::transport
