"""JIT for kernels that call NVSHMEM's device API: relocatable compile + device link -> cubin.

NVSHMEM's device functions live in a static device library (libnvshmem_device.a), so such kernels
cannot be built by jit.compile's one-step `nvcc -cubin`. The recipe (checked with nvcc 13.0 and
NVSHMEM 3.8.0's pip package, for sm_80, sm_90, sm_90a and sm_100):

  1. nvcc <BASE_FLAGS> -rdc=true -dc -arch=sm_XX -I<csrc> -I<nvshmem>/include [-I<cuda>/include/cccl]
          -D... kernel.cu -o kernel.o
  2. nvcc -dlink -cubin -arch=sm_XX kernel.o <nvshmem>/lib/libnvshmem_device.a -o kernel.cubin

Step 2 makes nvlink resolve the NVSHMEM device symbols and emit one executable ELF (a cubin,
`ET_EXEC`, SASS for sm_XX only) that cuModuleLoadData accepts. (`nvlink -cubin` is not an option of
nvlink 13; `nvcc -dlink -cubin` drives it correctly.) The cubin holds NVSHMEM's device state
(`nvshmemi_device_state_d` ...) uninitialised: load it with
runtime.NvshmemRuntime.load_module(result), which also calls nvshmemx_cumodule_init, before
the first launch.

No PTX variant: a device-linked image is SASS for one architecture, so DEEPEP_PORTABLE_FORCE_ARCH
(run the sm_80 variant through PTX JIT) does not apply to NVSHMEM kernels.

One installation: the headers, libnvshmem_device.a and libnvshmem_host.so.3 must be the same NVSHMEM
release (the device library's code and the host library's device-state layout that
nvshmemx_cumodule_init copies in must agree). nvshmem_build_paths() takes all three from the one
installation libraries.nvshmem_info() finds (the one runtime.py loads) and refuses headers whose
NVSHMEM_VENDOR_*_VERSION differ from the host library's version; every cubin comes back as a
LinkedCompileResult naming that installation, and runtime.NvshmemRuntime.load_module refuses a cubin
linked against another one.

Cache: like jit.compile_cached, under jit.cache_dir(), atomic writes, per-key lock. The key is
jit's (source, every file under csrc/common/kernels and csrc/backends, defines, flags, nvcc version)
plus the NVSHMEM version, the device library's path, size and mtime, and the include directory.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ... import jit
from ...jit import BASE_FLAGS, CompileResult, Defines, JitCompileError, find_nvcc, kernel_root, nvcc_version
from .. import libraries

__all__ = ["NvshmemBuildPaths", "LinkedCompileResult", "nvshmem_build_paths", "header_version",
           "cuda_include_dirs", "compile_linked_cached", "compile_linked", "command_lines"]


@dataclass(frozen=True)
class NvshmemBuildPaths:
    include_dir: str
    lib_dir: str
    device_lib: str      # libnvshmem_device.a
    version: str         # e.g. "3.8.0", or "unknown (...)" when the host library did not answer
    host_lib: str = ""   # libnvshmem_host.so.3 of the same installation (what the runtime must load)


@dataclass(frozen=True)
class LinkedCompileResult(CompileResult):
    """A device-linked cubin plus the NVSHMEM installation it was linked against."""
    nvshmem: Optional[NvshmemBuildPaths] = None


_VERSION_DEFINE = re.compile(rb"^[ \t]*#[ \t]*define[ \t]+NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION[ \t]+(\d+)",
                             re.MULTILINE)


def header_version(include_dir: str) -> Optional[str]:
    """"MAJOR.MINOR.PATCH" from the NVSHMEM_VENDOR_*_VERSION macros (documented library constants)
    defined somewhere under include_dir, or None when they are not found."""
    found = {}
    for dirpath, _dirs, files in os.walk(include_dir):
        for name in sorted(files):
            if not name.endswith((".h", ".hpp", ".cuh")):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    text = f.read()
            except OSError:
                continue
            if b"NVSHMEM_VENDOR_" not in text:
                continue
            for m in _VERSION_DEFINE.finditer(text):
                found.setdefault(m.group(1).decode(), m.group(2).decode())
            if len(found) == 3:
                return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}"
    return None


def nvshmem_build_paths() -> NvshmemBuildPaths:
    """Where NVSHMEM's headers and device library are (the installation libraries.nvshmem_info finds:
    $NVSHMEM_HOME, the pip package nvidia-nvshmem-cu13/cu12, LD_LIBRARY_PATH, system dirs).
    Raises JitCompileError naming what was searched when something is missing, and when the
    headers are another NVSHMEM release than the host library (see the module docstring)."""
    info = libraries.nvshmem_info()
    host = info.get("host_lib")
    if host is None:
        raise JitCompileError("NVSHMEM not found: libnvshmem_host.so.3 is in none of "
                              + ", ".join(info.get("searched", [])) + " (pip install nvidia-nvshmem-cu13 "
                              "or set NVSHMEM_HOME)")
    lib_dir = os.path.dirname(host)
    device_lib = os.path.join(lib_dir, "libnvshmem_device.a")
    if not os.path.isfile(device_lib):
        raise JitCompileError(f"NVSHMEM at {lib_dir} has no libnvshmem_device.a (needed to device-link "
                              "kernels that use the NVSHMEM device API)")
    inc = info.get("include_dir")
    if not inc:
        raise JitCompileError(f"NVSHMEM at {lib_dir} has no include/nvshmem.h next to its lib directory")
    version = info.get("version")
    headers = header_version(inc)
    if version and headers and headers != version:
        raise JitCompileError(f"NVSHMEM version mismatch: the headers in {inc} are {headers} but {host} is "
                              f"{version}; kernels must be built against the installation whose host library "
                              "runs them (fix NVSHMEM_HOME / the nvidia-nvshmem package)")
    if not version:
        version = f"unknown ({info.get('version_error')})"
    return NvshmemBuildPaths(inc, lib_dir, device_lib, version, host)


_toolkit_cache: dict = {}


def nvcc_toolkit_root(nvcc: str) -> Optional[str]:
    """The toolkit directory nvcc really uses (its `TOP`, from `nvcc --dryrun`): right even when
    `nvcc` is a wrapper script (e.g. /usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc)."""
    if nvcc not in _toolkit_cache:
        root = None
        try:
            with tempfile.TemporaryDirectory(prefix="deepep_portable_nvcc_") as tmp:
                proc = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.path.join(tmp, "x.o")],
                                      capture_output=True, text=True, timeout=120)
            for line in (proc.stdout + proc.stderr).splitlines():
                line = line.lstrip("#$ ").strip()
                if line.startswith("TOP="):
                    root = os.path.normpath(line[4:].strip().strip('"'))
                    break
        except (OSError, subprocess.SubprocessError):
            root = None
        _toolkit_cache[nvcc] = root
    return _toolkit_cache[nvcc]


def cuda_include_dirs(nvcc: Optional[str] = None) -> List[str]:
    """The CCCL include directory (NVSHMEM >= 3.4 headers include <cuda/std/...>). nvcc 13 adds its
    own with -isystem; we name the same one explicitly (never a different CCCL than nvcc's, which
    could be a newer release the compiler does not support). Looks in nvcc's toolkit (`TOP`),
    $CUDA_HOME, $CUDA_PATH, the pip nvidia/cu13 package, /usr/local/cuda; [] if none has it."""
    roots: List[str] = []
    if nvcc:
        top = nvcc_toolkit_root(nvcc)
        if top:
            roots.append(top)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            roots.append(os.environ[var])
    roots += [os.path.join(d, "cu13") for d in jit._nvidia_pip_dirs()]
    roots.append("/usr/local/cuda")
    for r in roots:
        for d in (os.path.join(r, "include", "cccl"),
                  os.path.join(r, "targets", f"{os.uname().machine}-linux", "include", "cccl")):
            if os.path.isdir(os.path.join(d, "cuda")):
                return [os.path.normpath(d)]
    return []


def _run(cmd: List[str], cwd: str, what: str) -> float:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    except OSError as e:
        raise JitCompileError(f"cannot run nvcc: {e}", cmd) from e
    if proc.returncode != 0:
        raise JitCompileError(f"nvcc failed (exit {proc.returncode}) {what}", cmd,
                              (proc.stdout + proc.stderr).strip())
    return time.perf_counter() - t0


def compile_linked_cached(source: str, defines: Optional[Defines] = None, arch: str = "sm_90", *,
                          root: Optional[str] = None, extra_flags: Sequence[str] = (),
                          cache: Optional[str] = None,
                          nvshmem: Optional[NvshmemBuildPaths] = None) -> LinkedCompileResult:
    """Compile `source` (relative to `root`, default jit.kernel_root(), or an absolute path) with
    -rdc and device-link it against libnvshmem_device.a into a cubin for `arch`, unless cached.
    The kernel tree (-I<root>) is kernel_root() unless `root` is given."""
    if arch.startswith("compute_"):
        raise ValueError(f"device-linked NVSHMEM kernels are SASS only; got {arch!r}, want e.g. 'sm_90'")
    jit.arch_number(arch)  # validates
    root = os.path.abspath(root or kernel_root())
    src = source if os.path.isabs(source) else os.path.join(root, source)
    if not os.path.isfile(src):
        raise JitCompileError(f"kernel source {src} not found")
    paths = nvshmem or nvshmem_build_paths()
    nvcc = find_nvcc()
    defs = jit._normalize_defines(defines)
    cccl = cuda_include_dirs(nvcc)
    compile_flags = [*BASE_FLAGS, "-rdc=true", "-dc", f"-arch={arch}", *extra_flags, *jit._extra_flags()]
    link_flags = ["-dlink", "-cubin", f"-arch={arch}"]
    st = os.stat(paths.device_lib)
    key_flags = [*compile_flags, "|link", *link_flags,
                 f"|nvshmem-version={paths.version}", f"|nvshmem-lib={paths.device_lib}",
                 f"|nvshmem-lib-stat={st.st_size}:{st.st_mtime_ns}", f"|nvshmem-include={paths.include_dir}",
                 *(f"|cccl={d}" for d in cccl)]
    key = jit._cache_key(src, root, defs, key_flags, nvcc_version(nvcc))
    out_path = jit.artifact_path(src, f"nvshmem.{arch}", key, "cubin", cache)

    def build() -> bytes:
        with tempfile.TemporaryDirectory(prefix="deepep_portable_nvshmem_") as tmp:
            obj = os.path.join(tmp, "kernel.o")
            cubin = os.path.join(tmp, "kernel.cubin")
            includes = [f"-I{root}", f"-I{paths.include_dir}", *(f"-I{d}" for d in cccl)]
            cc = [nvcc, *compile_flags, *includes, *(f"-D{k}={v}" for k, v in defs), src, "-o", obj]
            _run(cc, tmp, f"compiling {source} for {arch} (-rdc, NVSHMEM {paths.version})")
            ln = [nvcc, *link_flags, obj, paths.device_lib, "-o", cubin]
            _run(ln, tmp, f"device-linking {source} for {arch} against {paths.device_lib}")
            if not os.path.isfile(cubin):
                raise JitCompileError(f"nvcc -dlink produced no {cubin}", ln)
            with open(cubin, "rb") as f:
                return f.read()

    data, hit, seconds = jit.cached_artifact(out_path, build)
    return LinkedCompileResult(data, out_path, hit, seconds, arch, False, paths)


def compile_linked(source: str, defines: Optional[Defines] = None, arch: str = "sm_90", **kwargs) -> bytes:
    """The device-linked cubin's bytes (see compile_linked_cached)."""
    return compile_linked_cached(source, defines, arch, **kwargs).image


def command_lines(source: str, arch: str = "sm_90") -> List[str]:
    """The two nvcc command lines the recipe runs (for docs / doctor), without running them."""
    paths = nvshmem_build_paths()
    nvcc = find_nvcc()
    inc = [f"-I{kernel_root()}", f"-I{paths.include_dir}", *(f"-I{d}" for d in cuda_include_dirs(nvcc))]
    return [shlex.join([nvcc, *BASE_FLAGS, "-rdc=true", "-dc", f"-arch={arch}", *inc, source, "-o", "kernel.o"]),
            shlex.join([nvcc, "-dlink", "-cubin", f"-arch={arch}", "kernel.o", paths.device_lib,
                        "-o", "kernel.cubin"])]
