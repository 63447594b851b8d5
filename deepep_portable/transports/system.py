"""What this machine has, as the CUDA driver and nvidia-smi see it: the driver (opened with ctypes,
independent of how torch was built), the GPUs and the links between them. Used by the transport probes
(probe.py), `doctor` and the NVSHMEM runtime (which needs the primary context); nothing here raises for a
missing driver or tool: the answers carry the reason.

open_libcuda() is the library's one loader of the CUDA driver: deepep_portable._C (driver_entry_points)
and the ibgda glue call through the entry points it resolves and never open the driver themselves."""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

from .libraries import _run

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


LIBCUDA_ENV = "DEEPEP_PORTABLE_LIBCUDA"


def libcuda_path() -> str:
    """The CUDA driver library the library opens: DEEPEP_PORTABLE_LIBCUDA, else libcuda.so.1."""
    return os.environ.get(LIBCUDA_ENV) or "libcuda.so.1"


@functools.lru_cache(maxsize=None)
def _open_libcuda(path: str) -> Tuple[Optional[ctypes.CDLL], str]:
    try:
        return ctypes.CDLL(path), ""   # dlopen(path, RTLD_NOW | RTLD_LOCAL); ctypes never closes it
    except OSError as e:
        return None, str(e)


def open_libcuda() -> Tuple[Optional[ctypes.CDLL], str]:
    """(the CUDA driver library at libcuda_path(), opened, not initialised, "") or (None, the loader's error): the
    library's one loader of the driver; nothing else opens it. deepep_portable._C takes its entry points from here
    when it is imported (driver_entry_points), the probes and NVSHMEM's context set-up call through it, and the
    ibgda glue takes its entry points from it too (devx_glue.py)."""
    return _open_libcuda(libcuda_path())


def _not_opened(path: str, why: str) -> str:
    return f"{path} not found ({why})"


def entry_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of the symbol `name` (exactly that name, e.g. "cuMemAlloc_v2": a dlsym) in `lib`, 0 if it has
    none."""
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except AttributeError:
        return 0


def driver_entry_points(names: Sequence[str]) -> Tuple[str, Optional[List[int]], str]:
    """What deepep_portable._C, which never opens the driver itself, calls through: (libcuda_path(), the address of
    each of `names` in open_libcuda()'s library, 0 where it has none, "") or (libcuda_path(), None, why it could not
    be opened: the reason libcuda() gives too). _C asks once, as it is imported, and keeps the answer for the life
    of the process; cuInit is left to its first use."""
    path = libcuda_path()
    lib, why = open_libcuda()
    if lib is None:
        return path, None, _not_opened(path, why)
    return path, [entry_address(lib, str(n)) for n in names], ""


@functools.lru_cache(maxsize=None)
def libcuda() -> Tuple[Optional[ctypes.CDLL], str]:
    """(initialised libcuda handle with >= 1 device, "") or (None or lib, reason)."""
    path = libcuda_path()
    lib, why = open_libcuda()
    if lib is None:
        return None, _not_opened(path, why)
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

    Asks deepep_portable._C.driver_status() when the host module imports (it calls through the driver
    open_libcuda() opened), else the CUDA driver directly through ctypes (independent of how torch was
    built), else torch."""
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
        lib, why = libcuda()
    except Exception as e:  # pragma: no cover - ctypes trouble: let torch answer
        fallback = f"ctypes probe failed: {type(e).__name__}: {e}"
    else:
        src = f"ctypes {libcuda_path()} (deepep_portable._C unavailable: {c_error})"
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


def parse_topology(text: str) -> Dict[str, Dict[str, str]]:
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
        lib, why = libcuda()
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
        links = parse_topology(text)
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


def gpu_sysfs_dir(gpu: Dict) -> Optional[str]:
    """The sysfs PCI directory of a gpu_info() record (where its PCIe path to NICs is read), or None."""
    bus = gpu.get("pci_bus_id")
    path = f"/sys/bus/pci/devices/{bus}" if bus else None
    return path if path and os.path.exists(path) else None


# ---- the primary context (NVSHMEM initialises in the calling thread's current context) -------------

class DriverUnavailable(RuntimeError):
    """No usable CUDA driver in this process; the message says why."""


def _driver():
    """The initialised libcuda handle, or DriverUnavailable with the reason."""
    lib, why = libcuda()
    if lib is None:
        raise DriverUnavailable(why)
    return lib


def _cu(lib, fn: str, *args) -> None:
    rc = getattr(lib, fn)(*args)
    if rc != 0:
        raise RuntimeError(f"{fn} failed with CUresult {rc}")


def _primary_release(lib, dev: int) -> None:
    fn = getattr(lib, "cuDevicePrimaryCtxRelease_v2", None) or lib.cuDevicePrimaryCtxRelease
    fn(ctypes.c_int(dev))


def ensure_primary_context(device: int) -> bool:
    """Make sure `device`'s primary context is current on this thread. True when this call made it
    current (and holds a retain the caller releases with release_primary_context), False when it
    already was. Raises RuntimeError when another context is current."""
    lib = _driver()
    dev = ctypes.c_int()
    _cu(lib, "cuDeviceGet", ctypes.byref(dev), ctypes.c_int(int(device)))
    primary = ctypes.c_void_p()
    _cu(lib, "cuDevicePrimaryCtxRetain", ctypes.byref(primary), dev)
    current = ctypes.c_void_p()
    _cu(lib, "cuCtxGetCurrent", ctypes.byref(current))
    if not current.value:
        _cu(lib, "cuCtxSetCurrent", primary)
        return True  # keep the retain while we rely on the context
    _primary_release(lib, dev.value)
    if current.value != primary.value:
        raise RuntimeError(f"the CUDA context current on this thread is not device {device}'s primary context; "
                           "NVSHMEM and the kernels must share it (torch.cuda.set_device(device) before "
                           "creating NvshmemRuntime)")
    return False


def release_primary_context(device: int) -> None:
    lib = _driver()
    dev = ctypes.c_int()
    _cu(lib, "cuDeviceGet", ctypes.byref(dev), ctypes.c_int(int(device)))
    _primary_release(lib, dev.value)


def clear_cache() -> None:
    """Forget every cached answer (tests; after a driver or tool appeared in a live process)."""
    for f in (_open_libcuda, libcuda, driver_status, _gpu_info_cached, nvidia_smi_topology):
        f.cache_clear()
