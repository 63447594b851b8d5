"""Just-in-time compilation of the CUDA kernels (nvcc -> cubin/fatbin), with an on-disk cache.

Kernels are specialised by compile-time parameters (`-D` defines: hidden size, ranks, top-k, ...)
so there are no shape whitelists. A compiled image is cached under
`$DEEPEP_PORTABLE_CACHE_DIR` (default `~/.cache/deepep_portable`), keyed by the sha256 of: the
source, every file under csrc/common/kernels and csrc/backends, the defines, the nvcc flags, the
target and `nvcc --version`. Writes are atomic (temporary file + rename), so ranks that compile
the same kernel at once are safe; a per-key lock file lets one of them compile while the others
wait for its result.

Targets. `compile(..., arch="sm_90")` builds a cubin (SASS for exactly that architecture).
`ptx=True` builds a fatbin with SASS *and* compute_XX PTX instead: the driver JIT-compiles that
PTX for newer GPUs. `load()` uses it for `DEEPEP_PORTABLE_FORCE_ARCH`: with
`DEEPEP_PORTABLE_FORCE_ARCH=sm_80` on an H200 the kernels are compiled as the sm_80 variant
(`__CUDA_ARCH__ == 800`: no TMA, clusters, ...) and run through PTX JIT, which is how the Ampere
code paths are tested on Hopper. (An sm_80 cubin alone does not load on sm_90.)

Environment:
  DEEPEP_PORTABLE_NVCC        path of nvcc (else $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, nvcc on
                              PATH, the pip nvidia-cuda-nvcc package, /usr/local/cuda/bin/nvcc)
  DEEPEP_PORTABLE_CACHE_DIR   cache directory
  DEEPEP_PORTABLE_FORCE_ARCH  e.g. sm_80: compile for this (older) architecture, load via PTX
  DEEPEP_PORTABLE_NVCC_FLAGS  extra nvcc flags (part of the cache key), e.g. "-G" or "-DDEBUG"
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .jit_key import cache_key as _cache_key

__all__ = [
    "JitCompileError", "CompileResult", "KernelFamily", "find_nvcc", "nvcc_version", "kernel_root",
    "cache_dir", "device_arch", "compile", "compile_cached", "load", "KernelCache", "forced_arch",
    "register_family", "families",
    "precompile", "run_all", "clear_memory_cache", "BASE_FLAGS",
]

Defines = Mapping[str, Union[int, bool, str]]

BASE_FLAGS: Tuple[str, ...] = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class JitCompileError(RuntimeError):
    """nvcc failed. `.command` is the full command line, `.log` the compiler's output."""

    def __init__(self, message: str, command: Sequence[str] = (), log: str = "") -> None:
        self.command = list(command)
        self.log = log
        text = message
        if self.command:
            text += "\ncommand: " + shlex.join(self.command)
        if log:
            text += "\n" + log.rstrip()
        super().__init__(text)


@dataclass(frozen=True)
class CompileResult:
    image: bytes          # cubin, or fatbin when ptx=True
    path: str             # where it lives in the cache
    cache_hit: bool
    seconds: float        # compile time (0 on a hit)
    arch: str
    ptx: bool


# ---- locating things --------------------------------------------------------------------------

def _nvidia_pip_dirs() -> List[str]:
    """The `nvidia` namespace package directories (pip CUDA wheels), if any."""
    dirs = []
    for base in sys.path:
        d = os.path.join(base, "nvidia")
        if os.path.isdir(d):
            dirs.append(d)
    return dirs


