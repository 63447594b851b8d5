// The CPU doorbell of the ibgda backend: when the driver refuses to map a UAR register into the GPU
// (cuMemHostRegister with IOMEMORY needs the NVIDIA driver's PeerMappingOverride=1 on many systems), each queue's
// `doorbell` points at a mailbox word in pinned host memory instead, and one host thread per window forwards every
// new mailbox value to the queue's real register. The device code is unchanged (sq.cuh stores the same 8 bytes);
// a doorbell costs a PCIe round trip to host memory and the thread's polling delay more. Compiled into the DevX
// glue (ibgda/devx_glue.py).
//
// Ordering: the GPU poster fences (system scope) after the WQE and after the doorbell record before it stores the
// mailbox, so once this thread reads a value, the WQE and record it covers are visible to any observer, the NIC
// included; the thread then stores the value to the register, ordered after that read by a full fence (a
// write-combining BlueFlame mapping needs it flushed too; the fence does that). Posters publish in turn order
// (sq.cuh), so a mailbox only moves forward; forwarding its latest value, skipping ones overwritten meanwhile, is
// what the NIC needs (a doorbell says "up to here").
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#define DP_API extern "C" __attribute__((visibility("default")))

namespace {

struct Proxy {
    std::vector<const uint64_t*> mailboxes;
    std::vector<volatile uint64_t*> registers;
    std::vector<uint64_t> last;
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> forwarded{0};
    std::thread thread;

    void run() {
        unsigned idle = 0;
        for (;;) {
            const bool stopping = stop.load(std::memory_order_acquire);   // then one more full pass
            bool moved = false;
            for (size_t i = 0; i < mailboxes.size(); ++i) {
                const uint64_t v = __atomic_load_n(mailboxes[i], __ATOMIC_ACQUIRE);
                if (v == last[i])
                    continue;
                last[i] = v;
                std::atomic_thread_fence(std::memory_order_seq_cst);
                *registers[i] = v;   // one aligned 8-byte store, as the GPU's
                std::atomic_thread_fence(std::memory_order_seq_cst);
                forwarded.fetch_add(1, std::memory_order_relaxed);
                moved = true;
            }
            // Spin while busy; after a long idle stretch, yield the core now and then (latency, not correctness).
            if (stopping)
                return;
            idle = moved ? 0 : idle + 1;
            if (idle > (1u << 16))
                std::this_thread::yield();
        }
    }
};

}  // namespace

// Start forwarding mailboxes[i] -> registers[i] (host addresses, n of each; the mailboxes start at 0, the value no
// doorbell has). 0, or an errno-style code.
DP_API int dx_proxy_start(const uint64_t* mailboxes, const uint64_t* registers, int n, void** proxy) noexcept {
    if (!mailboxes || !registers || n <= 0 || !proxy)
        return EINVAL;
    *proxy = nullptr;
    Proxy* p = new (std::nothrow) Proxy;
    if (!p)
        return ENOMEM;
    try {
        for (int i = 0; i < n; ++i) {
            p->mailboxes.push_back(reinterpret_cast<const uint64_t*>(static_cast<uintptr_t>(mailboxes[i])));
            p->registers.push_back(reinterpret_cast<volatile uint64_t*>(static_cast<uintptr_t>(registers[i])));
            p->last.push_back(0);
        }
        p->thread = std::thread([p] { p->run(); });
    } catch (...) {
        delete p;
        return EAGAIN;
    }
    *proxy = p;
    return 0;
}

// Doorbells forwarded so far (tests, doctor).
DP_API uint64_t dx_proxy_forwarded(void* proxy) noexcept {
    return proxy ? static_cast<Proxy*>(proxy)->forwarded.load() : 0;
}

// Stop the thread (after a last pass over the mailboxes) and free the proxy.
DP_API int dx_proxy_stop(void* proxy) noexcept {
    if (!proxy)
        return EINVAL;
    Proxy* p = static_cast<Proxy*>(proxy);
    p->stop.store(true);
    if (p->thread.joinable())
        p->thread.join();
    delete p;
    return 0;
}
