"""The `nccl_gin` backend's host side: the host glue over NCCL's host API compiled
against the loaded libnccl's own headers (`host.py`, csrc/backends/nccl_gin/host.cc). The transport is not
registered yet (no device side): transports/registry.py says so."""
