// The CUDA driver, resolved at run time from the entry points the Python side hands over.
//
// deepep_portable._C never links against libcuda and never opens it: it must import on machines without a GPU (CI),
// one build must serve every driver, and the library has one driver loader, deepep_portable/transports/system.py
// (ctypes). When _C is imported, bindings.cpp asks that loader for the address of every entry point named by
// driver_entry_names() and passes them to use_driver(); cuInit runs at first use. `cuda.h` is included for types and
// prototypes only. Symbol names come from the header's own versioning macros (cuMemAlloc -> cuMemAlloc_v2, ...) and
// the loader looks each one up by that exact name (dlsym), so the prototype we call through always matches the
// symbol resolved.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#if CUDA_VERSION < 12000
#error "deepep_portable needs cuda.h from CUDA 12.0 or newer (cuLaunchKernelEx)"
#endif

namespace deepep_portable {

// Every driver entry point we use. `decltype(&::name)` follows the header's macro, so the type
// is the prototype of the versioned symbol.
#define DEEPEP_DRIVER_REQUIRED(X)                      \
    X(cuInit)                                          \
    X(cuDriverGetVersion)                              \
    X(cuGetErrorName)                                  \
    X(cuGetErrorString)                                \
    X(cuDeviceGet)                                     \
    X(cuDeviceGetCount)                                \
    X(cuDeviceGetName)                                 \
    X(cuDeviceGetAttribute)                            \
    X(cuDevicePrimaryCtxRetain)                        \
    X(cuCtxGetCurrent)                                 \
    X(cuCtxSetCurrent)                                 \
    X(cuModuleLoadData)                                \
    X(cuModuleUnload)                                  \
    X(cuModuleGetFunction)                             \
    X(cuFuncGetAttribute)                              \
    X(cuFuncSetAttribute)                              \
    X(cuLaunchKernelEx)                                \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor)     \
    X(cuMemAlloc)                                      \
    X(cuMemFree)                                       \
    X(cuMemHostAlloc)                                  \
    X(cuMemFreeHost)                                   \
    X(cuMemHostGetDevicePointer)                       \
    X(cuMemGetAddressRange)                            \
    X(cuMemsetD8Async)                                 \
    X(cuIpcGetMemHandle)                               \
    X(cuIpcOpenMemHandle)                              \
    X(cuIpcCloseMemHandle)                             \
    X(cuMemGetAllocationGranularity)                   \
    X(cuMemCreate)                                     \
    X(cuMemRelease)                                    \
    X(cuMemAddressReserve)                             \
    X(cuMemAddressFree)                                \
    X(cuMemMap)                                        \
    X(cuMemUnmap)                                      \
    X(cuMemSetAccess)                                  \
    X(cuMemExportToShareableHandle)                    \
    X(cuMemImportFromShareableHandle)                  \
    X(cuStreamQuery)                                   \
    X(cuStreamSynchronize)                             \
    X(cuEventCreate)                                   \
    X(cuEventRecord)                                   \
    X(cuStreamWaitEvent)

#if CUDA_VERSION >= 12040
#define DEEPEP_DRIVER_OPTIONAL(X) X(cuFuncGetParamInfo)
#else
#define DEEPEP_DRIVER_OPTIONAL(X)
#endif

struct DriverApi {
#define DEEPEP_DECLARE_FN(name) decltype(&::name) name = nullptr;
    DEEPEP_DRIVER_REQUIRED(DEEPEP_DECLARE_FN)
    DEEPEP_DRIVER_OPTIONAL(DEEPEP_DECLARE_FN)  // may stay null on older drivers
#undef DEEPEP_DECLARE_FN
};

// The symbol names of the entry points above, required ones first, in the order use_driver takes their addresses
// (the header's versioned names: "cuMemAlloc_v2", ...).
std::vector<std::string> driver_entry_names();

// Gives _C the driver the Python loader opened: `library` names it (for messages), `entries` holds the address of
// each driver_entry_names() symbol in it (0 where it has none), or is empty and `unavailable` says why there is no
// driver (the Python loader's reason). The first hand-over of the process is kept; later ones are ignored. Resolves
// nothing and calls nothing until driver_status() or driver() is first asked. Never throws.
void use_driver(const std::string& library, const std::vector<std::uintptr_t>& entries,
                const std::string& unavailable) noexcept;

