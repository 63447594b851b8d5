#include "module.hpp"

#include <stdexcept>
#include <vector>

namespace deepep_portable {

ModuleHandle::ModuleHandle(const std::string& image, int device) : device_(device) {
    if (image.empty()) throw std::invalid_argument("Module: empty cubin/fatbin image");
    ContextGuard guard(device);
    // cuModuleLoadData accepts a cubin, a fatbin (the driver JIT-compiles embedded PTX when no
    // SASS matches the device) or NUL-terminated PTX; std::string keeps a trailing NUL.
    DEEPEP_CU_CHECK(cuModuleLoadData, &module_, image.c_str());
}

ModuleHandle::~ModuleHandle() {
    if (module_ == nullptr) return;
    try {
        ContextGuard guard(device_);
        driver().cuModuleUnload(module_);  // errors ignored: may run during interpreter teardown
    } catch (...) {
    }
}

Function::Function(std::shared_ptr<ModuleHandle> module, const std::string& name)
    : module_(std::move(module)), name_(name) {
    ContextGuard guard(module_->device());
    CUresult r = driver().cuModuleGetFunction(&function_, module_->module(), name.c_str());
    if (r == CUDA_ERROR_NOT_FOUND)
        throw std::runtime_error("cuModuleGetFunction failed: kernel '" + name +
                                 "' not found in module (the mangled name of ns::kernel(Params)? see jit.kernel_symbol)");
    check(r, "cuModuleGetFunction");
#if CUDA_VERSION >= 12040
    if (driver().cuFuncGetParamInfo != nullptr) {
        size_t offset = 0, size = 0;
        if (driver().cuFuncGetParamInfo(function_, 0, &offset, &size) == CUDA_SUCCESS) {
            int n = 1;
            size_t o = 0, s = 0;
            while (n < 4096 && driver().cuFuncGetParamInfo(function_, n, &o, &s) == CUDA_SUCCESS) ++n;
            num_params_ = n;
            param_size_ = static_cast<long>(size);
        }
        // Otherwise (no parameters, or the driver cannot tell) the layout stays unknown (-1).
    }
#endif
}

int Function::get_attribute(CUfunction_attribute attr) const {
    ContextGuard guard(device());
    int value = 0;
    DEEPEP_CU_CHECK(cuFuncGetAttribute, &value, attr, function_);
    return value;
}

void Function::set_attribute(CUfunction_attribute attr, int value) {
    ContextGuard guard(device());
    DEEPEP_CU_CHECK(cuFuncSetAttribute, function_, attr, value);
}

void Function::set_max_dynamic_shared_memory(int bytes) {
    set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
}

int Function::max_active_blocks_per_sm(int block_threads, std::size_t dynamic_smem) const {
    ContextGuard guard(device());
    int blocks = 0;
    DEEPEP_CU_CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor, &blocks, function_, block_threads,
                    dynamic_smem);
    return blocks;
}

void Function::launch(const LaunchConfig& cfg, const void* params, std::size_t params_bytes) const {
    if (num_params_ > 1)
        throw std::invalid_argument("kernel '" + name_ + "' takes " + std::to_string(num_params_) +
                                    " parameters; the launch convention is one struct parameter");
    if (param_size_ >= 0 && static_cast<std::size_t>(param_size_) != params_bytes)
        throw std::invalid_argument("kernel '" + name_ + "' expects a " + std::to_string(param_size_) +
                                    "-byte parameter struct, got " + std::to_string(params_bytes) +
                                    " bytes (host and device struct layouts differ)");
    for (int i = 0; i < 3; ++i) {
        if (cfg.grid[i] == 0 || cfg.block[i] == 0 || cfg.cluster[i] == 0)
            throw std::invalid_argument("kernel '" + name_ + "': grid, block and cluster dimensions must be >= 1");
    }

    CUlaunchAttribute attrs[3];
    unsigned num_attrs = 0;
    if (cfg.cluster[0] * cfg.cluster[1] * cfg.cluster[2] > 1) {
        attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[num_attrs].value.clusterDim.x = cfg.cluster[0];
        attrs[num_attrs].value.clusterDim.y = cfg.cluster[1];
        attrs[num_attrs].value.clusterDim.z = cfg.cluster[2];
        ++num_attrs;
    }
    if (cfg.cooperative) {
        attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attrs[num_attrs].value.cooperative = 1;
        ++num_attrs;
    }
    if (cfg.programmatic) {
        attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
        ++num_attrs;
    }

    CUlaunchConfig lc{};
    lc.gridDimX = cfg.grid[0];
    lc.gridDimY = cfg.grid[1];
    lc.gridDimZ = cfg.grid[2];
    lc.blockDimX = cfg.block[0];
    lc.blockDimY = cfg.block[1];
    lc.blockDimZ = cfg.block[2];
    lc.sharedMemBytes = cfg.shared_mem;
    lc.hStream = reinterpret_cast<CUstream>(cfg.stream);
    lc.attrs = num_attrs > 0 ? attrs : nullptr;
    lc.numAttrs = num_attrs;

    void* args[1] = {const_cast<void*>(params)};
    ContextGuard guard(device());
    CUresult r = driver().cuLaunchKernelEx(&lc, function_, params_bytes > 0 ? args : nullptr, nullptr);
    if (r != CUDA_SUCCESS)
        throw std::runtime_error("cuLaunchKernelEx failed for kernel '" + name_ + "': " + error_text(r));
}

}  // namespace deepep_portable
