// deepep_portable._C: the host runtime module (pybind11, no libtorch).
//
// Pointers and streams cross the boundary as Python ints (torch: tensor.data_ptr(),
// stream.cuda_stream). Every call that touches the driver makes the device's primary context
// current for its duration and restores the previous one. Driver failures raise RuntimeError
// "<cuFunction> failed: CUDA_ERROR_X (text)"; bad arguments raise ValueError / IndexError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "driver.hpp"
#include "module.hpp"

namespace py = pybind11;
using namespace deepep_portable;

namespace {

using Dim3 = std::array<unsigned, 3>;

Dim3 to_dim3(const py::object& obj, const char* what) {
    Dim3 d{1, 1, 1};
    if (py::isinstance<py::int_>(obj)) {
        long v = obj.cast<long>();
        if (v < 1 || v > 0xFFFFFFFFL) throw py::value_error(std::string(what) + " must be >= 1");
        d[0] = static_cast<unsigned>(v);
        return d;
    }
    auto seq = obj.cast<py::sequence>();
    if (seq.size() < 1 || seq.size() > 3)
        throw py::value_error(std::string(what) + " must be an int or a tuple of 1..3 ints");
    for (size_t i = 0; i < seq.size(); ++i) {
        long v = seq[i].cast<long>();
        if (v < 1 || v > 0xFFFFFFFFL) throw py::value_error(std::string(what) + " entries must be >= 1");
        d[i] = static_cast<unsigned>(v);
    }
    return d;
}

py::dict device_info(int device) {
    py::dict info;
    auto attr = [&](CUdevice_attribute a) { return device_attribute(device, a); };
    info["name"] = device_name(device);
    info["cc_major"] = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    info["cc_minor"] = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    info["sm_count"] = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    info["max_smem_per_block_optin"] = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    info["max_smem_per_sm"] = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    info["max_threads_per_sm"] = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
    info["warp_size"] = attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE);
    info["l2_bytes"] = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
    info["cooperative_launch"] = attr(CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH) != 0;
    info["unified_addressing"] = attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) != 0;
    info["can_map_host_memory"] = attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) != 0;
    info["pci_bus_id"] = attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
    info["pci_device_id"] = attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID);
    info["pci_domain_id"] = attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID);
    return info;
}

// _C never opens the CUDA driver: deepep_portable.transports.system, the library's one loader, opens it and
// answers driver_entry_points(names) with (library, the address of each named symbol, "") or (library, None, why
// not). Runs while _C is imported, before any function here can be called; a loader that fails or cannot be
// imported leaves its reason as driver_status()'s.
const std::string kLoaderFailed = "the CUDA driver loader (deepep_portable.transports.system) failed: ";

