"""The ibgda backend's operations (csrc/backends/ibgda/ops.cuh, what device.cuh's contract primitives post)
end to end between ranks played by host threads, against the software NIC of tests/native/mlx5_nic_model.hpp
(tests/native/ibgda_transport_model.cu): block WRITEs then a signal on the same queue, with the block's
pieces landing in random order, READ, FETCH_ADD from every rank, drains before staging rows are reused, ring
and 16-bit WQE index wrap-around, and an error completion. The device structs and the kernels compiled for
this backend are checked in tests/test_mirrors.py (test_ibgda_backend_params)."""
import os
import subprocess

import pytest

from deepep_portable import jit

try:
    NVCC = jit.find_nvcc()
except Exception:   # pragma: no cover - CI installs a compiler
    NVCC = None
MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "ibgda_transport_model.cu")


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_operations_between_ranks_against_the_nic_model(tmp_path):
    exe = tmp_path / "transport_model"
    build = subprocess.run([NVCC, "-std=c++17", "-O2", "--expt-relaxed-constexpr", f"-I{jit.kernel_root()}", MODEL,
                            "-o", str(exe), "-Xcompiler", "-pthread"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0 and "failures 0" in run.stdout, run.stdout + run.stderr
    assert "most WQEs on one queue 67500" in run.stdout   # the wrap-around case really wrapped the 16-bit index
