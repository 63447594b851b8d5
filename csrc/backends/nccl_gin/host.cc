// The nccl_gin backend's host glue: a few C functions over NCCL's host API, compiled (deepep_portable/
// transports/nccl_gin/host.py) against the headers of the libnccl the process loads and linked to it, so the
// versioned structs (ncclDevCommRequirements, ncclDevComm) are filled by NCCL's own headers and initializers
// and never mirrored field by field in Python. The version guards of the host side live here, in one place:
//
//   2.28.x      no size/magic/version in the requirements: zero the struct (2.29+ would reject it);
//               GIN switches on with signals/counters/ginForceEnable, so LSA-only sets none of them.
//   2.29.0+     NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER (size, magic, version, defaults).
//   2.29.7+     ginConnectionType: NONE for LSA-only (any GIN resource with NONE is an error, and
//               barrierCount counts as one: LSA-only uses lsaBarrierCount), FULL for GIN.
//   2.30.7+     ginStrongSignalsRequired / ginVaSignalsRequired (our SET emulation uses VA signals).
//
// Every function returns an ncclResult_t (0 = success) or, for requests this version cannot serve, -1 with
// the reason in the caller's buffer.
#include <cstdio>
#include <cstring>

#include <nccl.h>
#include <nccl_device.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 7)
#error "the nccl_gin backend needs NCCL >= 2.28.7 (the device API with GIN): the probe refuses older ones"
#endif

extern "C" {

// What the window asks of a device communicator (host mirror: nccl_gin/host.py DginRequest, all int32).
struct DginRequest {
    int lsa_barrier_count;   // LSA barriers (one per CTA that uses one)
    int gin;                 // 0: LSA only (no GIN resource requested: works without a NIC); 1: GIN too
    int gin_contexts;        // GIN contexts (QPs per peer): our channels
    int gin_signals;         // indexed GIN signals (0: we use VA signals in our own window)
    int gin_counters;
    int gin_queue_depth;     // 0: NCCL's default
    int gin_traffic_class;   // < 0: NCCL's default
};

int dgin_header_version() { return NCCL_VERSION_CODE; }

int dgin_runtime_version(int* version) { return static_cast<int>(ncclGetVersion(version)); }

size_t dgin_requirements_size() { return sizeof(ncclDevCommRequirements); }

size_t dgin_devcomm_size() { return sizeof(ncclDevComm); }

size_t dgin_request_size() { return sizeof(DginRequest); }

static int fail(char* why, size_t why_len, const char* text) {
    if (why != nullptr && why_len > 0)
        snprintf(why, why_len, "%s", text);
    return -1;
}

// The requirements for `req`, built as this NCCL version wants them.
static int build(const DginRequest* req, ncclDevCommRequirements* r, char* why, size_t why_len) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
    ncclDevCommRequirements init = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
    *r = init;
#else
    memset(r, 0, sizeof(*r));   // 2.28: no size/magic/version; zero is "nothing requested"
#endif
    r->lsaBarrierCount = req->lsa_barrier_count;
    r->lsaMultimem = false;     // NVLS stays off (shared machines; DESIGN.md)
    if (!req->gin) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
        r->ginConnectionType = NCCL_GIN_CONNECTION_NONE;
#endif
        r->ginSignalCount = 0;
        r->ginCounterCount = 0;
        r->barrierCount = 0;
        return 0;
    }
    r->ginContextCount = req->gin_contexts;
    r->ginSignalCount = req->gin_signals;
    r->ginCounterCount = req->gin_counters;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
    r->ginConnectionType = NCCL_GIN_CONNECTION_FULL;
    if (req->gin_queue_depth > 0)
        r->ginQueueDepth = req->gin_queue_depth;
#else
    r->ginForceEnable = true;   // 2.28.7 - 2.29.3: GIN on without indexed signals requested
    if (req->gin_queue_depth > 0)
        return fail(why, why_len, "ginQueueDepth needs NCCL >= 2.29.7");
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 4)
    if (req->gin_traffic_class >= 0)
        r->ginTrafficClass = req->gin_traffic_class;
#else
    if (req->gin_traffic_class >= 0)
        return fail(why, why_len, "ginTrafficClass needs NCCL >= 2.30.4");
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 7)
    r->ginVaSignalsRequired = true;      // SET signals are emulated with VA signal adds in our window
    r->ginStrongSignalsRequired = true;  // a signal orders the context's earlier puts to that peer
#endif
    return 0;
}

