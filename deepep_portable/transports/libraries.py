"""Where optional libraries are on disk and what they are: NVSHMEM and NCCL (path, version, headers).

Split out of probe.py: `find_library` searches $<NAME>_HOME, the pip wheels in site-packages, the
ldconfig cache and the usual system directories, and returns what it searched so a reason can name
it. Nothing here raises for a missing library, and nothing is linked: NCCL and NVSHMEM are opened
with ctypes only to ask their version (neither touches the GPU for that).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import shutil
import site
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Tuple


def _run(cmd: List[str], timeout: float = 20.0) -> Tuple[int, str]:
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout
    except Exception as e:
        return -1, f"{type(e).__name__}: {e}"


_SYSTEM_LIB_DIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                    "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64"]


# --------------------------------------------------------------------------------------------
# Shared libraries on disk
# --------------------------------------------------------------------------------------------

def _site_dirs() -> List[str]:
    dirs: List[str] = []
    try:
        dirs += site.getsitepackages()
    except Exception:
        pass
    try:
        dirs.append(site.getusersitepackages())
    except Exception:
        pass
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    seen, out = set(), []
    for d in dirs:
        d = os.path.abspath(d)
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


@functools.lru_cache(maxsize=None)
def _ldconfig_cache() -> Dict[str, str]:
    """soname -> path from `ldconfig -p`, for this machine's architecture only."""
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if not ldconfig:
        return {}
    rc, text = _run([ldconfig, "-p"])
    if rc != 0:
        return {}
    want64 = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(os.uname().machine)
    out: Dict[str, str] = {}
    for ln in text.splitlines():
        m = re.match(r"\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", ln)
        if m and (want64 is None or want64 in m.group(2)):
            out.setdefault(m.group(1), m.group(3))
    return out


def _pip_versions(dists: List[str]) -> Dict[str, str]:
    out = {}
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover
        return out
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except Exception:
            pass
    return out


def _candidate_dirs(home_env: str, pip_sub: str) -> List[Tuple[str, str]]:
    """[(dir, label)] in search order: $HOME_ENV/lib, pip package dirs, loader path dirs."""
    cands: List[Tuple[str, str]] = []
    home = os.environ.get(home_env)
    if home:
        cands.append((os.path.join(home, "lib"), f"${home_env}/lib"))
        cands.append((os.path.join(home, "lib64"), f"${home_env}/lib64"))
    for d in _site_dirs():
        cands.append((os.path.join(d, pip_sub), "pip package"))
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            cands.append((d, "LD_LIBRARY_PATH"))
    for d in _SYSTEM_LIB_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            cands.append((d, "system"))
    return cands


def find_library(soname: str, home_env: str, pip_sub: str) -> Tuple[Optional[str], List[str]]:
    """Find `soname` in $home_env/lib, the pip package dir, LD_LIBRARY_PATH, the ldconfig cache,
    the system lib dirs. Returns (path or None, every place searched, in order)."""
    searched: List[str] = []
    if not os.environ.get(home_env):
        searched.append(f"${home_env} (unset)")
    for d, label in _candidate_dirs(home_env, pip_sub):
        p = os.path.join(d, soname)
        searched.append(p)
        if os.path.isfile(p):
            return p, searched
    cache = _ldconfig_cache()
    searched.append("ldconfig cache")
    if soname in cache and os.path.isfile(cache[soname]):
        return cache[soname], searched
    return None, searched


def _searched_text(searched: List[str]) -> str:
    return ", ".join(searched)


# --------------------------------------------------------------------------------------------
# NVSHMEM
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def nvshmem_info() -> Dict:
    """host library path, device library (.a / .bc), version, include dir, what was searched."""
    info: Dict = {"pip": _pip_versions(["nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"])}
    host, searched = find_library("libnvshmem_host.so.3", "NVSHMEM_HOME", "nvidia/nvshmem/lib")
    info["host_lib"] = host
    info["searched"] = searched
    if host is None:
        return info
    libdir = os.path.dirname(host)
    # The device library must come from the same installation as the host library.
    dev_found: List[str] = []
    dev_searched: List[str] = []
    for pat in ("libnvshmem_device.a", "libnvshmem_device.bc", "libnvshmem_device_sm_*.bc"):
        dev_searched.append(os.path.join(libdir, pat))
        dev_found += sorted(glob.glob(os.path.join(libdir, pat)))
    info["device_libs"] = dev_found
    info["device_searched"] = dev_searched
    inc = os.path.join(os.path.dirname(libdir), "include")
    info["include_dir"] = inc if os.path.isfile(os.path.join(inc, "nvshmem.h")) else None
    try:
        lib = ctypes.CDLL(host)
        v = [ctypes.c_int(-1) for _ in range(3)]
        lib.nvshmemx_vendor_get_version_info(*[ctypes.byref(x) for x in v])
        info["version"] = ".".join(str(x.value) for x in v)
    except Exception as e:
        info["version"] = None
        info["version_error"] = f"{type(e).__name__}: {e}"
    return info


