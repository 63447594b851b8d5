"""The `nvshmem` backend: the low-latency kernels over NVSHMEM's symmetric heap, through its public
device API only (csrc/backends/nvshmem/device.cuh). transport.py: the Transport; window.py: its window;
runtime.py: NVSHMEM's host library (ctypes); link.py: the device-linking JIT; abi.py: shared structs."""
