"""The ibgda send-queue posting code (csrc/backends/ibgda/sq.cuh) on host threads against a software
model of the NIC's send side (tests/native/ibgda_sq_model.cu): many posters on one small ring, past the
16-bit WQE-index wrap, every WQE or every 8th signalled, doorbells never backwards, every write landed;
and a bad remote key coming back as an error CQE to a waiting poster. Also compiled for sm_90."""
import subprocess

import pytest

from deepep_portable import jit

try:
    NVCC = jit.find_nvcc()
except Exception:   # pragma: no cover - CI installs a compiler
    NVCC = None


def test_posting_against_the_nic_model(run_native):
    run_native("ibgda_sq_model")


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_posting_compiles_for_the_gpu(tmp_path):
    src = tmp_path / "sq_device.cu"
    src.write_text('#include "backends/ibgda/sq.cuh"\n'
                   "using namespace deepep_portable::ibgda;\n"
                   "__global__ void k(SendQueue q, unsigned long long* out) {\n"
                   "    CqStatus err{};\n"
                   "    out[threadIdx.x] = post(q, [&](uint8_t* w, uint16_t pi) {\n"
                   "        mlx5::write_rdma(w, mlx5::kOpRdmaWrite, pi, q.qpn, mlx5::kCqUpdate, 1, 2, 3, 4, 8); },\n"
                   "        [] { return false; }, &err);\n"
                   "}\n")
    build = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "--extended-lambda",
                            f"-I{jit.kernel_root()}", str(src), "-o", str(tmp_path / "sq.cubin")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