# --------------------------------------------------------------------------------------------
# NCCL
# --------------------------------------------------------------------------------------------

def _nccl_version_tuple(code: int) -> Tuple[int, int, int]:
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


@functools.lru_cache(maxsize=None)
def nccl_info() -> Dict:
    """libnccl.so.2 path, version (ncclGetVersion), nccl_device.h location, what was searched."""
    info: Dict = {"pip": _pip_versions(["nvidia-nccl-cu13", "nvidia-nccl-cu12"])}
    lib_path, searched = find_library("libnccl.so.2", "NCCL_HOME", "nvidia/nccl/lib")
    info["lib"] = lib_path
    info["searched"] = searched
    info["version"] = None
    if lib_path is not None:
        try:
            lib = ctypes.CDLL(lib_path)
            code = ctypes.c_int(0)
            rc = lib.ncclGetVersion(ctypes.byref(code))
            if rc == 0:
                info["version_code"] = code.value
                info["version"] = "%d.%d.%d" % _nccl_version_tuple(code.value)
            else:
                info["version_error"] = f"ncclGetVersion returned {rc}"
        except Exception as e:
            info["version_error"] = f"{type(e).__name__}: {e}"
    inc_dirs = []
    if lib_path is not None:
        inc_dirs.append(os.path.join(os.path.dirname(os.path.dirname(lib_path)), "include"))
    if os.environ.get("NCCL_HOME"):
        inc_dirs.append(os.path.join(os.environ["NCCL_HOME"], "include"))
    inc_dirs += [os.path.join(d, "nvidia/nccl/include") for d in _site_dirs()]
    if os.environ.get("CUDA_HOME"):
        inc_dirs.append(os.path.join(os.environ["CUDA_HOME"], "include"))
    inc_dirs += ["/usr/include", "/usr/local/include"]
    seen = []
    for d in inc_dirs:
        if d not in seen:
            seen.append(d)
    info["header_searched"] = [os.path.join(d, "nccl_device.h") for d in seen]
    info["device_header"] = next((p for p in info["header_searched"] if os.path.isfile(p)), None)
    # The headers the kernels would be compiled against must be the loaded library's: GIN device code
    # built against other headers is rejected (2.29+ checks a magic) or silently wrong.
    info["header_version_code"] = None
    if info["device_header"] is not None:
        info["header_version_code"] = nccl_header_version(os.path.join(os.path.dirname(info["device_header"]),
                                                                       "nccl.h"))
    return info


def nccl_header_version(nccl_h: str) -> Optional[int]:
    """NCCL_VERSION_CODE as nccl.h defines it (None if the file or the define is missing)."""
    try:
        with open(nccl_h) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"^#define\s+NCCL_VERSION_CODE\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def mapped_files(maps: str = "/proc/self/maps") -> List[str]:
    """Paths of the files mapped into this process, in map order ([] where there is none)."""
    try:
        with open(maps) as f:   # address perms offset dev inode [path]
            return [parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6]
    except OSError:
        return []


def _load_lib(soname: str) -> Tuple[Optional[str], str]:
    """(path it loaded from, "") or (None, error) via the system loader."""
    try:
        ctypes.CDLL(soname)
    except OSError as e:
        return None, str(e)
    base = soname.split(".so")[0]
    for path in mapped_files():
        if os.path.basename(path).startswith(base + ".so"):
            return path, ""
    return soname, ""


def library_settings(env: Mapping[str, str], names: Dict[str, str], gpu_var: Optional[str] = None,
                     unset_gid: Optional[str] = None) -> Dict:
    """The network settings an RDMA library (NVSHMEM, NCCL) reads from the environment, as `doctor --cluster`
    compares them: names maps setting -> the library's variable; unset_gid: what it does without a GID index, if
    that can be wrong; gpu_var: the variable that turns its GPU-initiated path on."""
    def number(text) -> Optional[int]:
        return int(str(text).strip()) if str(text).strip().lstrip("-").isdigit() else None

    got = {k: env.get(v) or None for k, v in names.items()}
    return {"gid_index": number(got["gid_index"]), "traffic_class": number(got["traffic_class"]),
            "service_level": number(got["service_level"]), "hca_list": got["hca_list"], "vars": dict(names),
            "defaults": {"traffic_class": 0, "service_level": 0}, "unset_gid": unset_gid,
            "gpu_initiated": bool(gpu_var) and str(env.get(gpu_var, "")).lower() in ("1", "true", "yes", "on")}
