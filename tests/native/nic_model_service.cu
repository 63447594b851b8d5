// The NIC model as a service for a process's ibgda window (tests only: tests/ibgda_model.py loads it with
// ctypes; never shipped). One per process: a key table (every rank's window, mapped into this process, so
// the model can land a WRITE in a peer's window as that peer's NIC would), the queues this rank posts to,
// and one thread that serves them (mlx5_nic_model.hpp). The queues' memory is the caller's (pinned and
// mapped for a GPU poster), laid out by nms_queue_layout. nms_post_write_signal is the CPU tests' poster:
// ops.cuh on a host thread, the same code a GPU warp runs.
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/ibgda/ops.cuh"
#include "mlx5_nic_model.hpp"

using namespace nic_model;

namespace {

// A queue's block (what the NIC reads and writes): ring [depth x 64] | doorbell (u64) | dbr (u32) | pad | CQE [64].
// The posters' own words (reserve, turn, completed: SendQueue) are elsewhere, the caller's: GPU memory for a
// GPU poster (only its threads touch them, with system-scope atomics that host memory need not support).
constexpr uint64_t kDoorbellAt = 0, kDbrAt = 8, kCqeAt = 64, kTail = 128;

struct Service {
    std::vector<Region> keys;
    std::vector<std::unique_ptr<Model>> models;
    Nic nic;
    bool running = false;
};

}  // namespace

extern "C" {

uint64_t nms_queue_bytes(uint32_t depth) { return static_cast<uint64_t>(depth) * m::kWqebbBytes + kTail; }

// Fill `sq` (an ibgda::SendQueue) for the queue whose block starts at `block` (zeroed by the caller, except
// the CQE: nms_add_queue sets it to "no completion yet"), with the posters' three words at `words` (zeroed).
void nms_queue_layout(uint64_t block, uint64_t words, uint32_t depth, uint32_t qpn, SendQueue* sq) {
    uint8_t* b = reinterpret_cast<uint8_t*>(block);
    uint8_t* tail = b + static_cast<uint64_t>(depth) * m::kWqebbBytes;
    Word* w = reinterpret_cast<Word*>(words);
    *sq = SendQueue{b, depth, qpn, w, w + 1, w + 2, reinterpret_cast<uint32_t*>(tail + kDbrAt),
                    reinterpret_cast<Word*>(tail + kDoorbellAt), tail + kCqeAt};
}

void* nms_create(uint32_t num_keys) {
    Service* s = new Service;
    s->keys.assign(num_keys, Region{0, 0, 0});
    return s;
}

// Key `key` names `len` bytes registered at `base`, reached here at `local` (0: at base).
int nms_set_key(void* svc, uint32_t key, uint64_t base, uint64_t len, uint64_t local) {
    Service* s = static_cast<Service*>(svc);
    if (s->running || key >= s->keys.size()) return -1;
    s->keys[key] = Region{base, len, local};
    return 0;
}

// The model reads the ring, doorbell record and doorbell and writes the CQE (never the posters' words).
int nms_add_queue(void* svc, uint64_t block, uint32_t depth, uint32_t qpn, int chaos, int atomic_be) {
    Service* s = static_cast<Service*>(svc);
    if (s->running || depth == 0 || (depth & (depth - 1)) != 0) return -1;
    SendQueue sq;
    nms_queue_layout(block, 0, depth, qpn, &sq);
    memset(const_cast<uint8_t*>(sq.cq), 0xff, 64);   // owner / opcode: no completion yet
    s->models.emplace_back(new Model);
    Model& model = *s->models.back();
    model.attach(sq, const_cast<uint8_t*>(sq.cq), &s->keys);
    model.chaos = chaos != 0;
    model.atomic_be = atomic_be != 0;
    s->nic.queues.push_back(&model);
    return static_cast<int>(s->models.size()) - 1;
}

void nms_start(void* svc) {
    Service* s = static_cast<Service*>(svc);
    if (!s->running) {
        s->running = true;
        s->nic.start();
    }
}

// Stops the thread and frees the service; returns the problems the model saw (a poster that broke the rules).
int nms_destroy(void* svc) {
    Service* s = static_cast<Service*>(svc);
    if (s->running) s->nic.join();
    int problems = 0;
    for (auto& m : s->models) problems += m->problems;
    delete s;
    return problems;
}

// The CPU tests' poster: WRITE `bytes` from my window at `laddr` to the peer's window at `roff`, then SET the
// u64 at `sig_off` there to `value` (inline WRITE) on the same queue, and wait until both completed. Returns
// 0, the error CQE's syndrome, or -1 on timeout.
int nms_post_write_signal(const Endpoint* e, uint64_t laddr, uint64_t roff, uint32_t bytes, uint64_t sig_off,
                          uint64_t value, double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
    const auto give_up = [&] { return late(deadline); };
    CqStatus error{};
    if (bytes > 0 && post_write(*e, laddr, roff, bytes, give_up, &error) == kNotPosted) return error.error ? 1 : -1;
    const Word end = post_value(*e, sig_off, value, give_up, &error);
    if (end == kNotPosted) return error.error ? 1 : -1;
    if (!wait_completed(e->q, end + 1, give_up, &error)) return error.error ? error.cqe.syndrome : -1;
    return 0;
}

}  // extern "C"
