"""Capability probing: can each transport run in this process, and if not, exactly why.

`probe(name)` answers for one transport with a `TransportStatus` (usable, reason, details). Every
check looks at the real thing (the driver, the shared libraries on disk, sysfs, the backend module)
and says what it looked at, so a user on a cluster we have never seen can tell what is missing.
Results are cached per process: the machine does not change under a running job.

Nothing here may raise for a missing optional component: a missing library, driver or NIC becomes
a reason string. Optional libraries are never linked; at most they are opened with ctypes
(NCCL and NVSHMEM only to ask their version; neither touches the GPU for that).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import importlib.util
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

from ..contract import TransportStatus
from .libraries import (_ldconfig_cache, _load_lib, _nccl_version_tuple, _run, _searched_text,  # noqa: F401
                        find_library, nccl_info, nvshmem_info)
from .rdma import SYSFS_INFINIBAND, is_mlx5, pyverbs_module, rdma_devices, rdma_devices_sysfs  # noqa: F401

NVSHMEM_MIN_CC = (7, 0)
NCCL_GIN_MIN_VERSION = (2, 28, 0)


# CUDA driver API constants (cuda.h)
_CU_ATTR_SM_COUNT = 16
_CU_ATTR_PCI_BUS_ID = 33
_CU_ATTR_PCI_DEVICE_ID = 34
_CU_ATTR_CC_MAJOR = 75
_CU_ATTR_CC_MINOR = 76
_CU_ATTR_PCI_DOMAIN_ID = 50


# --------------------------------------------------------------------------------------------
# CUDA driver / GPUs
# --------------------------------------------------------------------------------------------

def _cu_error_name(lib, rc: int) -> str:
    try:
        name = ctypes.c_char_p()
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except Exception:  # pragma: no cover - very old driver
        pass
    return f"CUresult {rc}"


@functools.lru_cache(maxsize=None)
def _libcuda() -> Tuple[Optional[ctypes.CDLL], str]:
    """(initialised libcuda handle with >= 1 device, "") or (None or lib, reason)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"libcuda.so.1 not found ({e})"
    rc = lib.cuInit(0)
    if rc != 0:
        return None, f"cuInit failed: {_cu_error_name(lib, rc)}"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return None, f"cuDeviceGetCount failed: {_cu_error_name(lib, rc)}"
    if count.value == 0:
        return None, "cuDeviceGetCount reports 0 devices (CUDA_VISIBLE_DEVICES=" \
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    return lib, ""


@functools.lru_cache(maxsize=None)
def driver_status() -> Tuple[bool, str, str]:
    """(GPU usable, reason if not / summary if so, which check answered).

    Asks deepep_portable._C.driver_status() when the host module imports, else the CUDA driver
    directly through ctypes (independent of how torch was built), else torch."""
    try:
        from .. import _C  # type: ignore[attr-defined]
        fn = _C.driver_status
    except Exception as e:  # ImportError, AttributeError: the host module is optional here
        c_error = f"{type(e).__name__}: {e}"
    else:
        ok, reason = fn()
        reason = str(reason)
        if not ok and not reason.startswith("no CUDA GPU"):
            reason = f"no CUDA GPU: {reason}"
        return bool(ok), reason, "deepep_portable._C.driver_status"
    try:
        lib, why = _libcuda()
    except Exception as e:  # pragma: no cover - ctypes trouble: let torch answer
        fallback = f"ctypes probe failed: {type(e).__name__}: {e}"
    else:
        src = f"ctypes libcuda.so.1 (deepep_portable._C unavailable: {c_error})"
        if lib is not None:
            return True, "CUDA driver initialised, device(s) visible", src
        return False, f"no CUDA GPU: {why}", src
    try:
        import torch
        ok = torch.cuda.is_available()
    except Exception as e:  # pragma: no cover
        return False, f"no CUDA GPU: torch.cuda.is_available() raised {e!r}", fallback
    return ok, ("torch sees a CUDA GPU" if ok else
                "no CUDA GPU: torch.cuda.is_available() is False"), f"torch ({fallback})"


def _uuid_str(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _gpu_info_driver(lib) -> List[Dict]:
    out = []
    count = ctypes.c_int(0)
    lib.cuDeviceGetCount(ctypes.byref(count))
    for i in range(count.value):
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue

        def attr(a: int) -> int:
            v = ctypes.c_int(-1)
            lib.cuDeviceGetAttribute(ctypes.byref(v), a, dev)
            return v.value

        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, dev)
        mem = ctypes.c_size_t(0)
        lib.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
        raw = (ctypes.c_ubyte * 16)()
        fn = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        uuid = _uuid_str(bytes(raw)) if fn(raw, dev) == 0 else ""
        out.append({
            "index": i,
            "name": name.value.decode(errors="replace"),
            "cc": f"{attr(_CU_ATTR_CC_MAJOR)}.{attr(_CU_ATTR_CC_MINOR)}",
            "sms": attr(_CU_ATTR_SM_COUNT),
            "memory_bytes": mem.value,
            "uuid": uuid,
            "pci_bus_id": "%04x:%02x:%02x.0" % (attr(_CU_ATTR_PCI_DOMAIN_ID), attr(_CU_ATTR_PCI_BUS_ID),
                                                attr(_CU_ATTR_PCI_DEVICE_ID)),
            "source": "cuda driver (ctypes)",
        })
    return out


