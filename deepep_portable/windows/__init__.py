"""Windows: memory every rank of a Buffer can address, one per rank, same size everywhere.

`base.Window` is what the engines stand on (grid cap, error record, and the kernels built for the
window's transport); `ipc.IpcWindow` is CUDA IPC / shareable VMM memory between the ranks of a node.
Backends that own their memory (NVSHMEM's heap) define their window in their own folder."""
