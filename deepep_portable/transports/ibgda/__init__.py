"""The `ibgda` backend's host side (issue 17), being built: RoCE/IB addressing choices (`roce.py`) and the
structs its device code takes (`abi.py`). The transport itself is not registered yet (transports/registry.py:
no queue-pair set-up); its device side is csrc/backends/ibgda/ (encoder mlx5.cuh, posting sq.cuh, operations
ops.cuh, the contract device.cuh), tested on host threads against a software NIC."""
