"""The `nvlink` backend: every peer's window mapped here (CUDA IPC or shareable VMM memory), every
contract primitive a load, a store or an atomic (csrc/backends/nvlink/device.cuh). Every rank on one
node. transport.py: the Transport; window.py: its low-latency window and the kernels' build."""
