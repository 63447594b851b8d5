"""Build of deepep_portable: the small host module `_C` plus the kernel sources.

Metadata lives in pyproject.toml; this file adds what setuptools cannot express there:
  * `deepep_portable._C` from csrc/common/runtime/*.cpp (pybind11, no libtorch, no -lcuda, no -ldl:
    it calls the driver through entry points transports/system.py resolves at run time, so only
    cuda.h is needed, for types);
  * for a backend whose set-up needs C, `deepep_portable._<name>` from csrc/backends/<name>/host.cpp
    (its own PYBIND11_MODULE; the libraries it talks to are opened at run time, never linked);
  * the kernel sources (csrc/common/kernels, csrc/backends/*) copied into the package as
    deepep_portable/csrc/... so that a regular (non-editable) install can JIT-compile them.
No torch import here: one build serves every torch version.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def _has_cuda_h(include_dir: str) -> bool:
    return os.path.isfile(os.path.join(include_dir, "cuda.h"))


def _include_dirs_of_root(root: str):
    yield os.path.join(root, "include")
    yield from sorted(glob.glob(os.path.join(root, "targets", "*", "include")))


def _nvcc_top(nvcc: str):
    """CUDA root an nvcc uses, also when `nvcc` is a wrapper script (asks nvcc --dryrun)."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    return os.path.normpath(m.group(1).strip()) if m else None


def find_cuda_include() -> str:
    """Directory holding cuda.h: $CUDA_HOME, $CUDA_PATH, nvcc's root, /usr/local/cuda, pip wheels."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        roots.append(_nvcc_top(nvcc))
    roots.append("/usr/local/cuda")
    tried = []
    for root in roots:
        if not root:
            continue
        for inc in _include_dirs_of_root(root):
            tried.append(inc)
            if _has_cuda_h(inc):
                return inc
    # pip wheels: nvidia/cu13/include (CUDA 13 layout), nvidia/cuda_runtime/include (CUDA 12).
    for site in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cuda_nvcc/include"):
            inc = os.path.join(site, sub)
            tried.append(inc)
            if _has_cuda_h(inc):
                return inc
    raise SystemExit(
        "deepep_portable: cannot find cuda.h (needed at build time for driver API types only).\n"
        "Set CUDA_HOME to a CUDA 12/13 toolkit, put its nvcc on PATH, or install the pip package "
        "nvidia-cuda-runtime.\nLooked in:\n  " + "\n  ".join(tried))


class build_py(_build_py):
    """Also ship the kernel sources inside the package (deepep_portable/csrc/...)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable installs compile kernels straight from the repository's csrc/
        dst_root = os.path.join(self.build_lib, "deepep_portable", "csrc")
        dirs = [os.path.join("common", "kernels")]
        dirs += [os.path.relpath(d, CSRC) for d in sorted(glob.glob(os.path.join(CSRC, "backends", "*")))
                 if os.path.isdir(d)]
        for rel in dirs:
            src = os.path.join(CSRC, rel)
            if not os.path.isdir(src):
                continue
            dst = os.path.join(dst_root, rel)
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))


ParallelCompile("DEEPEP_PORTABLE_BUILD_JOBS", default=0).install()  # 0 = all cores

cuda_include = find_cuda_include()
ext = Pybind11Extension(
    "deepep_portable._C",
    sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(CSRC, "common", "runtime", "*.cpp"))),
    include_dirs=[os.path.join(CSRC, "common", "runtime"), cuda_include],
    cxx_std=17,
    extra_compile_args=["-O2"],
)

backend_exts = [
    Pybind11Extension(f"deepep_portable._{os.path.basename(os.path.dirname(path))}", [os.path.relpath(path, ROOT)],
                      include_dirs=[os.path.join(CSRC, "common", "runtime"), cuda_include], libraries=["dl"],
                      cxx_std=17, extra_compile_args=["-O2"])
    for path in sorted(glob.glob(os.path.join(CSRC, "backends", "*", "host.cpp")))]

setup(ext_modules=[ext, *backend_exts], cmdclass={"build_ext": build_ext, "build_py": build_py})