def _gpu_info_torch() -> List[Dict]:
    import torch
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", ""))
        out.append({"index": i, "name": p.name, "cc": f"{p.major}.{p.minor}",
                    "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
                    "uuid": uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}",
                    "source": "torch.cuda"})
    return out


@functools.lru_cache(maxsize=None)
def nvidia_smi_topology() -> Tuple[Optional[str], str]:
    """(`nvidia-smi topo -m` text, "") or (None, why not)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi not found on PATH"
    rc, text = _run([smi, "topo", "-m"])
    if rc != 0:
        return None, f"nvidia-smi topo -m failed (rc={rc}): {text.strip()[:300]}"
    return text, ""


def _parse_topology(text: str) -> Dict[str, Dict[str, str]]:
    """{"GPU0": {"GPU1": "NV18", "NIC0": "SYS", ...}, ...} from `nvidia-smi topo -m`."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in text.splitlines() if ln.strip()]
    if not lines:
        return {}
    header = [c.strip() for c in lines[0].split("\t") if c.strip()]
    peers = [c for c in header if re.match(r"^(GPU|NIC|mlx|NODE)\w*$", c)]
    links: Dict[str, Dict[str, str]] = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.split("\t")]
        if not cells or not re.match(r"^GPU\d+$", cells[0]):
            continue
        vals = cells[1:]
        links[cells[0]] = {p: v for p, v in zip(peers, vals) if p != cells[0]}
    return links


def _smi_uuid_index() -> Dict[str, str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    rc, text = _run([smi, "--query-gpu=index,uuid", "--format=csv,noheader"])
    if rc != 0:
        return {}
    out = {}
    for ln in text.splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) == 2:
            out[parts[1]] = f"GPU{parts[0]}"
    return out


@functools.lru_cache(maxsize=None)
def _gpu_info_cached() -> Tuple[Dict, ...]:
    gpus: List[Dict] = []
    try:
        lib, why = _libcuda()
        if lib is not None:
            gpus = _gpu_info_driver(lib)
    except Exception:
        gpus = []
    if not gpus:
        try:
            gpus = _gpu_info_torch()
        except Exception:
            gpus = []
    text, _ = nvidia_smi_topology() if gpus else (None, "")
    if text:
        links = _parse_topology(text)
        by_uuid = _smi_uuid_index()
        for g in gpus:
            smi_name = by_uuid.get(g.get("uuid", ""))
            if smi_name:
                g["nvidia_smi_name"] = smi_name
                g["links"] = links.get(smi_name, {})
    return tuple(gpus)


def gpu_info() -> List[Dict]:
    """Visible CUDA devices: index, name, cc ("9.0"), sms, memory_bytes, uuid, and, when
    nvidia-smi exists, `links` (this GPU's row of `nvidia-smi topo -m`, keyed by nvidia-smi's
    names, e.g. {"GPU1": "NV18", "NIC0": "PIX"}). Empty without a usable GPU."""
    return [dict(g) for g in _gpu_info_cached()]


def _gpu_check(min_cc: Optional[Tuple[int, int]] = None, what: str = "") -> Optional[str]:
    """None when a GPU (of at least min_cc) is there, else the reason."""
    ok, reason, _ = driver_status()
    if not ok:
        return reason
    if min_cc is None:
        return None
    gpus = gpu_info()
    if not gpus:
        return None  # driver says yes but could not enumerate: do not invent a reason
    low = [g for g in gpus if tuple(int(x) for x in g["cc"].split(".")) < min_cc]
    if low:
        names = ", ".join(f"GPU {g['index']} ({g['name']}) has compute capability {g['cc']}"
                          for g in low)
        return f"{names}; {what} needs >= {min_cc[0]}.{min_cc[1]}"
    return None


# --------------------------------------------------------------------------------------------
# Backend presence
# --------------------------------------------------------------------------------------------

