// Host glue of the ibgda backend: the verbs / mlx5 DevX calls that set up RDMA queues whose rings live in GPU
// memory, behind a flat C ABI that Python reaches with ctypes. deepep_portable/transports/ibgda/devx_glue.py
// compiles this file at run time against the system's rdma-core headers and caches the .so in the JIT cache.
//
// Why C: the verbs and mlx5dv structs (ibv_port_attr, ibv_ah_attr, mlx5dv_obj, mlx5dv_devx_umem_in,
// mlx5dv_devx_uar, mlx5_wqe_av, ...) change between rdma-core releases, several entry points are macros or
// static inlines (ibv_query_port, ibv_reg_mr) and some values exist only in the headers. Compiled against the
// installed headers every layout is right; Python sees only opaque handles, integers and bytes. The PRM
// command layouts (CREATE_CQ, CREATE_QP, ...) are Python's bytes, passed through dx_general_cmd / dx_obj_*.
//
// Rules of the ABI:
//   * every function returns 0 or a positive errno-style code (ENODEV, EINVAL, EOPNOTSUPP, ...), and then
//     dx_last_error() returns this thread's message naming the failed call with errno/strerror (or the DevX
//     firmware status/syndrome, or the CUresult). Exception: dx_constant() returns the value, -1 if unknown.
//   * no C++ exception crosses the ABI (nothing here throws; every entry point is noexcept).
//   * every handle (void*) is an opaque pointer owned by the caller, who releases it exactly once with its
//     matching function. Null handles are rejected with EINVAL, never dereferenced.
//   * `access` arguments are ibv_access_flags: Python asks dx_constant("IBV_ACCESS_LOCAL_WRITE"), _REMOTE_WRITE,
//     _REMOTE_READ, _REMOTE_ATOMIC, _RELAXED_ORDERING (all names: dx_constant_names()); no number is copied.
//
// Teardown order the caller must keep (the reverse of creation):
//   1. stop the GPU using the queues; dx_cuda_unmap_io(doorbell) before the UAR it maps is freed;
//   2. dx_obj_destroy: QPs first, then the CQs they name; 3. dx_umem_dereg of the rings and doorbell records
//   those objects used (a UMEM outlives its objects); 4. dx_dereg_mr of the data windows;
//   5. dx_free_uar (after every object naming its page), dx_dealloc_pd (after every MR and object on it);
//   6. dx_close last. GPU memory behind a UMEM or MR is freed only after its deregistration. A dmabuf fd from
//      dx_cuda_dmabuf_fd may be closed once registered (the kernel keeps its own reference to the dmabuf).
//
// CUDA: the driver API is never linked and never opened here: the host hands over the entry points of the driver
// library it opened (dx_use_cuda, before any dx_cuda_* call; devx_glue.py passes those of transports/system.py's
// loader, the Python side's one), so this library loads on machines without a GPU (the CUDA calls then fail with
// the host's message) and the Python side has one driver loader. Values and prototypes are static_assert'ed against
// cuda.h when the compiler finds it ($CUDA_HOME/include); else the fallbacks (CUDA 13.0's values) serve.
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <atomic>
#include <mutex>
#include <type_traits>
#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>

#if __has_include(<cuda.h>)
#include <cuda.h>
#define DX_HAVE_CUDA_H 1
#else
#define DX_HAVE_CUDA_H 0
#endif

#define DX_API extern "C" __attribute__((visibility("default")))

