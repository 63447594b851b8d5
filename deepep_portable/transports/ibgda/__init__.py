"""The `ibgda` backend's host side (issue 17), being built: RoCE/IB addressing choices (`roce.py`). The
transport itself is not registered yet (transports/registry.py); its WQE encoder is
csrc/backends/ibgda/mlx5.cuh."""