def find_nvcc() -> str:
    """Path of nvcc; raises JitCompileError listing where it looked."""
    tried: List[str] = []

    def ok(path: Optional[str]) -> bool:
        if not path:
            return False
        tried.append(path)
        return os.path.isfile(path) and os.access(path, os.X_OK)

    env = os.environ.get("DEEPEP_PORTABLE_NVCC")
    if env:
        if ok(env):
            return env
        raise JitCompileError(f"DEEPEP_PORTABLE_NVCC={env!r} is not an executable file")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and ok(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    tried.append("nvcc on PATH")
    for d in _nvidia_pip_dirs():
        for sub in ("cu13/bin/nvcc", "cuda_nvcc/bin/nvcc"):
            if ok(os.path.join(d, sub)):
                return os.path.join(d, sub)
    if ok("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    raise JitCompileError("nvcc not found (set DEEPEP_PORTABLE_NVCC or CUDA_HOME, or install the "
                          "nvidia-cuda-nvcc wheel); looked at: " + ", ".join(tried))


_version_cache: Dict[str, str] = {}


def nvcc_version(nvcc: Optional[str] = None) -> str:
    """`nvcc --version` output (part of every cache key)."""
    nvcc = nvcc or find_nvcc()
    if nvcc not in _version_cache:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120)
        except OSError as e:
            raise JitCompileError(f"cannot run {nvcc}: {e}", [nvcc, "--version"]) from e
        if out.returncode != 0:
            raise JitCompileError("nvcc --version failed", [nvcc, "--version"], out.stdout + out.stderr)
        _version_cache[nvcc] = out.stdout.strip()
    return _version_cache[nvcc]


def kernel_root() -> str:
    """The csrc directory kernels compile from: the installed copy (deepep_portable/csrc) if
    present, else the repository's csrc next to the package (editable / source checkouts)."""
    for root in (os.path.join(_PACKAGE_DIR, "csrc"), os.path.join(os.path.dirname(_PACKAGE_DIR), "csrc")):
        if os.path.isdir(os.path.join(root, "common", "kernels")):
            return root
    raise JitCompileError(f"kernel sources not found (looked for {_PACKAGE_DIR}/csrc and ../csrc); "
                          "reinstall deepep_portable")


def cache_dir() -> str:
    d = os.environ.get("DEEPEP_PORTABLE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "deepep_portable")
    return d


def arch_number(arch: str) -> int:
    m = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", arch)
    if not m:
        raise ValueError(f"bad CUDA architecture {arch!r}; expected e.g. 'sm_90'")
    return int(m.group(1))


# ---- compiling --------------------------------------------------------------------------------

def _normalize_defines(defines: Optional[Defines]) -> List[Tuple[str, str]]:
    out = []
    for k, v in sorted((defines or {}).items()):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"bad define name {k!r}")
        if isinstance(v, bool):
            v = int(v)
        out.append((k, str(v)))
    return out


def _target_flags(arch: str, ptx: bool) -> List[str]:
    num = arch_number(arch)
    suffix = arch[len(f"sm_{num}"):] if arch.startswith("sm_") else ""
    if ptx:
        return ["-fatbin", f"-gencode=arch=compute_{num}{suffix},code=[sm_{num}{suffix},compute_{num}{suffix}]"]
    return ["-cubin", f"-arch=sm_{num}{suffix}"]


def _extra_flags() -> List[str]:
    return shlex.split(os.environ.get("DEEPEP_PORTABLE_NVCC_FLAGS", ""))


@contextlib.contextmanager
def _key_lock(path: str):
    """Advisory per-key lock so concurrent ranks compile once; correctness never depends on it."""
    fd = None
    try:
        import fcntl

        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except Exception:  # no fcntl, read-only dir, NFS without locks: go on without the lock
        if fd is not None:
            os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the flock


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def compile_cached(source_relpath: str, defines: Optional[Defines] = None, arch: str = "sm_90", *,
                   ptx: bool = False, root: Optional[str] = None, extra_flags: Sequence[str] = (),
                   cache: Optional[str] = None) -> CompileResult:
    """Compile `root/source_relpath` (root defaults to kernel_root()) for `arch` unless cached.

    Returns the image with where it is cached and whether it was a cache hit. `extra_flags` are
    added to nvcc's command line (and to the key); `cache` overrides the cache directory.
    """
    root = os.path.abspath(root or kernel_root())
    source = os.path.join(root, source_relpath)
    if not os.path.isfile(source):
        raise JitCompileError(f"kernel source {source} not found")
    nvcc = find_nvcc()
    defs = _normalize_defines(defines)
    flags = [*BASE_FLAGS, *_target_flags(arch, ptx), f"-I{root}", *extra_flags, *_extra_flags()]
    key_flags = [f for f in flags if f != f"-I{root}"]  # the tree's contents are hashed, not its location
    key = _cache_key(source, root, defs, key_flags, nvcc_version(nvcc))
    out_path = artifact_path(source, arch, key, "fatbin" if ptx else "cubin", cache)

    def build() -> bytes:
        with tempfile.TemporaryDirectory(prefix="deepep_portable_nvcc_") as tmp:
            tmp_out = os.path.join(tmp, "out.bin")
            cmd = [nvcc, *flags, *(f"-D{k}={v}" for k, v in defs), source, "-o", tmp_out]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            except OSError as e:
                raise JitCompileError(f"cannot run nvcc: {e}", cmd) from e
            log = (proc.stdout + proc.stderr).strip()
            if proc.returncode != 0 or not os.path.isfile(tmp_out):
                raise JitCompileError(f"nvcc failed (exit {proc.returncode}) compiling {source_relpath} "
                                      f"for {arch}", cmd, log)
            with open(tmp_out, "rb") as f:
                return f.read()

    data, hit, seconds = cached_artifact(out_path, build)
    return CompileResult(data, out_path, hit, seconds, arch, ptx)


def artifact_path(source: str, tag: str, key: str, ext: str, cache: Optional[str] = None) -> str:
    """<cache>/<source stem>.<tag>.<key prefix>.<ext> (the cache directory is created if needed)."""
    directory = cache or cache_dir()
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{os.path.splitext(os.path.basename(source))[0]}.{tag}.{key[:32]}.{ext}")


def cached_artifact(out_path: str, build: Callable[[], bytes]) -> Tuple[bytes, bool, float]:
    """The bytes cached at `out_path`, or `build()` run once (a per-file lock keeps concurrent
    ranks from compiling the same thing twice) and stored atomically. (data, cache_hit, seconds)."""

    def read_hit() -> Optional[bytes]:
        try:
            with open(out_path, "rb") as f:
                data = f.read()
            return data or None
        except OSError:
            return None

    data = read_hit()
    if data is not None:
        return data, True, 0.0
    with _key_lock(out_path + ".lock"):
        data = read_hit()  # another process may have finished it while we waited
        if data is not None:
            return data, True, 0.0
        t0 = time.perf_counter()
        data = build()
        seconds = time.perf_counter() - t0
        _atomic_write(out_path, data)
    return data, False, seconds


def compile(source_relpath: str, defines: Optional[Defines] = None, arch: str = "sm_90", **kwargs) -> bytes:
    """Compile (or fetch from the cache) and return the cubin (fatbin with ptx=True) bytes."""
    return compile_cached(source_relpath, defines, arch, **kwargs).image


# ---- loading ----------------------------------------------------------------------------------

_arch_cache: Dict[int, str] = {}


def device_arch(device: int) -> str:
    """'sm_XY' from the device's compute capability."""
    arch = _arch_cache.get(device)
    if arch is None:
        from . import _C

        info = _C.device_info(device)
        arch = _arch_cache[device] = f"sm_{info['cc_major']}{info['cc_minor']}"
    return arch


def _current_device() -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


_load_lock = threading.Lock()
_modules: Dict[tuple, object] = {}
_functions: Dict[tuple, object] = {}


def forced_arch() -> Optional[str]:
    """DEEPEP_PORTABLE_FORCE_ARCH (e.g. sm_80 on a Hopper GPU): part of every key that caches kernels."""
    return os.environ.get("DEEPEP_PORTABLE_FORCE_ARCH")


def _load_target(device: int) -> Tuple[str, bool]:
    native = device_arch(device)
    forced = (forced_arch() or "").strip()
    if not forced or forced == native:
        return native, False
    if arch_number(forced) > arch_number(native):
        raise ValueError(f"DEEPEP_PORTABLE_FORCE_ARCH={forced} is newer than device {device} ({native}); "
                         "code for a newer architecture cannot run there")
    return forced, True  # older arch: embed PTX so the driver can JIT it for this device


def load(source_relpath: str, kernel_name: str, defines: Optional[Defines] = None,
         device: Optional[int] = None, **compile_kwargs):
    """Compile if needed, load into `device` (default: torch's current device) and return the
    `_C.Function`. Functions are cached in-process per (source, kernel, defines, device, kwargs),
    so a repeated call costs one dictionary lookup. The environment (DEEPEP_PORTABLE_FORCE_ARCH,
    DEEPEP_PORTABLE_NVCC_FLAGS) is read when a function is first loaded; after changing it at run
    time call clear_memory_cache()."""
    dev = _current_device() if device is None else int(device)
    fast_key = (source_relpath, kernel_name, tuple(sorted(defines.items())) if defines else (), dev,
                repr(sorted(compile_kwargs.items())) if compile_kwargs else "")
    fn = _functions.get(fast_key)
    if fn is not None:
        return fn
    from . import _C

    with _load_lock:
        fn = _functions.get(fast_key)
        if fn is not None:
            return fn
        arch, ptx = _load_target(dev)
        mod_key = (source_relpath, tuple(_normalize_defines(defines)), arch, ptx, dev,
                   repr(sorted(compile_kwargs.items())), os.environ.get("DEEPEP_PORTABLE_NVCC_FLAGS", ""))
        module = _modules.get(mod_key)
        if module is None:
            image = compile(source_relpath, defines, arch, ptx=ptx, **compile_kwargs)
            module = _C.Module(image, dev)
            _modules[mod_key] = module
        fn = module.function(kernel_name)
        _functions[fast_key] = fn
        return fn


class KernelCache:
    """load() memoized per (source, kernel, defines, flags, forced arch) for one device: the hot path
    of an op should not rebuild load()'s keys on every call."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._fns: dict = {}

    def get(self, source: str, name: str, defines: Defines, extra_flags: Sequence[str] = ()):
        key = (source, name, tuple(sorted(defines.items())), tuple(extra_flags), forced_arch())
        fn = self._fns.get(key)
        if fn is None:
            kwargs = {"extra_flags": tuple(extra_flags)} if extra_flags else {}
            fn = self._fns[key] = load(source, name, defines, self.device, **kwargs)
        return fn


def clear_memory_cache() -> None:
    """Forget in-process functions and modules, so the next load() re-reads the environment
    (e.g. after setting DEEPEP_PORTABLE_FORCE_ARCH in a test)."""
    with _load_lock:
        _functions.clear()
        _modules.clear()


# ---- registry of kernel families (what `precompile` builds) ------------------------------------

@dataclass(frozen=True)
class KernelFamily:
    name: str
    source: str                          # path under csrc/
    kernels: Tuple[str, ...]             # kernel symbols in it (kernel_symbol)
    variants: Tuple[Tuple[Tuple[str, str], ...], ...]  # define sets precompile builds
    archs: Optional[Tuple[str, ...]] = None             # None: every arch asked for
    extra_flags: Tuple[str, ...] = ()


_families: Dict[str, KernelFamily] = {}


def kernel_symbol(qualified_name: str, params_type: str) -> str:
    """Symbol of `__global__ void ns::...::name(ParamsType)` (ParamsType: a class at global scope), as the
    Itanium C++ ABI mangles it: what load() looks up (common.cuh: why kernels live in namespaces)."""
    parts = qualified_name.split("::")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts) or not params_type.isidentifier():
        raise ValueError(f"kernel_symbol needs ns::name and a global class, got {qualified_name!r}, {params_type!r}")
    return "_ZN" + "".join(f"{len(p)}{p}" for p in parts) + f"E{len(params_type)}{params_type}"


def register_family(name: str, source: str, kernels: Iterable[str], variants: Iterable[Defines],
                    archs: Optional[Iterable[str]] = None, extra_flags: Iterable[str] = ()) -> KernelFamily:
    """Declare a kernel family. `variants` are the define sets `precompile` compiles (typical
    production shapes; CI compiles each for sm_80 and sm_90). `archs` limits the family to some
    architectures (e.g. ("sm_90",) for TMA-only code)."""
    fam = KernelFamily(name, source, tuple(kernels), tuple(tuple(_normalize_defines(v)) for v in variants),
                       tuple(archs) if archs is not None else None, tuple(extra_flags))
    _families[name] = fam
    return fam


def families() -> Dict[str, KernelFamily]:
    return dict(_families)


def precompile(archs: Sequence[str] = ("sm_80", "sm_90"), jobs: Optional[int] = None,
               cache: Optional[str] = None, names: Optional[Iterable[str]] = None
               ) -> List[Tuple[str, str, float, bool]]:
    """Compile every registered family's variants for each arch (in parallel, `jobs` nvcc
    processes). Returns [(name, arch, seconds, cache_hit)], name = "family[K=V,...]".
    Raises JitCompileError on the first failure (after the others finish)."""
    wanted = set(names) if names is not None else None
    tasks = []
    for fam in _families.values():
        if wanted is not None and fam.name not in wanted:
            continue
        for arch in archs:
            if fam.archs is not None and arch not in fam.archs:
                continue
            for variant in fam.variants:
                label = fam.name + "[" + ",".join(f"{k}={v}" for k, v in variant) + "]"
                tasks.append((label, fam, dict(variant), arch))

    def run(task):
        label, fam, defs, arch = task
        t0 = time.perf_counter()
        res = compile_cached(fam.source, defs, arch, extra_flags=fam.extra_flags, cache=cache)
        return label, arch, time.perf_counter() - t0, res.cache_hit

    return run_all(run, tasks, jobs)


def run_all(fn, tasks: Sequence, jobs: Optional[int] = None) -> list:
    """[fn(task) for task in tasks], `jobs` at once (default: every core), in order. A failure does not stop the
    others: the first one is raised after all finished (a build reports every kernel it could make)."""
    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        futures = [pool.submit(fn, t) for t in tasks]
    results, first_error = [], None
    for fut in futures:
        try:
            results.append(fut.result())
        except Exception as e:  # noqa: BLE001 - report the first, after all finished
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return results
