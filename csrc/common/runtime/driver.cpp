#include "driver.hpp"

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace deepep_portable {
namespace {

#define DEEPEP_STR2(x) #x
#define DEEPEP_STR(x) DEEPEP_STR2(x)  // expands the versioning macro first: "cuMemAlloc_v2"

// What the first use_driver call gave (written once, while _C is imported).
struct HandOver {
    bool given = false;
    std::string library;
    std::vector<std::uintptr_t> entries;
    std::string unavailable;
};

std::mutex& hand_over_mutex() {
    static std::mutex mu;
    return mu;
}

HandOver& hand_over() {
    static HandOver h;
    return h;
}

struct DriverState {
    DriverApi api;
    bool ok = false;
    std::string reason;
};

DriverState load_driver() {
    DriverState s;
    HandOver h;
    {
        std::lock_guard<std::mutex> lock(hand_over_mutex());
        h = hand_over();
    }
    if (!h.given) {
        s.reason = "no CUDA driver was handed to deepep_portable._C (deepep_portable.transports.system opens it "
                   "when _C is imported)";
        return s;
    }
    if (h.entries.empty()) {
        s.reason = h.unavailable.empty() ? h.library + " unavailable" : h.unavailable;
        return s;
    }
    const std::size_t expected = driver_entry_names().size();
    if (h.entries.size() != expected) {
        s.reason = "the driver hand-over has " + std::to_string(h.entries.size()) + " entry points, " +
                   std::to_string(expected) + " expected";
        return s;
    }
    // The addresses stay valid for the life of the process: the loader never closes the library.
    std::size_t i = 0;
#define DEEPEP_TAKE_REQUIRED(name)                                                             \
    s.api.name = reinterpret_cast<decltype(s.api.name)>(h.entries[i++]);                       \
    if (s.api.name == nullptr) {                                                               \
        s.reason = std::string("symbol ") + DEEPEP_STR(name) + " missing in " + h.library +    \
                   " (driver too old?)";                                                       \
        return s;                                                                              \
    }
#define DEEPEP_TAKE_OPTIONAL(name) s.api.name = reinterpret_cast<decltype(s.api.name)>(h.entries[i++]);
    DEEPEP_DRIVER_REQUIRED(DEEPEP_TAKE_REQUIRED)
    DEEPEP_DRIVER_OPTIONAL(DEEPEP_TAKE_OPTIONAL)
#undef DEEPEP_TAKE_REQUIRED
#undef DEEPEP_TAKE_OPTIONAL

    CUresult r = s.api.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char* name = nullptr;
        const char* text = nullptr;
        s.api.cuGetErrorName(r, &name);
        s.api.cuGetErrorString(r, &text);
        s.reason = std::string("cuInit failed: ") + (name ? name : "CUresult " + std::to_string(r)) +
                   (text ? std::string(" (") + text + ")" : std::string());
        return s;
    }
    int version = 0;
    s.api.cuDriverGetVersion(&version);
    s.ok = true;
    s.reason = "CUDA driver " + std::to_string(version / 1000) + "." +
               std::to_string(version % 1000 / 10) + " (" + h.library + ")";
    return s;
}

const DriverState& state() {
    static const DriverState s = load_driver();  // thread-safe one-time init (C++11)
    return s;
}

}  // namespace

std::vector<std::string> driver_entry_names() {
    std::vector<std::string> names;
#define DEEPEP_NAME(name) names.emplace_back(DEEPEP_STR(name));
    DEEPEP_DRIVER_REQUIRED(DEEPEP_NAME)
    DEEPEP_DRIVER_OPTIONAL(DEEPEP_NAME)
#undef DEEPEP_NAME
    return names;
}