def _backend_check(name: str, libs_where: Optional[str]) -> Optional[str]:
    """None when deepep_portable.transports.<name> exists and imports, else the reason."""
    mod = f"{__package__}.{name}"
    prefix = f"libraries found at {libs_where} but " if libs_where else ""
    try:
        spec = importlib.util.find_spec(mod)
    except Exception:
        spec = None
    if spec is None:
        return f"{prefix}the {name} backend is not implemented in this build yet"
    try:
        importlib.import_module(mod)
    except Exception as e:
        return f"{prefix}the {name} backend module {mod} failed to import: {type(e).__name__}: {e}"
    return None


def _nvcc_check(what: str, details: Dict, problems: List[str]) -> None:
    """The JIT's CUDA compiler into `details`, or why there is none into `problems`."""
    try:
        from .. import jit

        details["nvcc"] = jit.find_nvcc()
    except Exception as e:
        problems.append(f"no CUDA compiler for {what}: {e}")


def _status(name: str, problems: List[str], ok_reason: str, details: Dict) -> TransportStatus:
    details = {k: (v if isinstance(v, str) else str(v)) for k, v in details.items() if v is not None}
    if problems:
        return TransportStatus(name, False, "; ".join(problems), details)
    return TransportStatus(name, True, ok_reason, details)


# --------------------------------------------------------------------------------------------
# The probes
# --------------------------------------------------------------------------------------------