namespace {

// ---- errors -------------------------------------------------------------------------------------------------

thread_local char g_error[1024];

[[maybe_unused]] const char* pick_strerror(int r, const char* buf) { return r == 0 ? buf : "?"; }  // XSI
[[maybe_unused]] const char* pick_strerror(const char* r, const char*) { return r; }                // GNU

// Record the message for dx_last_error() and return `code`; fail_errno appends ": errno N (strerror)".
constexpr int kWithErrno = 1 << 24;
int fail(int code, const char* fmt, ...) noexcept {
    bool add = code & kWithErrno;
    code &= ~kWithErrno;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    char buf[128];
    if (add && n >= 0 && (size_t)n < sizeof g_error)
        snprintf(g_error + n, sizeof g_error - n, ": errno %d (%s)", code,
                 pick_strerror(strerror_r(code, buf, sizeof buf), buf));
    return code;
}
#define fail_errno(code, ...) fail((code) | kWithErrno, __VA_ARGS__)

int saved_errno(int fallback = EIO) noexcept { return errno ? errno : fallback; }

// Verbs calls disagree: some return the errno value, some -1 with errno set, some -errno.
int rc_errno(int r) noexcept { return r > 0 ? r : r == -1 ? saved_errno() : -r; }

#define DX_REQUIRE(cond, call) \
    do { if (!(cond)) return fail(EINVAL, "%s: invalid argument (%s)", call, #cond); } while (0)

// A failed DevX command: the firmware's status and syndrome come back in the output mailbox (bytes 0, 4..7).
int fail_devx(int code, const char* call, const void* in, size_t inlen, const void* out, size_t outlen) noexcept {
    const uint8_t* i = (const uint8_t*)in;
    const uint8_t* o = (const uint8_t*)out;
    unsigned opcode = inlen >= 2 ? (unsigned)i[0] << 8 | i[1] : 0;
    if (outlen >= 8 && o[0] != 0) {
        uint32_t synd = (uint32_t)o[4] << 24 | (uint32_t)o[5] << 16 | (uint32_t)o[6] << 8 | o[7];
        return fail_errno(code, "%s(opcode 0x%x): firmware status 0x%x syndrome 0x%08x", call, opcode, o[0], synd);
    }
    return fail_errno(code, "%s(opcode 0x%x) failed", call, opcode);
}

// ---- CUDA driver API, handed over by the host ------------------------------------------------------------------

// The values used, from CUDA 13.0's cuda.h (checked against the cuda.h found, if any, just below).
constexpr int kCuSuccess = 0, kCuInvalidValue = 1, kCuOutOfMemory = 2, kCuNotInitialized = 3, kCuNoDevice = 100,
              kCuInvalidContext = 201, kCuAlreadyRegistered = 712, kCuNotSupported = 801, kCuDmaBufFd = 1;
constexpr unsigned kCuHostRegPortable = 0x01, kCuHostRegDeviceMap = 0x02, kCuHostRegIoMemory = 0x04;
// Exported names: cuda.h #defines cuMemHostRegister and cuMemHostGetDevicePointer to their _v2 symbols.
#define DX_SYM_HOST_REGISTER "cuMemHostRegister_v2"
#define DX_SYM_HOST_DEVICE_POINTER "cuMemHostGetDevicePointer_v2"

#if DX_HAVE_CUDA_H
using CuRes = CUresult; using CuCtx = CUcontext; using CuPtr = CUdeviceptr; using CuRange = CUmemRangeHandleType;
#else
using CuRes = int; using CuCtx = void*; using CuPtr = unsigned long long; using CuRange = int;
#endif

struct CudaApi {
    int code = 0;   // 0: usable; else the errno-style code every CUDA call returns, with `error`
    char error[512] = {0};
    CuRes (*init)(unsigned int) = nullptr;
    CuRes (*ctx_get_current)(CuCtx*) = nullptr;
    CuRes (*error_string)(CuRes, const char**) = nullptr;
    CuRes (*error_name)(CuRes, const char**) = nullptr;
    CuRes (*get_handle)(void*, CuPtr, size_t, CuRange, unsigned long long) = nullptr;
    CuRes (*host_register)(void*, size_t, unsigned int) = nullptr;
    CuRes (*host_device_pointer)(CuPtr*, void*, unsigned int) = nullptr;
    CuRes (*host_unregister)(void*) = nullptr;
};

#if DX_HAVE_CUDA_H
constexpr bool same_str(const char* a, const char* b) { return *a == *b && (*a == 0 || same_str(a + 1, b + 1)); }
#define DX_STR2(x) #x
#define DX_STR(x) DX_STR2(x)
#define DX_SAME(field, fn) std::is_same<decltype(CudaApi::field), decltype(&fn)>::value
static_assert(CUDA_SUCCESS == kCuSuccess && CUDA_ERROR_INVALID_VALUE == kCuInvalidValue &&
              CUDA_ERROR_OUT_OF_MEMORY == kCuOutOfMemory && CUDA_ERROR_NOT_INITIALIZED == kCuNotInitialized &&
              CUDA_ERROR_NO_DEVICE == kCuNoDevice && CUDA_ERROR_INVALID_CONTEXT == kCuInvalidContext &&
              CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED == kCuAlreadyRegistered &&
              CUDA_ERROR_NOT_SUPPORTED == kCuNotSupported && CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD == kCuDmaBufFd &&
              CU_MEMHOSTREGISTER_PORTABLE == kCuHostRegPortable && CU_MEMHOSTREGISTER_DEVICEMAP ==
              kCuHostRegDeviceMap && CU_MEMHOSTREGISTER_IOMEMORY == kCuHostRegIoMemory, "values differ from cuda.h");
static_assert(same_str(DX_STR(cuMemHostRegister), DX_SYM_HOST_REGISTER) &&
              same_str(DX_STR(cuMemHostGetDevicePointer), DX_SYM_HOST_DEVICE_POINTER), "symbols differ from cuda.h");
static_assert(DX_SAME(init, cuInit) && DX_SAME(ctx_get_current, cuCtxGetCurrent) &&
              DX_SAME(error_string, cuGetErrorString) && DX_SAME(error_name, cuGetErrorName) &&
              DX_SAME(get_handle, cuMemGetHandleForAddressRange) && DX_SAME(host_register, cuMemHostRegister) &&
              DX_SAME(host_device_pointer, cuMemHostGetDevicePointer) && DX_SAME(host_unregister, cuMemHostUnregister),
              "prototypes differ from cuda.h");
#endif

int cu_errno(int r) noexcept {
    return r == kCuInvalidValue ? EINVAL : r == kCuOutOfMemory ? ENOMEM : r == kCuAlreadyRegistered ? EEXIST
         : r == kCuNotSupported ? EOPNOTSUPP : r == kCuNotInitialized || r == kCuNoDevice || r == kCuInvalidContext
         ? ENODEV : EIO;
}

void describe_cu(const CudaApi& api, int r, char* buf, size_t len) noexcept {
    const char *name = nullptr, *text = nullptr;
    if (api.error_name) api.error_name((CuRes)r, &name);
    if (api.error_string) api.error_string((CuRes)r, &text);
    snprintf(buf, len, "CUresult %d %s (%s)", r, name ? name : "?", text ? text : "?");
}

// The entry points dx_use_cuda takes, in this order (the host looks each name up in the driver it opened).
#define DX_CUDA_ENTRIES "cuInit,cuCtxGetCurrent,cuGetErrorString,cuGetErrorName,cuMemGetHandleForAddressRange," \
                        DX_SYM_HOST_REGISTER "," DX_SYM_HOST_DEVICE_POINTER ",cuMemHostUnregister"
constexpr int kNumCudaEntries = 8;

// What the first dx_use_cuda handed over, read once g_cuda_handed says so.
char g_cuda_unavailable[512];
uint64_t g_cuda_entries[kNumCudaEntries];
std::once_flag g_cuda_once;
std::atomic<bool> g_cuda_handed{false};

// The driver's entry points from the host (addresses, DX_CUDA_ENTRIES' order), or why it has none (`unavailable`).
CudaApi use_cuda(const char* unavailable, const uint64_t* entries) noexcept {
    CudaApi api;
    if (unavailable) {
        snprintf(api.error, sizeof api.error, "%s", unavailable);
        return api.code = ELIBACC, api;
    }
#define DX_TAKE(field, i) api.field = (decltype(api.field))(uintptr_t)entries[i]
    DX_TAKE(init, 0), DX_TAKE(ctx_get_current, 1), DX_TAKE(error_string, 2), DX_TAKE(error_name, 3);
    DX_TAKE(get_handle, 4), DX_TAKE(host_register, 5), DX_TAKE(host_device_pointer, 6), DX_TAKE(host_unregister, 7);
#undef DX_TAKE
    if (!api.init || !api.ctx_get_current) {
        snprintf(api.error, sizeof api.error, "the CUDA driver lacks cuInit/cuCtxGetCurrent");
        return api.code = ENOSYS, api;
    }
    if (int r = (int)api.init(0)) {
        int n = snprintf(api.error, sizeof api.error, "cuInit(0) failed: ");
        describe_cu(api, r, api.error + n, sizeof api.error - n);
        api.code = cu_errno(r);
    }
    return api;
}

const CudaApi& cuda() noexcept {
    static const CudaApi none = [] {
        CudaApi api;
        snprintf(api.error, sizeof api.error, "the host handed over no CUDA driver (dx_use_cuda not called)");
        return api.code = ELIBACC, api;
    }();
    if (!g_cuda_handed.load(std::memory_order_acquire)) return none;
    // cuInit on the first CUDA call, not at the hand-over (a probe that loads the glue initialises no driver).
    static const CudaApi api = use_cuda(g_cuda_unavailable[0] ? g_cuda_unavailable : nullptr, g_cuda_entries);
    return api;
}

// 0 when the driver API is usable, the entry points exist and a context is current on this thread; else why.
int cuda_ready(const char* call, bool have, const char* symbol) noexcept {
    const CudaApi& api = cuda();
    if (api.code) return fail(api.code, "%s: %s", call, api.error);
    if (!have) return fail(ENOSYS, "%s: the CUDA driver has no %s (too old)", call, symbol);
    CuCtx ctx = nullptr;
    if (api.ctx_get_current(&ctx) != kCuSuccess || !ctx)
        return fail(ENODEV, "%s: no current CUDA context on this thread (make the device current first, e.g. "
                    "torch.cuda.set_device and one CUDA call)", call);
    return 0;
}

// Append CUresult `r` to the message; its errno-style code. fail_cu(r, fmt, ...) records both.
int with_cu(int r) noexcept {
    size_t n = strlen(g_error);
    describe_cu(cuda(), r, g_error + n, sizeof g_error - n);
    return cu_errno(r);
}
#define fail_cu(r, ...) (fail(0, __VA_ARGS__), with_cu(r))

// ---- constants and handles ----------------------------------------------------------------------------------

#ifdef MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED
#define DX_IF_NC(X) X(MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED)
#else
#define DX_IF_NC(X)
#endif
#define DX_CONSTANTS(X)                                                                                       \
    X(IBV_ACCESS_LOCAL_WRITE) X(IBV_ACCESS_REMOTE_WRITE) X(IBV_ACCESS_REMOTE_READ) X(IBV_ACCESS_REMOTE_ATOMIC) \
    X(IBV_ACCESS_RELAXED_ORDERING) X(IBV_LINK_LAYER_UNSPECIFIED) X(IBV_LINK_LAYER_INFINIBAND)                 \
    X(IBV_LINK_LAYER_ETHERNET) X(IBV_PORT_DOWN) X(IBV_PORT_INIT) X(IBV_PORT_ARMED) X(IBV_PORT_ACTIVE)         \
    X(IBV_MTU_256) X(IBV_MTU_4096) X(MLX5DV_CONTEXT_FLAGS_DEVX) X(MLX5DV_UMEM_MASK_DMABUF)                    \
    X(MLX5DV_UAR_ALLOC_TYPE_BF) DX_IF_NC(X)
#define DX_ENTRY(x) {#x, (long long)(x)},
#define DX_NAME(x) #x ","
struct Constant { const char* name; long long value; };
const Constant kConstants[] = {DX_CONSTANTS(DX_ENTRY)};

// A UAR and the type it was allocated with (dedicated NC when the header and the device have it, else BF).
struct DxUar { mlx5dv_devx_uar* uar; uint32_t type; };

}  // namespace

// ---- the ABI ------------------------------------------------------------------------------------------------

DX_API const char* dx_last_error(void) noexcept { return g_error; }

DX_API int dx_constant(const char* name) noexcept {
    for (const Constant& c : kConstants)
        if (name && strcmp(c.name, name) == 0) return (int)c.value;
    fail(ENOENT, "dx_constant: unknown name '%s' (see dx_constant_names())", name ? name : "(null)");
    return -1;
}

// Extra export: the names dx_constant knows, each followed by a comma.
DX_API const char* dx_constant_names(void) noexcept { return DX_CONSTANTS(DX_NAME); }

DX_API int dx_open(const char* dev_name, void** ctx) noexcept {
    DX_REQUIRE(dev_name && ctx, "dx_open");
    *ctx = nullptr;
    int num = 0;
    errno = 0;
    ibv_device** list = ibv_get_device_list(&num);   // NULL (errno set) when the kernel has no RDMA support
    char seen[256] = "no RDMA devices found";
    if (!list) snprintf(seen, sizeof seen, "no RDMA devices found: ibv_get_device_list errno %d", saved_errno(0));
    ibv_device* dev = nullptr;
    for (int i = 0, n = 0; list && i < num && list[i]; ++i) {
        const char* name = ibv_get_device_name(list[i]);
        if (name && strcmp(name, dev_name) == 0) dev = list[i];
        if (n < (int)sizeof seen) n += snprintf(seen + n, sizeof seen - n, "%s%s", n ? ", " : "RDMA devices: ", name);
    }
    if (!dev || !mlx5dv_is_supported(dev)) {
        if (list) ibv_free_device_list(list);
        if (dev) return fail(EOPNOTSUPP, "dx_open: RDMA device '%s' is not an mlx5 device (DevX needs mlx5)", dev_name);
        return fail(ENODEV, "dx_open: RDMA device '%s' not found (%s)", dev_name, seen);
    }
    mlx5dv_context_attr attr{};
    attr.flags = MLX5DV_CONTEXT_FLAGS_DEVX;
    ibv_context* c = mlx5dv_open_device(dev, &attr);
    int e = saved_errno();
    ibv_free_device_list(list);   // an open context keeps its device
    if (!c)
        return fail_errno(e, "dx_open: mlx5dv_open_device(%s, MLX5DV_CONTEXT_FLAGS_DEVX) failed (no DevX in this "
                          "device/firmware/kernel, or no access to /dev/infiniband)", dev_name);
    return *ctx = c, 0;
}

// The release functions: 0, or the errno of the failed call (`hint`: its likely cause).
#define DX_RELEASE(fn, type, call, hint)                                                    \
    DX_API int fn(void* h) noexcept {                                                       \
        DX_REQUIRE(h, #fn);                                                                 \
        int r = call((type*)h);                                                             \
        return r ? fail_errno(rc_errno(r), #fn ": " #call " failed" hint) : 0;              \
    }
DX_RELEASE(dx_close, ibv_context, ibv_close_device, "")
DX_RELEASE(dx_dealloc_pd, ibv_pd, ibv_dealloc_pd, " (MRs or objects still on it?)")
DX_RELEASE(dx_umem_dereg, mlx5dv_devx_umem, mlx5dv_devx_umem_dereg, " (an object still uses it?)")
DX_RELEASE(dx_obj_destroy, mlx5dv_devx_obj, mlx5dv_devx_obj_destroy, "")
DX_RELEASE(dx_dereg_mr, ibv_mr, ibv_dereg_mr, "")

DX_API int dx_query_port(void* ctx, int port, int* state, int* link_layer, int* active_mtu_bytes, int* lid,
                         int* gid_tbl_len, int* max_qp_rd_atom_dev) noexcept {
    DX_REQUIRE(ctx && port > 0 && port < 256, "dx_query_port");
    ibv_port_attr pa{};
    int r = ibv_query_port((ibv_context*)ctx, (uint8_t)port, &pa);
    if (r) return fail_errno(rc_errno(r), "dx_query_port: ibv_query_port(port %d) failed", port);
    ibv_device_attr da{};
    r = ibv_query_device((ibv_context*)ctx, &da);
    if (r) return fail_errno(rc_errno(r), "dx_query_port: ibv_query_device failed");
    int* outs[] = {state, link_layer, active_mtu_bytes, lid, gid_tbl_len, max_qp_rd_atom_dev};
    int values[] = {(int)pa.state, (int)pa.link_layer, pa.active_mtu >= IBV_MTU_256 ? 128 << (int)pa.active_mtu : 0,
                    (int)pa.lid, pa.gid_tbl_len, da.max_qp_rd_atom};
    for (int i = 0; i < 6; ++i)
        if (outs[i]) *outs[i] = values[i];
    return 0;
}

DX_API int dx_query_gid(void* ctx, int port, int index, uint8_t gid[16]) noexcept {
    DX_REQUIRE(ctx && gid && port > 0 && port < 256 && index >= 0, "dx_query_gid");
    ibv_gid g{};
    if (int r = ibv_query_gid((ibv_context*)ctx, (uint8_t)port, index, &g))
        return fail_errno(rc_errno(r), "dx_query_gid: ibv_query_gid(port %d, index %d) failed", port, index);
    return memcpy(gid, g.raw, 16), 0;
}

DX_API int dx_general_cmd(void* ctx, const void* in, size_t inlen, void* out, size_t outlen) noexcept {
    DX_REQUIRE(ctx && in && out && inlen && outlen, "dx_general_cmd");
    memset(out, 0, outlen);
    int r = mlx5dv_devx_general_cmd((ibv_context*)ctx, in, inlen, out, outlen);
    return r ? fail_devx(rc_errno(r), "dx_general_cmd: mlx5dv_devx_general_cmd", in, inlen, out, outlen) : 0;
}

DX_API int dx_alloc_pd(void* ctx, void** pd, uint32_t* pdn) noexcept {
    DX_REQUIRE(ctx && pd && pdn, "dx_alloc_pd");
    *pd = nullptr;
    ibv_pd* p = ibv_alloc_pd((ibv_context*)ctx);
    if (!p) return fail_errno(saved_errno(), "dx_alloc_pd: ibv_alloc_pd failed");
    mlx5dv_pd dv{};
    mlx5dv_obj obj{};
    obj.pd.in = p, obj.pd.out = &dv;
    if (int r = mlx5dv_init_obj(&obj, MLX5DV_OBJ_PD)) {
        int e = rc_errno(r);
        ibv_dealloc_pd(p);
        return fail_errno(e, "dx_alloc_pd: mlx5dv_init_obj(MLX5DV_OBJ_PD) failed");
    }
    return *pd = p, *pdn = dv.pdn, 0;
}

DX_API int dx_query_eqn(void* ctx, uint32_t vector, uint32_t* eqn) noexcept {
    DX_REQUIRE(ctx && eqn, "dx_query_eqn");
    int r = mlx5dv_devx_query_eqn((ibv_context*)ctx, vector, eqn);
    return r ? fail_errno(rc_errno(r), "dx_query_eqn: mlx5dv_devx_query_eqn(vector %u) failed", vector) : 0;
}

DX_API int dx_alloc_uar(void* ctx, void** uar, uint32_t* page_id, uint64_t* reg_addr) noexcept {
    DX_REQUIRE(ctx && uar && page_id && reg_addr, "dx_alloc_uar");
    *uar = nullptr;
    DxUar* h = (DxUar*)calloc(1, sizeof(DxUar));
    if (!h) return fail_errno(ENOMEM, "dx_alloc_uar: calloc failed");
    // Every call must give a doorbell register of its own: the GPU rings several queues from the lanes of one
    // warp at once, and one store instruction to one address from several lanes need not reach it once per lane.
    // Plain NC is the context's singleton (one register for every caller), so never that: a dedicated NC UAR
    // where the header has it (rdma-core >= 45), else a BlueFlame register, dedicated per call (NVSHMEM's order).
    int nc_errno = 0;
#ifdef MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED
    h->uar = mlx5dv_devx_alloc_uar((ibv_context*)ctx, h->type = MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED);
    if (!h->uar) nc_errno = saved_errno();
#endif
    if (!h->uar)
        h->uar = mlx5dv_devx_alloc_uar((ibv_context*)ctx, h->type = MLX5DV_UAR_ALLOC_TYPE_BF);
    if (!h->uar) {
        int e = saved_errno();
        free(h);
        return fail_errno(e, "dx_alloc_uar: mlx5dv_devx_alloc_uar failed (dedicated NC: errno %d; BF)", nc_errno);
    }
    return *uar = h, *page_id = h->uar->page_id, *reg_addr = (uint64_t)(uintptr_t)h->uar->reg_addr, 0;
}

// Extra export: the type dx_alloc_uar got (MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED or _BF) and the page's mapping.
DX_API int dx_uar_info(void* uar, uint32_t* alloc_type, uint64_t* base_addr) noexcept {
    DX_REQUIRE(uar, "dx_uar_info");
    const DxUar* h = (const DxUar*)uar;
    if (alloc_type) *alloc_type = h->type;
    if (base_addr) *base_addr = (uint64_t)(uintptr_t)h->uar->base_addr;
    return 0;
}

DX_API int dx_free_uar(void* uar) noexcept {
    DX_REQUIRE(uar, "dx_free_uar");
    mlx5dv_devx_free_uar(((DxUar*)uar)->uar);   // returns nothing
    free(uar);
    return 0;
}

DX_API int dx_umem_reg(void* ctx, uint64_t addr, size_t size, int dmabuf_fd, uint32_t access, void** umem,
                       uint32_t* umem_id) noexcept {
    DX_REQUIRE(ctx && size && umem && umem_id, "dx_umem_reg");
    *umem = nullptr;
    mlx5dv_devx_umem* u;
    if (dmabuf_fd >= 0) {
        mlx5dv_devx_umem_in in{};
        in.addr = (void*)(uintptr_t)addr;   // the offset inside the dmabuf
        in.size = size, in.access = access, in.dmabuf_fd = dmabuf_fd, in.comp_mask = MLX5DV_UMEM_MASK_DMABUF;
        // 4 KiB pages only: objects sit at 4 KiB offsets in the UMEM and are created with log_page_size 0.
        in.pgsz_bitmap = 4096;
        if (!(u = mlx5dv_devx_umem_reg_ex((ibv_context*)ctx, &in)))
            return fail_errno(saved_errno(), "dx_umem_reg: mlx5dv_devx_umem_reg_ex(dmabuf fd %d, offset 0x%llx, "
                              "size %zu, access 0x%x) failed", dmabuf_fd, (unsigned long long)addr, size, access);
    } else if (!(u = mlx5dv_devx_umem_reg((ibv_context*)ctx, (void*)(uintptr_t)addr, size, access))) {
        return fail_errno(saved_errno(), "dx_umem_reg: mlx5dv_devx_umem_reg(addr 0x%llx, size %zu, access 0x%x) failed "
                          "(GPU memory by address needs nvidia-peermem)", (unsigned long long)addr, size, access);
    }
    return *umem = u, *umem_id = u->umem_id, 0;
}

DX_API int dx_obj_create(void* ctx, const void* in, size_t inlen, void* out, size_t outlen, void** obj) noexcept {
    DX_REQUIRE(ctx && in && out && inlen && outlen && obj, "dx_obj_create");
    *obj = nullptr;
    memset(out, 0, outlen);
    if ((*obj = mlx5dv_devx_obj_create((ibv_context*)ctx, in, inlen, out, outlen))) return 0;
    return fail_devx(saved_errno(), "dx_obj_create: mlx5dv_devx_obj_create", in, inlen, out, outlen);
}

DX_API int dx_obj_modify(void* obj, const void* in, size_t inlen, void* out, size_t outlen) noexcept {
    DX_REQUIRE(obj && in && out && inlen && outlen, "dx_obj_modify");
    memset(out, 0, outlen);
    int r = mlx5dv_devx_obj_modify((mlx5dv_devx_obj*)obj, in, inlen, out, outlen);
    return r ? fail_devx(rc_errno(r), "dx_obj_modify: mlx5dv_devx_obj_modify", in, inlen, out, outlen) : 0;
}

DX_API int dx_reg_mr(void* pd, uint64_t addr, size_t len, int dmabuf_fd, uint64_t dmabuf_offset, uint32_t access,
                     void** mr, uint32_t* lkey, uint32_t* rkey) noexcept {
    DX_REQUIRE(pd && len && mr && lkey && rkey, "dx_reg_mr");
    *mr = nullptr;
    ibv_mr* m;
    if (dmabuf_fd >= 0) {
        if (!(m = ibv_reg_dmabuf_mr((ibv_pd*)pd, dmabuf_offset, len, addr, dmabuf_fd, (int)access)))
            return fail_errno(saved_errno(), "dx_reg_mr: ibv_reg_dmabuf_mr(fd %d, offset 0x%llx, len %zu, iova 0x%llx, "
                              "access 0x%x) failed", dmabuf_fd, (unsigned long long)dmabuf_offset, len,
                              (unsigned long long)addr, access);
    } else if (!(m = ibv_reg_mr((ibv_pd*)pd, (void*)(uintptr_t)addr, len, (int)access))) {
        return fail_errno(saved_errno(), "dx_reg_mr: ibv_reg_mr(addr 0x%llx, len %zu, access 0x%x) failed (GPU memory "
                          "by address needs nvidia-peermem)", (unsigned long long)addr, len, access);
    }
    return *mr = m, *lkey = m->lkey, *rkey = m->rkey, 0;
}

DX_API int dx_resolve_rmac(void* pd, int port, int gid_index, const uint8_t dgid[16], int hop_limit,
                           uint8_t mac[6]) noexcept {
    DX_REQUIRE(pd && dgid && mac && port > 0 && port < 256 && gid_index >= 0 && gid_index < 256 &&
               hop_limit >= 0 && hop_limit < 256, "dx_resolve_rmac");
    ibv_ah_attr attr{};
    attr.is_global = 1, attr.port_num = (uint8_t)port;
    attr.grh.sgid_index = (uint8_t)gid_index, attr.grh.hop_limit = (uint8_t)hop_limit;
    memcpy(attr.grh.dgid.raw, dgid, 16);
    ibv_ah* ah = ibv_create_ah((ibv_pd*)pd, &attr);
    if (!ah)
        return fail_errno(saved_errno(), "dx_resolve_rmac: ibv_create_ah(port %d, sgid index %d) failed (peer GID "
                          "unreachable from this port?)", port, gid_index);
    mlx5dv_ah dv{};
    mlx5dv_obj obj{};
    obj.ah.in = ah, obj.ah.out = &dv;
    int r = mlx5dv_init_obj(&obj, MLX5DV_OBJ_AH);
    int e = r ? rc_errno(r) : 0;
    if (!r && dv.av) memcpy(mac, dv.av->rmac, 6);
    ibv_destroy_ah(ah);
    if (r) return fail_errno(e, "dx_resolve_rmac: mlx5dv_init_obj(MLX5DV_OBJ_AH) failed");
    return dv.av ? 0 : fail(EIO, "dx_resolve_rmac: mlx5dv_init_obj(MLX5DV_OBJ_AH) gave no address vector");
}

DX_API const char* dx_cuda_entry_names(void) noexcept { return DX_CUDA_ENTRIES; }

// The CUDA driver's entry points (`count` addresses in dx_cuda_entry_names' order; 0 for one the driver lacks), or
// `unavailable`: why the host has no driver (the dx_cuda_* calls then fail with it). The first call counts; later
// ones change nothing. EINVAL for a count other than the names'.
DX_API int dx_use_cuda(const char* unavailable, const uint64_t* entries, int count) noexcept {
    if (!unavailable && (!entries || count != kNumCudaEntries))
        return fail(EINVAL, "dx_use_cuda: %d entry points, %d expected (" DX_CUDA_ENTRIES ")", count, kNumCudaEntries);
    std::call_once(g_cuda_once, [&] {
        if (unavailable)
            snprintf(g_cuda_unavailable, sizeof g_cuda_unavailable, "%s", unavailable[0] ? unavailable : "?");
        else
            memcpy(g_cuda_entries, entries, sizeof g_cuda_entries);
        g_cuda_handed.store(true, std::memory_order_release);
    });
    return 0;
}

DX_API int dx_cuda_dmabuf_fd(uint64_t dptr, size_t size, int* fd) noexcept {
    DX_REQUIRE(fd && size, "dx_cuda_dmabuf_fd");
    *fd = -1;
    const CudaApi& api = cuda();
    if (int e = cuda_ready("dx_cuda_dmabuf_fd", api.get_handle, "cuMemGetHandleForAddressRange")) return e;
    int h = -1;
    int r = (int)api.get_handle(&h, (CuPtr)dptr, size, (CuRange)kCuDmaBufFd, 0);
    if (r == kCuSuccess) return *fd = h, 0;
    return fail_cu(r, "dx_cuda_dmabuf_fd: cuMemGetHandleForAddressRange(0x%llx, %zu, DMA_BUF_FD) failed: ",
                   (unsigned long long)dptr, size);
}

DX_API int dx_cuda_map_io(uint64_t host_addr, size_t size, uint64_t* dev_ptr) noexcept {
    DX_REQUIRE(host_addr && size && dev_ptr, "dx_cuda_map_io");
    *dev_ptr = 0;
    const CudaApi& api = cuda();
    bool have = api.host_register && api.host_device_pointer && api.host_unregister;
    if (int e = cuda_ready("dx_cuda_map_io", have, DX_SYM_HOST_REGISTER "/" DX_SYM_HOST_DEVICE_POINTER)) return e;
    void* p = (void*)(uintptr_t)host_addr;
    int r = (int)api.host_register(p, size, kCuHostRegPortable | kCuHostRegDeviceMap | kCuHostRegIoMemory);
    if (r != kCuSuccess)
        return fail_cu(r, "dx_cuda_map_io: cuMemHostRegister(0x%llx, %zu, PORTABLE|DEVICEMAP|IOMEMORY) failed: ",
                       (unsigned long long)host_addr, size);
    CuPtr d = 0;
    if ((r = (int)api.host_device_pointer(&d, p, 0)) != kCuSuccess) {
        api.host_unregister(p);
        return fail_cu(r, "dx_cuda_map_io: cuMemHostGetDevicePointer(0x%llx) failed: ", (unsigned long long)host_addr);
    }
    return *dev_ptr = (uint64_t)d, 0;
}

DX_API int dx_cuda_unmap_io(uint64_t host_addr) noexcept {
    DX_REQUIRE(host_addr, "dx_cuda_unmap_io");
    const CudaApi& api = cuda();
    if (int e = cuda_ready("dx_cuda_unmap_io", api.host_unregister, "cuMemHostUnregister")) return e;
    int r = (int)api.host_unregister((void*)(uintptr_t)host_addr);
    return r != kCuSuccess ? fail_cu(r, "dx_cuda_unmap_io: cuMemHostUnregister(0x%llx) failed: ",
                                     (unsigned long long)host_addr) : 0;
}