void use_driver(const std::string& library, const std::vector<std::uintptr_t>& entries,
                const std::string& unavailable) noexcept {
    try {
        HandOver given{true, library, entries, unavailable};
        std::lock_guard<std::mutex> lock(hand_over_mutex());
        if (!hand_over().given) hand_over() = std::move(given);
    } catch (...) {  // out of memory copying a few strings: driver_status() then says nothing was handed over
    }
}

std::pair<bool, std::string> driver_status() {
    const DriverState& s = state();
    return {s.ok, s.reason};
}

const DriverApi& driver() {
    const DriverState& s = state();
    if (!s.ok) throw std::runtime_error("CUDA driver unavailable: " + s.reason);
    return s.api;
}

std::string error_text(CUresult result) {
    const DriverState& s = state();
    const char* name = nullptr;
    const char* text = nullptr;
    if (s.api.cuGetErrorName != nullptr) s.api.cuGetErrorName(result, &name);
    if (s.api.cuGetErrorString != nullptr) s.api.cuGetErrorString(result, &text);
    std::string out = name ? name : "CUresult " + std::to_string(static_cast<int>(result));
    if (text != nullptr) out += std::string(" (") + text + ")";
    return out;
}

void check(CUresult result, const char* what) {
    if (result != CUDA_SUCCESS) throw std::runtime_error(std::string(what) + " failed: " + error_text(result));
}

int device_count() {
    int n = 0;
    DEEPEP_CU_CHECK(cuDeviceGetCount, &n);
    return n;
}

CUdevice device_handle(int device) {
    int n = device_count();
    if (device < 0 || device >= n)
        throw std::out_of_range("CUDA device " + std::to_string(device) + " out of range (" +
                                std::to_string(n) + " devices)");
    CUdevice dev = 0;
    DEEPEP_CU_CHECK(cuDeviceGet, &dev, device);
    return dev;
}

int device_attribute(int device, CUdevice_attribute attr) {
    int value = 0;
    DEEPEP_CU_CHECK(cuDeviceGetAttribute, &value, attr, device_handle(device));
    return value;
}

std::string device_name(int device) {
    char buf[256] = {0};
    DEEPEP_CU_CHECK(cuDeviceGetName, buf, static_cast<int>(sizeof(buf) - 1), device_handle(device));
    return buf;
}

CUcontext primary_context(int device) {
    static std::mutex mu;
    static std::vector<CUcontext> contexts;
    std::lock_guard<std::mutex> lock(mu);
    if (device >= 0 && static_cast<std::size_t>(device) < contexts.size() && contexts[device] != nullptr)
        return contexts[device];
    CUdevice dev = device_handle(device);
    CUcontext ctx = nullptr;
    DEEPEP_CU_CHECK(cuDevicePrimaryCtxRetain, &ctx, dev);  // never released: lives with the process
    if (contexts.size() <= static_cast<std::size_t>(device)) contexts.resize(device + 1, nullptr);
    contexts[device] = ctx;
    return ctx;
}

ContextGuard::ContextGuard(int device) {
    CUcontext target = primary_context(device);
    DEEPEP_CU_CHECK(cuCtxGetCurrent, &previous_);
    if (previous_ != target) {
        DEEPEP_CU_CHECK(cuCtxSetCurrent, target);
        switched_ = true;
    }
}

ContextGuard::~ContextGuard() {
    if (switched_) driver().cuCtxSetCurrent(previous_);  // restoring null is fine, too
}

std::uintptr_t mem_alloc(int device, std::size_t bytes) {
    ContextGuard guard(device);
    CUdeviceptr ptr = 0;
    DEEPEP_CU_CHECK(cuMemAlloc, &ptr, bytes);
    return static_cast<std::uintptr_t>(ptr);
}

void mem_free(int device, std::uintptr_t ptr) {
    ContextGuard guard(device);
    DEEPEP_CU_CHECK(cuMemFree, static_cast<CUdeviceptr>(ptr));
}