def _probe_reference() -> TransportStatus:
    details: Dict = {}
    problems: List[str] = []
    try:
        import torch
        import torch.distributed as dist
        details["torch"] = torch.__version__
        if not dist.is_available():
            problems.append("torch.distributed is not available in this torch build")
        backends = [b for b, f in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"),
                                   ("mpi", "is_mpi_available")) if getattr(dist, f, lambda: False)()]
        details["process_group_backends"] = ",".join(backends)
        cuda = torch.cuda.is_available()
        details["cuda_visible"] = str(cuda)
        if cuda:
            details["device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # pragma: no cover
        problems.append(f"torch.distributed unusable: {type(e).__name__}: {e}")
    where = f"CUDA device {details['device']}" if "device" in details else "CPU tensors (no CUDA)"
    return _status("reference", problems, f"torch.distributed all_to_all on {where}", details)


def _probe_nvshmem() -> TransportStatus:
    problems: List[str] = []
    details: Dict = {}
    gpu = _gpu_check(NVSHMEM_MIN_CC, "NVSHMEM")
    if gpu:
        problems.append(gpu)
    info = nvshmem_info()
    details.update({f"pip:{k}": v for k, v in info["pip"].items()})
    libs_where = None
    if info["host_lib"] is None:
        problems.append("libnvshmem_host.so.3 not found (searched: "
                        f"{_searched_text(info['searched'])}); pip install nvidia-nvshmem-cu13 "
                        "or set NVSHMEM_HOME")
    else:
        details["host_lib"] = info["host_lib"]
        details["version"] = info.get("version") or f"unknown ({info.get('version_error')})"
        if not info["device_libs"]:
            problems.append(f"libnvshmem_host.so.3 found at {info['host_lib']} but no device library "
                            f"(searched: {_searched_text(info['device_searched'])})")
        else:
            details["device_libs"] = ",".join(info["device_libs"])
            libs_where = os.path.dirname(info["host_lib"])
    _nvcc_check("the device-linked kernels", details, problems)
    backend = _backend_check("nvshmem", libs_where)
    if backend:
        problems.append(backend)
    return _status("nvshmem", problems,
                   f"NVSHMEM {details.get('version')} from {libs_where}", details)


def _probe_nccl_gin() -> TransportStatus:
    problems: List[str] = []
    details: Dict = {}
    gpu = _gpu_check()
    if gpu:
        problems.append(gpu)
    info = nccl_info()
    details.update({f"pip:{k}": v for k, v in info["pip"].items()})
    libs_where = None
    if info["lib"] is None:
        problems.append("libnccl.so.2 not found (searched: "
                        f"{_searched_text(info['searched'])}); pip install nvidia-nccl-cu13 or set "
                        "NCCL_HOME")
    else:
        details["lib"] = info["lib"]
        details["version"] = info["version"] or f"unknown ({info.get('version_error')})"
        details["device_header"] = info["device_header"] or "not found"
        need = ".".join(map(str, NCCL_GIN_MIN_VERSION[:2]))
        lib_ok = True
        if info["version"] is None:
            problems.append(f"could not read the NCCL version of {info['lib']}: "
                            f"{info.get('version_error')}")
            lib_ok = False
        elif _nccl_version_tuple(info["version_code"]) < NCCL_GIN_MIN_VERSION:
            problems.append(f"NCCL {info['version']} at {info['lib']} has no GIN device API "
                            f"(needs >= {need})")
            lib_ok = False
        if info["device_header"] is None:
            problems.append("nccl_device.h not found (searched: "
                            f"{_searched_text(info['header_searched'])}); GIN kernels need it")
            lib_ok = False
        if lib_ok:
            libs_where = f"{info['lib']} (NCCL {info['version']}, {info['device_header']})"
    backend = _backend_check("nccl_gin", libs_where)
    if backend:
        problems.append(backend)
    return _status("nccl_gin", problems, f"NCCL {details.get('version')} GIN", details)


def _probe_ibgda(sysfs_root: str = SYSFS_INFINIBAND) -> TransportStatus:
    problems: List[str] = []
    details: Dict = {}
    devs = rdma_devices_sysfs(sysfs_root)
    if not devs:
        why = "directory does not exist" if not os.path.isdir(sysfs_root) else "directory is empty"
        problems.append(f"no RDMA device in {sysfs_root} ({why})")
    else:
        details["rdma_devices"] = ",".join(
            f"{d['name']}[{d.get('driver')}]" for d in devs)
        mlx5 = [d for d in devs if is_mlx5(d)]
        if not mlx5:
            problems.append("no mlx5 RDMA device (IBGDA writes mlx5 WQEs); found: "
                            + ", ".join(f"{d['name']} (driver {d.get('driver')})" for d in devs))
        else:
            active = [f"{d['name']}:{p['port']}" for d in mlx5 for p in d["ports"]
                      if str(p.get("state") or "").endswith("ACTIVE")]
            details["active_mlx5_ports"] = ",".join(active) or "none"
            if not active:
                problems.append("no mlx5 port is ACTIVE: " + ", ".join(
                    f"{d['name']}:{p['port']} {p.get('state')}" for d in mlx5 for p in d["ports"]))
    pvd, why = pyverbs_module()
    details["pyverbs"] = "importable" if pvd is not None else why
    libs = []
    for soname in ("libibverbs.so.1", "libmlx5.so.1"):
        path, err = _load_lib(soname)
        if path is None:
            problems.append(f"{soname} not loadable ({err}); install rdma-core / libibverbs")
        else:
            details[soname] = path
            libs.append(path)
    gpu = _gpu_check()
    if gpu:
        problems.append(gpu)
    details["nvidia_peermem_loaded"] = str(os.path.isdir("/sys/module/nvidia_peermem"))
    backend = _backend_check("ibgda", ", ".join(libs) if len(libs) == 2 and not problems else None)
    if backend:
        problems.append(backend)
    return _status("ibgda", problems, "mlx5 IBGDA on " + details.get("active_mlx5_ports", "?"),
                   details)


def _probe_nvlink() -> TransportStatus:
    """Intranode kernels over CUDA IPC: a GPU (sm_80+), the host module and a CUDA compiler for
    the JIT. Whether every rank of a group shares one node is checked when a Buffer is made."""
    problems: List[str] = []
    ll = os.environ.get("DEEPEP_PORTABLE_LL_KERNELS", "1") != "0"
    details: Dict = {"low_latency_ops": "low-latency kernels over CUDA IPC" if ll else
                     "reference implementation (DEEPEP_PORTABLE_LL_KERNELS=0)"}
    gpu = _gpu_check((8, 0), "the nvlink kernels")
    if gpu:
        problems.append(gpu)
    try:
        from .. import _C  # noqa: F401
    except Exception as e:
        problems.append(f"host module deepep_portable._C not importable: {type(e).__name__}: {e}")
    _nvcc_check("the kernels", details, problems)
    if not problems:
        backend = _backend_check("nvlink", None)
        if backend:
            problems.append(backend)
    return _status("nvlink", problems, "CUDA IPC load/store between ranks of one node", details)


_PROBES = {"reference": _probe_reference, "nvshmem": _probe_nvshmem, "nvlink": _probe_nvlink,
           "ibgda": _probe_ibgda, "nccl_gin": _probe_nccl_gin}


@functools.lru_cache(maxsize=None)
def probe(name: str) -> TransportStatus:
    """Whether transport `name` can run in this process, and the exact reason if not (cached)."""
    fn = _PROBES.get(name)
    if fn is None:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(_PROBES)}")
    try:
        return fn()
    except Exception as e:  # a probe bug must not break import or `auto`: report it instead
        return TransportStatus(name, False, f"probe failed: {type(e).__name__}: {e}", {})


def clear_cache() -> None:
    """Forget every cached answer (tests; after installing something in a live process)."""
    for f in (probe, driver_status, _libcuda, _gpu_info_cached, nvidia_smi_topology,
              _ldconfig_cache, nvshmem_info, nccl_info, pyverbs_module):
        f.cache_clear()


__all__ = ["probe", "gpu_info", "rdma_devices", "rdma_devices_sysfs", "driver_status",
           "nvshmem_info", "nccl_info", "nvidia_smi_topology", "pyverbs_module", "find_library",
           "clear_cache"]
