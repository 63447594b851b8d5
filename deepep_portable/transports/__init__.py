"""Transport registry: which backends exist, whether each can run here, and why not."""
from __future__ import annotations

from typing import Dict, List, Type

from ..contract import BufferContext, Capabilities, Transport, TransportStatus

# Preference order for transport="auto": the first usable one wins.
# "nvlink" (intranode CUDA IPC, no library needed) is ours, beside DESIGN.md's four.
TRANSPORT_NAMES: List[str] = ["nvshmem", "nccl_gin", "ibgda", "nvlink", "reference"]


def available_transports() -> Dict[str, TransportStatus]:
    """For every transport: can it be used in this process, and if not, the exact reason."""
    from dataclasses import replace

    from . import probe

    out = {}
    for name in TRANSPORT_NAMES:
        status = probe.probe(name)
        try:
            caps = backend_class(name).capabilities.as_dict()
        except Exception:   # no backend in this build (or it does not import): the reason says why
            caps = {}
        out[name] = replace(status, capabilities=caps)
    return out


def resolve(name: str, single_node: bool = False) -> str:
    """Map a requested transport (or "auto") to a usable one, or raise with the reason.

    "auto": when every rank of the group is on one node (`single_node`, the caller knows) and the
    `nvlink` transport is usable, it wins: its load/store kernels are the ones measured fastest there
    (docs/PERFORMANCE.md); otherwise the first usable of TRANSPORT_NAMES that can span nodes."""
    statuses = available_transports()
    if name == "auto":
        if single_node and statuses["nvlink"].usable:
            return "nvlink"
        for candidate in TRANSPORT_NAMES:
            if candidate == "nvlink" and not single_node:
                continue   # CUDA IPC cannot reach another node
            if statuses[candidate].usable:
                return candidate
        raise RuntimeError("no usable transport: " + "; ".join(str(s) for s in statuses.values()))
    if name not in statuses:
        raise ValueError(f"unknown transport {name!r}; choose one of {['auto'] + TRANSPORT_NAMES}")
    status = statuses[name]
    if not status.usable:
        raise RuntimeError(f"transport {name!r} is unavailable: {status.reason}")
    return name


def backend_class(name: str) -> Type[Transport]:
    if name == "reference":
        from .reference import ReferenceTransport

        return ReferenceTransport
    if name == "nvlink":
        from .nvlink import NvlinkTransport

        return NvlinkTransport
    if name == "nvshmem":
        from .nvshmem import NvshmemTransport

        return NvshmemTransport
    raise RuntimeError(f"transport {name!r} has no backend implementation in this build")


__all__ = ["BufferContext", "Capabilities", "Transport", "TransportStatus", "TRANSPORT_NAMES",
           "available_transports", "resolve", "backend_class"]