std::pair<std::uintptr_t, std::uintptr_t> host_alloc_mapped(int device, std::size_t bytes) {
    ContextGuard guard(device);
    void* host = nullptr;
    DEEPEP_CU_CHECK(cuMemHostAlloc, &host, bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
    CUdeviceptr dptr = 0;
    CUresult r = driver().cuMemHostGetDevicePointer(&dptr, host, 0);
    if (r != CUDA_SUCCESS) {
        driver().cuMemFreeHost(host);
        check(r, "cuMemHostGetDevicePointer");
    }
    return {reinterpret_cast<std::uintptr_t>(host), static_cast<std::uintptr_t>(dptr)};
}

void host_free(int device, std::uintptr_t host_ptr) {
    ContextGuard guard(device);
    DEEPEP_CU_CHECK(cuMemFreeHost, reinterpret_cast<void*>(host_ptr));
}

std::pair<std::uintptr_t, std::size_t> mem_get_address_range(int device, std::uintptr_t ptr) {
    ContextGuard guard(device);
    CUdeviceptr base = 0;
    size_t size = 0;
    DEEPEP_CU_CHECK(cuMemGetAddressRange, &base, &size, static_cast<CUdeviceptr>(ptr));
    return {static_cast<std::uintptr_t>(base), size};
}

void memset_d8_async(int device, std::uintptr_t ptr, unsigned char value, std::size_t bytes,
                     std::uintptr_t stream) {
    if (bytes == 0) return;
    ContextGuard guard(device);
    DEEPEP_CU_CHECK(cuMemsetD8Async, static_cast<CUdeviceptr>(ptr), value, bytes,
                    reinterpret_cast<CUstream>(stream));
}

bool stream_query(int device, std::uintptr_t stream) {
    ContextGuard guard(device);
    CUresult r = driver().cuStreamQuery(reinterpret_cast<CUstream>(stream));
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuStreamQuery");
    return true;
}

void stream_synchronize(int device, std::uintptr_t stream) {
    ContextGuard guard(device);
    DEEPEP_CU_CHECK(cuStreamSynchronize, reinterpret_cast<CUstream>(stream));
}

void stream_wait_stream(int device, std::uintptr_t waiter, std::uintptr_t waited) {
    if (waiter == waited) return;
    ContextGuard guard(device);
    // One event per (thread, device), reused: a wait binds to the event's latest record at the time of the wait
    // call, so a later record does not move it; per thread, so two threads cannot interleave record / wait pairs.
    // (Never destroyed: one small event per thread that ever ordered streams.)
    thread_local std::unordered_map<int, CUevent> events;
    CUevent& event = events[device];
    if (event == nullptr) DEEPEP_CU_CHECK(cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
    DEEPEP_CU_CHECK(cuEventRecord, event, reinterpret_cast<CUstream>(waited));
    DEEPEP_CU_CHECK(cuStreamWaitEvent, reinterpret_cast<CUstream>(waiter), event, 0);
}

std::string ipc_get_mem_handle(int device, std::uintptr_t ptr) {
    ContextGuard guard(device);
    CUipcMemHandle handle;
    std::memset(&handle, 0, sizeof(handle));
    DEEPEP_CU_CHECK(cuIpcGetMemHandle, &handle, static_cast<CUdeviceptr>(ptr));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

std::uintptr_t ipc_open_mem_handle(int device, const std::string& bytes) {
    if (bytes.size() != kIpcHandleBytes)
        throw std::invalid_argument("CUDA IPC handle must be " + std::to_string(kIpcHandleBytes) +
                                    " bytes, got " + std::to_string(bytes.size()));
    ContextGuard guard(device);
    CUipcMemHandle handle;
    std::memcpy(&handle, bytes.data(), sizeof(handle));
    CUdeviceptr ptr = 0;
    DEEPEP_CU_CHECK(cuIpcOpenMemHandle, &ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    return static_cast<std::uintptr_t>(ptr);
}

void ipc_close_mem_handle(int device, std::uintptr_t ptr) {
    ContextGuard guard(device);
    DEEPEP_CU_CHECK(cuIpcCloseMemHandle, static_cast<CUdeviceptr>(ptr));
}

namespace {

CUmemAllocationProp shareable_prop(int device) {
    CUmemAllocationProp prop;
    std::memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = static_cast<int>(device_handle(device));
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return prop;
}

std::size_t granularity(const CUmemAllocationProp& prop) {
    std::size_t g = 0;
    DEEPEP_CU_CHECK(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    return g;
}

// Reserve an address range, map `handle` there and give `device` read-write access; on failure
// undo what was done and rethrow. The handle is released by the caller (the mapping keeps the
// memory alive until it is unmapped).
std::uintptr_t map_handle(int device, CUmemGenericAllocationHandle handle, std::size_t size, std::size_t align) {
    CUdeviceptr ptr = 0;
    DEEPEP_CU_CHECK(cuMemAddressReserve, &ptr, size, align, 0, 0);
    CUresult r = driver().cuMemMap(ptr, size, 0, handle, 0);
    if (r != CUDA_SUCCESS) {
        driver().cuMemAddressFree(ptr, size);
        check(r, "cuMemMap");
    }
    CUmemAccessDesc access;
    std::memset(&access, 0, sizeof(access));
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = static_cast<int>(device_handle(device));
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = driver().cuMemSetAccess(ptr, size, &access, 1);
    if (r != CUDA_SUCCESS) {
        driver().cuMemUnmap(ptr, size);
        driver().cuMemAddressFree(ptr, size);
        check(r, "cuMemSetAccess");
    }
    return static_cast<std::uintptr_t>(ptr);
}

}  // namespace

ShareableAlloc vmm_alloc_shareable(int device, std::size_t bytes) {
    ContextGuard guard(device);
    const CUmemAllocationProp prop = shareable_prop(device);
    const std::size_t g = granularity(prop);
    const std::size_t size = (bytes + g - 1) / g * g;
    CUmemGenericAllocationHandle handle = 0;
    DEEPEP_CU_CHECK(cuMemCreate, &handle, size, &prop, 0);
    std::uintptr_t ptr = 0;
    int fd = -1;
    try {
        ptr = map_handle(device, handle, size, g);
        check(driver().cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              "cuMemExportToShareableHandle");
    } catch (...) {
        if (ptr != 0) {
            driver().cuMemUnmap(static_cast<CUdeviceptr>(ptr), size);
            driver().cuMemAddressFree(static_cast<CUdeviceptr>(ptr), size);
        }
        driver().cuMemRelease(handle);
        throw;
    }
    driver().cuMemRelease(handle);
    return ShareableAlloc{ptr, size, fd};
}

std::uintptr_t vmm_import(int device, int fd, std::size_t size) {
    ContextGuard guard(device);
    const std::size_t g = granularity(shareable_prop(device));
    if (size % g != 0)
        throw std::invalid_argument("vmm_import: size " + std::to_string(size) + " is not a multiple of the "
                                    "allocation granularity " + std::to_string(g));
    CUmemGenericAllocationHandle handle = 0;
    DEEPEP_CU_CHECK(cuMemImportFromShareableHandle, &handle,
                    reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    std::uintptr_t ptr = 0;
    try {
        ptr = map_handle(device, handle, size, g);
    } catch (...) {
        driver().cuMemRelease(handle);
        throw;
    }
    driver().cuMemRelease(handle);
    return ptr;
}

void vmm_free(int device, std::uintptr_t ptr, std::size_t size) {
    ContextGuard guard(device);
    DEEPEP_CU_CHECK(cuMemUnmap, static_cast<CUdeviceptr>(ptr), size);
    DEEPEP_CU_CHECK(cuMemAddressFree, static_cast<CUdeviceptr>(ptr), size);
}

}  // namespace deepep_portable