// The requirements as bytes (out_size >= dgin_requirements_size()) and "name=value;..." of the fields set.
int dgin_requirements(const DginRequest* req, void* out, size_t out_size, char* describe, size_t describe_len) {
    ncclDevCommRequirements r;
    if (out_size < sizeof(r))
        return fail(describe, describe_len, "output smaller than ncclDevCommRequirements");
    const int rc = build(req, &r, describe, describe_len);
    if (rc != 0)
        return rc;
    memcpy(out, &r, sizeof(r));
    if (describe != nullptr && describe_len > 0) {
        int conn = -1, va = -1;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
        conn = static_cast<int>(r.ginConnectionType);
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 7)
        va = r.ginVaSignalsRequired ? 1 : 0;
#endif
        size_t size = 0;
        unsigned magic = 0;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
        size = r.size;
        magic = r.magic;
#endif
        snprintf(describe, describe_len,
                 "size=%zu;magic=%u;lsaBarrierCount=%d;barrierCount=%d;lsaMultimem=%d;ginContextCount=%d;"
                 "ginSignalCount=%d;ginCounterCount=%d;ginConnectionType=%d;ginVaSignalsRequired=%d",
                 size, magic, r.lsaBarrierCount, r.barrierCount, r.lsaMultimem ? 1 : 0,
                 req->gin ? r.ginContextCount : 0, r.ginSignalCount, r.ginCounterCount, conn, va);
    }
    return 0;
}

// ---- communicator, memory, windows, device communicator (run on a GPU machine) -------------------------
int dgin_get_unique_id(void* out) {
    ncclUniqueId id;
    const ncclResult_t rc = ncclGetUniqueId(&id);
    memcpy(out, &id, sizeof(id));
    return static_cast<int>(rc);
}

size_t dgin_unique_id_size() { return sizeof(ncclUniqueId); }

int dgin_comm_init_rank(void** comm, int nranks, const void* id, int rank) {
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof(uid));
    return static_cast<int>(ncclCommInitRank(reinterpret_cast<ncclComm_t*>(comm), nranks, uid, rank));
}

int dgin_comm_destroy(void* comm) { return static_cast<int>(ncclCommDestroy(static_cast<ncclComm_t>(comm))); }

int dgin_mem_alloc(void** ptr, size_t size) { return static_cast<int>(ncclMemAlloc(ptr, size)); }

int dgin_mem_free(void* ptr) { return static_cast<int>(ncclMemFree(ptr)); }

int dgin_window_register(void* comm, void* ptr, size_t size, int flags, void** win) {
    return static_cast<int>(ncclCommWindowRegister(static_cast<ncclComm_t>(comm), ptr, size,
                                                   reinterpret_cast<ncclWindow_t*>(win), flags));
}

int dgin_window_deregister(void* comm, void* win) {
    return static_cast<int>(ncclCommWindowDeregister(static_cast<ncclComm_t>(comm), static_cast<ncclWindow_t>(win)));
}

// Create the device communicator for `req`; its bytes (what kernels take) go to `out` (>= dgin_devcomm_size()).
int dgin_devcomm_create(void* comm, const DginRequest* req, void* out, size_t out_size, char* why, size_t why_len) {
    ncclDevCommRequirements r;
    if (out_size < sizeof(ncclDevComm))
        return fail(why, why_len, "output smaller than ncclDevComm");
    const int rc = build(req, &r, why, why_len);
    if (rc != 0)
        return rc;
    ncclDevComm dev;
    memset(&dev, 0, sizeof(dev));
    const ncclResult_t st = ncclDevCommCreate(static_cast<ncclComm_t>(comm), &r, &dev);
    if (st == ncclSuccess)
        memcpy(out, &dev, sizeof(dev));
    return static_cast<int>(st);
}

// The documented-stable fields of a device communicator's bytes: rank, nRanks, lsaRank, lsaSize, ginContextCount.
void dgin_devcomm_info(const void* devcomm, int* out5) {
    const ncclDevComm* d = static_cast<const ncclDevComm*>(devcomm);
    out5[0] = d->rank;
    out5[1] = d->nRanks;
    out5[2] = d->lsaRank;
    out5[3] = d->lsaSize;
    out5[4] = static_cast<int>(d->ginContextCount);
}

int dgin_devcomm_destroy(void* comm, const void* devcomm) {
    return static_cast<int>(ncclDevCommDestroy(static_cast<ncclComm_t>(comm), static_cast<const ncclDevComm*>(devcomm)));
}

const char* dgin_error_string(int rc) { return ncclGetErrorString(static_cast<ncclResult_t>(rc)); }

const char* dgin_last_error(void* comm) { return ncclGetLastError(static_cast<ncclComm_t>(comm)); }

}  // extern "C"
