"""The `ibgda` backend's host side: the transport (`transport.py`) on a window (`window.py`) whose NIC
resources come from a provider (`provider.py`: the mlx5 DevX one, `devx.py` over the C glue `devx_glue.py` and
the PRM commands `prm.py`, never run on a real NIC; the tests install a NIC model), RoCE/IB addressing choices
(`roce.py`) and the structs its device code takes (`abi.py`). The device
side is csrc/backends/ibgda/ (encoder mlx5.cuh, posting sq.cuh, operations ops.cuh, the contract device.cuh)."""
