#include "driver.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace deepep_portable {
namespace {

#define DEEPEP_STR2(x) #x
#define DEEPEP_STR(x) DEEPEP_STR2(x)  // expands the versioning macro first: "cuMemAlloc_v2"

struct DriverState {
    DriverApi api;
    bool ok = false;
    std::string reason;
};

DriverState load_driver() {
    DriverState s;
    // DEEPEP_PORTABLE_LIBCUDA lets a user point at a specific driver library (rarely needed).
    const char* env = std::getenv("DEEPEP_PORTABLE_LIBCUDA");
    const char* path = (env != nullptr && env[0] != '\0') ? env : "libcuda.so.1";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        const char* err = dlerror();
        s.reason = std::string(path) + " not found: " + (err ? err : "unknown dlopen error");
        return s;
    }
    // The library stays open for the life of the process (objects may outlive any owner).
#define DEEPEP_RESOLVE_REQUIRED(name)                                                          \
    s.api.name = reinterpret_cast<decltype(s.api.name)>(dlsym(lib, DEEPEP_STR(name)));         \
    if (s.api.name == nullptr) {                                                               \
        s.reason = std::string("symbol ") + DEEPEP_STR(name) + " missing in " + path +         \
                   " (driver too old?)";                                                       \
        return s;                                                                              \
    }
#define DEEPEP_RESOLVE_OPTIONAL(name) \
    s.api.name = reinterpret_cast<decltype(s.api.name)>(dlsym(lib, DEEPEP_STR(name)));
    DEEPEP_DRIVER_REQUIRED(DEEPEP_RESOLVE_REQUIRED)
    DEEPEP_DRIVER_OPTIONAL(DEEPEP_RESOLVE_OPTIONAL)
#undef DEEPEP_RESOLVE_REQUIRED
#undef DEEPEP_RESOLVE_OPTIONAL

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
               std::to_string(version % 1000 / 10) + " (" + path + ")";
    return s;
}

const DriverState& state() {
    static const DriverState s = load_driver();  // thread-safe one-time init (C++11)
    return s;
}

}  // namespace

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

}  // namespace deepep_portable