void take_driver_from_python_loader() {
    std::string library = "the CUDA driver";
    try {
        py::tuple got = py::module_::import("deepep_portable.transports.system")
                            .attr("driver_entry_points")(driver_entry_names());
        library = got[0].cast<std::string>();
        if (got[1].is_none()) {
            use_driver(library, {}, got[2].cast<std::string>());
        } else {
            use_driver(library, got[1].cast<std::vector<std::uintptr_t>>(), "");
        }
    } catch (py::error_already_set& e) {  // "Type: message", without what()'s traceback
        std::string why;
        try {
            why = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                  py::str(e.value()).cast<std::string>();
        } catch (const std::exception&) {
            why = e.what();
        }
        use_driver(library, {}, kLoaderFailed + why);
    } catch (const std::exception& e) {  // py::cast_error: an answer of the wrong shape
        use_driver(library, {}, kLoaderFailed + e.what());
    }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "deepep_portable host runtime: CUDA driver (entry points from deepep_portable.transports.system), "
              "modules, launches, IPC";
    take_driver_from_python_loader();

    // ---- driver and devices ---------------------------------------------------------------
    m.def("driver_status", &driver_status,
          "(ok, reason): whether the CUDA driver deepep_portable.transports.system opened (DEEPEP_PORTABLE_LIBCUDA,\n"
          "else libcuda.so.1) has every entry point _C needs and cuInit succeeds; else the loader's reason. Never\n"
          "raises.");
    m.def("driver_entry_names", &driver_entry_names,
          "The driver symbols _C takes from the Python loader, in hand-over order (versioned: cuMemAlloc_v2, ...).");
    m.def("driver_version", []() {
        int v = 0;
        DEEPEP_CU_CHECK(cuDriverGetVersion, &v);
        return v;
    }, "cuDriverGetVersion(), e.g. 13000.");
    m.def("device_count", &device_count, "Number of CUDA devices (RuntimeError without a driver).");
    m.def("device_attribute",
          [](int device, int attr) { return device_attribute(device, static_cast<CUdevice_attribute>(attr)); },
          py::arg("device"), py::arg("attr"), "cuDeviceGetAttribute with a raw CUdevice_attribute value.");
    m.def("device_info", &device_info, py::arg("device"),
          "dict: name, cc_major, cc_minor, sm_count, max_smem_per_block_optin, max_smem_per_sm, ...");

    // ---- modules and launches -------------------------------------------------------------
    py::class_<Function>(m, "Function")
        .def_property_readonly("name", &Function::name)
        .def_property_readonly("device", &Function::device)
        .def_property_readonly("param_size", &Function::param_size,
                               "Bytes of the parameter struct, or -1 when the driver cannot tell.")
        .def_property_readonly("num_params", &Function::num_params)
        .def("get_attribute", [](const Function& f, int attr) {
            return f.get_attribute(static_cast<CUfunction_attribute>(attr));
        }, py::arg("attr"), "cuFuncGetAttribute with a raw CUfunction_attribute value.")
        .def("set_attribute", [](Function& f, int attr, int value) {
            f.set_attribute(static_cast<CUfunction_attribute>(attr), value);
        }, py::arg("attr"), py::arg("value"))
        .def("attributes", [](const Function& f) {
            py::dict d;
            d["num_regs"] = f.get_attribute(CU_FUNC_ATTRIBUTE_NUM_REGS);
            d["max_threads_per_block"] = f.get_attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
            d["static_smem_bytes"] = f.get_attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
            d["local_bytes"] = f.get_attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
            d["max_dynamic_smem_bytes"] = f.get_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
            d["binary_version"] = f.get_attribute(CU_FUNC_ATTRIBUTE_BINARY_VERSION);
            d["ptx_version"] = f.get_attribute(CU_FUNC_ATTRIBUTE_PTX_VERSION);
            return d;
        }, "Common cuFuncGetAttribute values as a dict.")
        .def("set_max_dynamic_shared_memory", &Function::set_max_dynamic_shared_memory, py::arg("bytes"))
        .def("max_active_blocks_per_sm", &Function::max_active_blocks_per_sm,
             py::arg("block_threads"), py::arg("dynamic_smem") = 0)
        .def("launch", [](const Function& f, const py::object& grid, const py::object& block,
                          unsigned shared_mem, std::uintptr_t stream, const py::object& params,
                          const py::object& cluster, bool cooperative, bool programmatic) {
            LaunchConfig cfg;
            cfg.grid = to_dim3(grid, "grid");
            cfg.block = to_dim3(block, "block");
            if (!cluster.is_none()) cfg.cluster = to_dim3(cluster, "cluster");
            cfg.shared_mem = shared_mem;
            cfg.stream = stream;
            cfg.cooperative = cooperative;
            cfg.programmatic = programmatic;
            // Copy the parameter bytes while holding the GIL (bytes fast path, else any buffer).
            std::vector<unsigned char> bytes;
            if (PyBytes_Check(params.ptr())) {
                char* data = nullptr;
                Py_ssize_t size = 0;
                PyBytes_AsStringAndSize(params.ptr(), &data, &size);
                bytes.assign(data, data + size);
            } else if (!params.is_none()) {
                py::buffer_info info = py::reinterpret_borrow<py::buffer>(params).request();
                const auto* data = static_cast<const unsigned char*>(info.ptr);
                bytes.assign(data, data + info.size * info.itemsize);
            }
            py::gil_scoped_release nogil;
            f.launch(cfg, bytes.data(), bytes.size());
        }, py::arg("grid"), py::arg("block"), py::arg("shared_mem") = 0, py::arg("stream") = 0,
           py::arg("params") = py::none(), py::arg("cluster") = py::none(),
           py::arg("cooperative") = false, py::arg("programmatic") = false,
           "Launch with cuLaunchKernelEx. grid/block/cluster: int or tuple of 1..3 ints (cluster None =\n"
           "no cluster); params: bytes (or any buffer, e.g. a ctypes.Structure) of the kernel's single\n"
           "struct parameter; stream: CUstream as int (0 = legacy default); programmatic: a programmatic\n"
           "dependent launch (sm_90+; the kernel must griddepcontrol.wait first). Releases the GIL.");

    py::class_<ModuleHandle, std::shared_ptr<ModuleHandle>>(m, "Module")
        .def(py::init([](const py::bytes& image, int device) {
            std::string data = image;  // copy while holding the GIL
            py::gil_scoped_release nogil;  // loading a fatbin may JIT PTX: can take a while
            return std::make_shared<ModuleHandle>(data, device);
        }), py::arg("image"), py::arg("device"),
           "Load a cubin/fatbin into the device's primary context.")
        .def_property_readonly("device", &ModuleHandle::device)
        .def_property_readonly("handle", [](const ModuleHandle& mod) {
            return reinterpret_cast<std::uintptr_t>(mod.module());
        }, "The CUmodule as an int (e.g. for nvshmemx_cumodule_init). Valid while this Module lives.")
        .def("function", [](const std::shared_ptr<ModuleHandle>& mod, const std::string& name) {
            return Function(mod, name);
        }, py::arg("name"), "Look up a kernel by its symbol (mangled name).");

    // ---- memory ------------------------------------------------------------------------------
    m.def("mem_alloc", &mem_alloc, py::arg("device"), py::arg("bytes"), "cuMemAlloc -> device pointer (int).");
    m.def("mem_free", &mem_free, py::arg("device"), py::arg("ptr"));
    m.def("host_alloc_mapped", &host_alloc_mapped, py::arg("device"), py::arg("bytes"),
          "cuMemHostAlloc(DEVICEMAP|PORTABLE) -> (host_ptr, device_ptr): pinned host memory the GPU can access.");
    m.def("host_free", &host_free, py::arg("device"), py::arg("host_ptr"));
    m.def("mem_get_address_range", &mem_get_address_range, py::arg("device"), py::arg("ptr"),
          "(base, size) of the allocation containing ptr (cuMemGetAddressRange).");
    m.def("memset_d8_async", &memset_d8_async, py::arg("device"), py::arg("ptr"), py::arg("value"),
          py::arg("bytes"), py::arg("stream") = 0);
    m.def("stream_query", &stream_query, py::arg("device"), py::arg("stream"),
          "True when all work on the stream has completed.");
    m.def("stream_synchronize", &stream_synchronize, py::arg("device"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>());
    m.def("stream_wait_stream", &stream_wait_stream, py::arg("device"), py::arg("waiter"), py::arg("waited"),
          "Make stream `waiter` wait for the work enqueued on `waited` so far (an event recorded on `waited`).");

    // ---- CUDA IPC ----------------------------------------------------------------------------
    // Usage: the owner calls ipc_get_mem_handle(dev, base) on a cuMemAlloc'd (or torch caching
    // allocator) pointer; the handle names the whole allocation, so send the offset of your
    // pointer from mem_get_address_range(...)[0] along with it. A peer process calls
    // ipc_open_mem_handle(its_dev, handle) -> base in its address space, adds the offset, and
    // calls ipc_close_mem_handle(its_dev, base) when done. A handle cannot be opened in the
    // process that created it.
    m.attr("IPC_HANDLE_BYTES") = py::int_(kIpcHandleBytes);
    m.def("ipc_get_mem_handle", [](int device, std::uintptr_t ptr) {
        return py::bytes(ipc_get_mem_handle(device, ptr));
    }, py::arg("device"), py::arg("ptr"), "cuIpcGetMemHandle -> 64 bytes.");
    m.def("ipc_open_mem_handle", [](int device, const py::bytes& handle) {
        std::string h = handle;
        py::gil_scoped_release nogil;
        return ipc_open_mem_handle(device, h);
    }, py::arg("device"), py::arg("handle"),
       "cuIpcOpenMemHandle(LAZY_ENABLE_PEER_ACCESS) -> base pointer of the mapped peer allocation.");
    m.def("ipc_close_mem_handle", &ipc_close_mem_handle, py::arg("device"), py::arg("ptr"));

    // Shareable (VMM) device memory: vmm_alloc_shareable(dev, bytes) -> (ptr, size, fd); a peer
    // process maps it with vmm_import(its_dev, fd_it_received, size) -> ptr; vmm_free(dev, ptr, size)
    // unmaps either. The fd is the caller's to pass over a Unix socket and close.
    m.def("vmm_alloc_shareable", [](int device, std::size_t bytes) {
        const ShareableAlloc a = vmm_alloc_shareable(device, bytes);
        return py::make_tuple(a.ptr, a.size, a.fd);
    }, py::arg("device"), py::arg("bytes"));
    m.def("vmm_import", &vmm_import, py::arg("device"), py::arg("fd"), py::arg("size"));
    m.def("vmm_free", &vmm_free, py::arg("device"), py::arg("ptr"), py::arg("size"));
}