// (ok, reason). Takes the handed-over entry points and calls cuInit(0) once; never throws.
// The reason names what failed: the Python loader's reason when it could not open the driver (e.g.
// "libcuda.so.1 not found (libcuda.so.1: cannot open shared object file: ...)"), a missing symbol, or
// "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)".
std::pair<bool, std::string> driver_status();

// The resolved API; throws std::runtime_error with driver_status()'s reason when unusable.
const DriverApi& driver();

// "CUDA_ERROR_X (text)" for a result code (works before/without a driver, too).
std::string error_text(CUresult result);

// Throws std::runtime_error("<what> failed: CUDA_ERROR_X (text)") unless result is CUDA_SUCCESS.
void check(CUresult result, const char* what);
#define DEEPEP_CU_CHECK(call_name, ...) \
    ::deepep_portable::check(::deepep_portable::driver().call_name(__VA_ARGS__), #call_name)

int device_count();
CUdevice device_handle(int device);
int device_attribute(int device, CUdevice_attribute attr);
std::string device_name(int device);

// The device's primary context (the one the CUDA runtime and torch use), retained once and
// kept for the life of the process.
CUcontext primary_context(int device);

// Makes `device`'s primary context current for the scope and restores whatever was current
// before (the runtime infers its "current device" from the current context, so leaving another
// device's context current would silently move torch to that device).
class ContextGuard {
public:
    explicit ContextGuard(int device);
    ~ContextGuard();
    ContextGuard(const ContextGuard&) = delete;
    ContextGuard& operator=(const ContextGuard&) = delete;

private:
    CUcontext previous_ = nullptr;
    bool switched_ = false;
};

// ---- memory helpers (all take the device whose primary context owns the memory) --------------
std::uintptr_t mem_alloc(int device, std::size_t bytes);
void mem_free(int device, std::uintptr_t ptr);
// Page-locked host memory mapped into the device: returns (host pointer, device pointer).
std::pair<std::uintptr_t, std::uintptr_t> host_alloc_mapped(int device, std::size_t bytes);
void host_free(int device, std::uintptr_t host_ptr);
// (base, size) of the allocation that contains ptr.
std::pair<std::uintptr_t, std::size_t> mem_get_address_range(int device, std::uintptr_t ptr);
void memset_d8_async(int device, std::uintptr_t ptr, unsigned char value, std::size_t bytes,
                     std::uintptr_t stream);
bool stream_query(int device, std::uintptr_t stream);  // true when all work is done
void stream_synchronize(int device, std::uintptr_t stream);
// Makes `waiter` wait for the work enqueued on `waited` so far (torch's Stream.wait_stream without its Python
// objects, which cost microseconds of host time per op); works during CUDA graph capture too.
void stream_wait_stream(int device, std::uintptr_t waiter, std::uintptr_t waited);

// ---- CUDA IPC -------------------------------------------------------------------------------
constexpr std::size_t kIpcHandleBytes = sizeof(CUipcMemHandle);
// Handle of the allocation containing ptr (the handle names the whole cuMemAlloc block).
std::string ipc_get_mem_handle(int device, std::uintptr_t ptr);
// Maps a peer's allocation (LAZY_ENABLE_PEER_ACCESS); returns the base of the mapping.
std::uintptr_t ipc_open_mem_handle(int device, const std::string& handle);
void ipc_close_mem_handle(int device, std::uintptr_t ptr);

// ---- shareable device memory (virtual memory management) ------------------------------------
// An allocation other processes map from a POSIX file descriptor (passed over a Unix socket), as
// NVSHMEM's heap is shared on one node. Unlike a legacy CUDA IPC mapping, a peer's atomics on it
// are as fast as on local memory (measured: the LL dispatch's fetch_add, docs/PERFORMANCE.md).
struct ShareableAlloc {
    std::uintptr_t ptr;   // mapped read-write for the device
    std::size_t size;     // bytes, rounded up to the allocation granularity
    int fd;               // exported POSIX file descriptor (the caller closes it once shared)
};
ShareableAlloc vmm_alloc_shareable(int device, std::size_t bytes);
// Maps a peer's allocation of `size` bytes from the descriptor it exported (not closed here).
std::uintptr_t vmm_import(int device, int fd, std::size_t size);
// Unmaps (and, for the last mapping, frees) an allocation made or imported above.
void vmm_free(int device, std::uintptr_t ptr, std::size_t size);

}  // namespace deepep_portable
