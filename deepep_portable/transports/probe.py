"""Capability probing: can each transport run in this process, and if not, exactly why.

`probe(name)` answers for one transport with a `TransportStatus` (usable, reason, details) by calling the probe
its registry row points at (`transports/<name>/probe.py`; the reference transport's is in reference.py). What
the probes share is here: the GPU, CUDA compiler and backend-module checks, and the status record. Every
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
from typing import Dict, List, Optional, Tuple

from ..contract import TransportStatus
from . import libraries, registry, system
from .libraries import nccl_info, nvshmem_info
from .rdma import pyverbs_module


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
# The driver: the row's probe, cached, never raising
# --------------------------------------------------------------------------------------------

def probe(name: str) -> TransportStatus:
    """Whether transport `name` can run in this process, and the exact reason if not (cached until
    registry.changed())."""
    return _probe(name, registry.changes())


@functools.lru_cache(maxsize=None)
def _probe(name: str, _changes: int) -> TransportStatus:
    ref = registry.row(name).probe   # ValueError for an unknown name
    try:
        return registry.entry(ref)()
    except Exception as e:  # a probe bug must not break import or `auto`: report it instead
        return TransportStatus(name, False, f"probe failed: {type(e).__name__}: {e}", {})


def clear_cache() -> None:
    """Forget every cached answer (tests; after installing something in a live process)."""
    for f in (_probe, libraries._ldconfig_cache, nvshmem_info, nccl_info, pyverbs_module):
        f.cache_clear()
    system.clear_cache()


__all__ = ["probe", "clear_cache"]
