"""Host glue of the nccl_gin backend: csrc/backends/nccl_gin/host.cc compiled against the headers of the libnccl
this process loads (libraries.nccl_info(): the library the probe checked, and the include directory next to it)
and linked to it, cached in the JIT cache by (source, header version, library path). The versioned structs
(ncclDevCommRequirements, ncclDevComm) are built by NCCL's own headers there; Python only sees their bytes.

`HostLib.check_versions()` is the gate DeepEP and the issue ask for: the headers the device code is compiled
against must be the loaded library's (NCCL_VERSION_CODE == ncclGetVersion()); GIN kernels are rejected or
silently wrong otherwise (../shared/research/NCCL_GIN.md §1.5).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ... import jit
from .. import libraries

SOURCE = "backends/nccl_gin/host.cc"


class DginRequest(ctypes.Structure):
    """host.cc's DginRequest: what a window asks of a device communicator."""

    _fields_ = [("lsa_barrier_count", ctypes.c_int32), ("gin", ctypes.c_int32), ("gin_contexts", ctypes.c_int32),
                ("gin_signals", ctypes.c_int32), ("gin_counters", ctypes.c_int32),
                ("gin_queue_depth", ctypes.c_int32), ("gin_traffic_class", ctypes.c_int32)]


@dataclass(frozen=True)
class Request:
    lsa_barriers: int = 1
    gin: bool = False
    gin_contexts: int = 1
    gin_signals: int = 0
    gin_counters: int = 0
    gin_queue_depth: int = 0
    gin_traffic_class: int = -1

    def struct(self) -> DginRequest:
        return DginRequest(self.lsa_barriers, int(self.gin), self.gin_contexts, self.gin_signals, self.gin_counters,
                           self.gin_queue_depth, self.gin_traffic_class)


def _where(info: Optional[Dict] = None) -> Tuple[str, str]:
    """(libnccl.so.2 path, include dir) of the NCCL the process loads; RuntimeError naming what is missing."""
    info = info or libraries.nccl_info()
    if info.get("lib") is None:
        raise RuntimeError("libnccl.so.2 not found: pip install nvidia-nccl-cu13 or set NCCL_HOME")
    if info.get("device_header") is None:
        raise RuntimeError(f"nccl_device.h not found next to {info['lib']} (NCCL >= 2.28 ships it)")
    return info["lib"], os.path.dirname(info["device_header"])


def build(info: Optional[Dict] = None) -> str:
    """Path of host.cc compiled for the loaded NCCL (built once per source, headers and library)."""
    lib, include = _where(info)
    src = os.path.join(jit.kernel_root(), SOURCE)
    key = hashlib.sha1()
    for part in (open(src, "rb").read(), open(os.path.join(include, "nccl.h"), "rb").read(), lib.encode(),
                 jit.nvcc_version().encode()):
        key.update(part)
    out = os.path.join(jit.cache_dir(), "nccl_gin", f"host_{key.hexdigest()[:20]}.so")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}"
    cmd = [jit.find_nvcc(), "-std=c++17", "-O1", "-x", "cu", "-shared", "-Xcompiler", "-fPIC", f"-I{include}",
           f"-I{jit.kernel_root()}", src, "-o", tmp, f"-L{os.path.dirname(lib)}", f"-l:{os.path.basename(lib)}",
           "-Xlinker", "-rpath", "-Xlinker", os.path.dirname(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE} against {include} failed:\n{res.stdout}{res.stderr}")
    os.replace(tmp, out)
    return out


class HostLib:
    """The compiled glue, loaded (one per process and library)."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.lib = lib = ctypes.CDLL(path or build())
        size_t, vp, cp = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
        for name in ("dgin_requirements_size", "dgin_devcomm_size", "dgin_request_size", "dgin_unique_id_size"):
            getattr(lib, name).restype = size_t
        lib.dgin_requirements.argtypes = [ctypes.POINTER(DginRequest), vp, size_t, cp, size_t]
        lib.dgin_devcomm_create.argtypes = [vp, ctypes.POINTER(DginRequest), vp, size_t, cp, size_t]
        lib.dgin_error_string.restype = cp
        lib.dgin_error_string.argtypes = [ctypes.c_int]
        lib.dgin_last_error.restype, lib.dgin_last_error.argtypes = cp, [vp]
        i32, pvp = ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)
        lib.dgin_get_unique_id.argtypes = [vp]
        lib.dgin_comm_init_rank.argtypes = [pvp, i32, cp, i32]
        lib.dgin_comm_destroy.argtypes = [vp]
        lib.dgin_mem_alloc.argtypes = [pvp, size_t]
        lib.dgin_mem_free.argtypes = [vp]
        lib.dgin_window_register.argtypes = [vp, vp, size_t, i32, pvp]
        lib.dgin_window_deregister.argtypes = [vp, vp]
        lib.dgin_devcomm_destroy.argtypes = [vp, vp]
        lib.dgin_devcomm_info.argtypes = [vp, ctypes.POINTER(i32)]
        if lib.dgin_request_size() != ctypes.sizeof(DginRequest):
            raise RuntimeError(f"{SOURCE}'s DginRequest is {lib.dgin_request_size()} bytes, the mirror "
                               f"{ctypes.sizeof(DginRequest)}")
        self.header_version = lib.dgin_header_version()

    def runtime_version(self) -> int:
        v = ctypes.c_int(0)
        rc = self.lib.dgin_runtime_version(ctypes.byref(v))
        if rc != 0:
            raise RuntimeError(f"ncclGetVersion failed: {self.error(rc)}")
        return v.value

    def check_versions(self) -> int:
        """The loaded library's version; RuntimeError if the headers compiled against differ."""
        runtime = self.runtime_version()
        if runtime != self.header_version:
            raise RuntimeError(f"the NCCL headers used are version {self.header_version}, the loaded libnccl is "
                               f"{runtime}: the device API needs the loaded library's own headers")
        return runtime

    def error(self, rc: int) -> str:
        return f"{rc} ({self.lib.dgin_error_string(rc).decode()})" if rc > 0 else str(rc)

    def requirements(self, request: Request) -> Tuple[bytes, Dict[str, int]]:
        """ncclDevCommRequirements for `request` as this version builds them: (bytes, the fields set)."""
        size = self.lib.dgin_requirements_size()
        out = ctypes.create_string_buffer(size)
        desc = ctypes.create_string_buffer(512)
        req = request.struct()
        rc = self.lib.dgin_requirements(ctypes.byref(req), out, size, desc, len(desc))
        if rc != 0:
            raise ValueError(f"NCCL {self.header_version} cannot serve {request}: {desc.value.decode()}")
        fields = dict(kv.split("=") for kv in desc.value.decode().split(";"))
        return out.raw, {k: int(v) for k, v in fields.items()}
