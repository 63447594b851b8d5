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

import functools
import importlib
import os
from typing import Dict, List, Optional, Tuple

from ..contract import TransportStatus
from . import libraries, registry, system
from .libraries import _load_lib, _nccl_version_tuple, _searched_text, nccl_info, nvshmem_info
from .rdma import SYSFS_INFINIBAND, is_mlx5, pyverbs_module, rdma_devices_sysfs

NVSHMEM_MIN_CC = (7, 0)
NCCL_GIN_MIN_VERSION = (2, 28, 7)   # GIN arrived in 2.28.7 (2.28.3 had the device API with LSA only)


def _gpu_check(min_cc: Optional[Tuple[int, int]] = None, what: str = "") -> Optional[str]:
    """None when a GPU (of at least min_cc) is there, else the reason."""
    ok, reason, _ = system.driver_status()
    if not ok:
        return reason
    if min_cc is None:
        return None
    gpus = system.gpu_info()
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
    """None when the registry's module of backend `name` exists and imports, else the reason."""
    row = registry.row(name)
    prefix = f"libraries found at {libs_where} but " if libs_where else ""
    if row.module is None:
        return f"{prefix}the {name} backend is not implemented in this build yet"
    try:
        importlib.import_module(row.module, __package__)
    except Exception as e:
        return (f"{prefix}the {name} backend module {__package__}{row.module} failed to import: "
                f"{type(e).__name__}: {e}")
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
    if problems:   # each reason once (two checks can meet the same missing piece)
        return TransportStatus(name, False, "; ".join(dict.fromkeys(problems)), details)
    return TransportStatus(name, True, ok_reason, details)


# --------------------------------------------------------------------------------------------
# The probes
# --------------------------------------------------------------------------------------------

def probe_reference() -> TransportStatus:
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


def probe_nvshmem() -> TransportStatus:
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


def probe_nccl_gin() -> TransportStatus:
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
        need = ".".join(map(str, NCCL_GIN_MIN_VERSION))
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
        elif info["version"] is not None and info.get("header_version_code") != info["version_code"]:
            header = info.get("header_version_code")
            problems.append(f"the NCCL headers next to {info['device_header']} are version "
                            f"{'.'.join(map(str, _nccl_version_tuple(header))) if header else 'unknown'}, the "
                            f"library {info['lib']} is {info['version']}: GIN kernels must be compiled against the "
                            "loaded library's headers (set NCCL_HOME to one installation)")
            lib_ok = False
        if lib_ok:
            libs_where = f"{info['lib']} (NCCL {info['version']}, {info['device_header']})"
    backend = _backend_check("nccl_gin", libs_where)
    if backend:
        problems.append(backend)
    return _status("nccl_gin", problems, f"NCCL {details.get('version')} GIN", details)


def probe_ibgda(sysfs_root: str = SYSFS_INFINIBAND) -> TransportStatus:
    problems: List[str] = []
    details: Dict = {}
    from .ibgda import provider

    if provider.installed() is not None:   # the tests' NIC model (ibgda/provider.py): no NIC needed
        gpu = _gpu_check()
        _nvcc_check("ibgda", details, problems)
        backend = _backend_check("ibgda", None)
        problems += [p for p in (gpu, backend) if p]
        return _status("ibgda", problems, "ibgda over an installed NIC provider (tests)", details)
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
    if len(libs) == 2 and not problems:   # only where a NIC could use it: the DevX glue builds (compiler, headers)
        from .ibgda.devx_glue import glue_status

        glue_ok, glue_why = glue_status()
        details["devx_glue"] = glue_why
        if not glue_ok:
            problems.append(f"the mlx5 DevX glue cannot be built: {glue_why}")
    backend = _backend_check("ibgda", ", ".join(libs) if len(libs) == 2 and not problems else None)
    if backend:
        problems.append(backend)
    return _status("ibgda", problems, "mlx5 IBGDA on " + details.get("active_mlx5_ports", "?") +
                   " (never run on a real NIC: docs/IBGDA.md)",
                   details)


def probe_nvlink() -> TransportStatus:
    """Intranode kernels over peer-mapped memory (VMM or CUDA IPC): a GPU (sm_80+), the host module and a CUDA
    compiler for the JIT. Whether every rank of a group shares one node is checked when a Buffer is made."""
    problems: List[str] = []
    ll = os.environ.get("DEEPEP_PORTABLE_LL_KERNELS", "1") != "0"
    details: Dict = {"low_latency_ops": "low-latency kernels over peer-mapped memory" if ll else
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
    return _status("nvlink", problems, "load/store of peer-mapped memory between ranks of one node", details)


def probe(name: str) -> TransportStatus:
    """Whether transport `name` can run in this process, and the exact reason if not (cached until
    registry.changed())."""
    return _probe(name, registry.changes())


@functools.lru_cache(maxsize=None)
def _probe(name: str, _changes: int) -> TransportStatus:
    fn = globals()[registry.row(name).probe]   # ValueError for an unknown name
    try:
        return fn()
    except Exception as e:  # a probe bug must not break import or `auto`: report it instead
        return TransportStatus(name, False, f"probe failed: {type(e).__name__}: {e}", {})


def clear_cache() -> None:
    """Forget every cached answer (tests; after installing something in a live process)."""
    for f in (_probe, libraries._ldconfig_cache, nvshmem_info, nccl_info, pyverbs_module):
        f.cache_clear()
    system.clear_cache()


__all__ = ["probe", "probe_reference", "probe_nvshmem", "probe_nccl_gin", "probe_ibgda", "probe_nvlink",
           "clear_cache"]
