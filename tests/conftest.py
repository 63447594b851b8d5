"""Fixtures shared by the single-process tests (tests/mpi/conftest.py has the multi-rank ones)."""
import os
import socket
import subprocess

import pytest
import torch.distributed as dist

NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")


@pytest.fixture(scope="session")
def one_rank_group():
    """The default process group as a one-rank gloo group (created on first use)."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a one-rank default group")
    return dist.group.WORLD


@pytest.fixture
def run_native(tmp_path):
    """run_native(name, timeout): build tests/native/<name>.cu as a host program (nvcc, the kernel tree on the
    include path) and run it; returns its stdout after asserting both steps succeeded and it printed
    "failures 0". Skips without nvcc."""
    from deepep_portable import jit

    try:
        nvcc = jit.find_nvcc()
    except Exception:   # pragma: no cover - CI installs a compiler
        pytest.skip("no nvcc")

    def run(name: str, timeout: int = 300) -> str:
        exe = tmp_path / name
        build = subprocess.run([nvcc, "-std=c++17", "-O2", "--expt-relaxed-constexpr", f"-I{jit.kernel_root()}",
                                os.path.join(NATIVE, f"{name}.cu"), "-o", str(exe), "-Xcompiler", "-pthread"],
                               capture_output=True, text=True)
        assert build.returncode == 0, build.stdout + build.stderr
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
        print(out.stdout)
        assert out.returncode == 0 and "failures 0" in out.stdout, out.stdout + out.stderr
        return out.stdout
    return run
