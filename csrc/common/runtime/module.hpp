// Loaded kernel modules and launches.
//
// Kernel convention: every kernel takes exactly one parameter, a plain struct passed by value
// (`__global__ void ns::k(const __grid_constant__ Params p)`, looked up by its symbol). The host packs that struct
// (Python: ctypes.Structure) and hands its bytes to Function::launch, which passes
// kernelParams = {bytes.data()}. When the driver can report the kernel's parameter layout
// (cuFuncGetParamInfo, CUDA >= 12.4) a size mismatch is rejected before launching.
#pragma once

#include "driver.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace deepep_portable {

class ModuleHandle {
public:
    ModuleHandle(const std::string& image, int device);
    ~ModuleHandle();
    ModuleHandle(const ModuleHandle&) = delete;
    ModuleHandle& operator=(const ModuleHandle&) = delete;

    CUmodule module() const { return module_; }
    int device() const { return device_; }

private:
    CUmodule module_ = nullptr;
    int device_ = 0;
};

struct LaunchConfig {
    std::array<unsigned, 3> grid{1, 1, 1};
    std::array<unsigned, 3> block{1, 1, 1};
    unsigned shared_mem = 0;
    std::uintptr_t stream = 0;
    std::array<unsigned, 3> cluster{1, 1, 1};
    bool cooperative = false;
    // Programmatic dependent launch (sm_90+): the kernel may start once every block of the previous
    // kernel in the stream has triggered (griddepcontrol.launch_dependents) or exited; it must execute
    // griddepcontrol.wait before it touches anything that kernel wrote.
    bool programmatic = false;
};

class Function {
public:
    Function(std::shared_ptr<ModuleHandle> module, const std::string& name);

    const std::string& name() const { return name_; }
    int device() const { return module_->device(); }
    // Bytes of the kernel's single parameter, or -1 when the driver cannot tell.
    long param_size() const { return param_size_; }
    // Number of kernel parameters, or -1 when the driver cannot tell.
    int num_params() const { return num_params_; }

    int get_attribute(CUfunction_attribute attr) const;
    void set_attribute(CUfunction_attribute attr, int value);
    void set_max_dynamic_shared_memory(int bytes);
    int max_active_blocks_per_sm(int block_threads, std::size_t dynamic_smem) const;

    // Call without the GIL; `params` are the bytes of the parameter struct (may be empty for a
    // kernel without parameters).
    void launch(const LaunchConfig& cfg, const void* params, std::size_t params_bytes) const;

private:
    std::shared_ptr<ModuleHandle> module_;  // keeps the module loaded while a Function lives
    CUfunction function_ = nullptr;
    std::string name_;
    long param_size_ = -1;
    int num_params_ = -1;
};

}  // namespace deepep_portable
