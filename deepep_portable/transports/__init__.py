"""Transports: the backends, which of them can run here and why not (one table: registry.py).

Each backend lives in its own module or folder (reference.py; nvlink/, nvshmem/, each with its window);
kernel.py is what the kernel-running ones share, probe.py answers for each, system.py and libraries.py
say what the machine has."""
from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Dict, Type

from ..contract import BufferContext, Capabilities, Transport, TransportStatus
from . import probe, registry
from .registry import TRANSPORT_NAMES


def available_transports() -> Dict[str, TransportStatus]:
    """For every transport: can it be used in this process, and if not, the exact reason."""
    out = {}
    for name in TRANSPORT_NAMES:
        status = probe.probe(name)
        try:
            caps = backend_class(name).capabilities.as_dict()
        except Exception:   # no backend in this build (or it does not import): the reason says why
            caps = {}
        out[name] = replace(status, capabilities=caps)
    return out


def resolve(name: str, single_node: bool = False, internode_normal: bool = False) -> str:
    """Map a requested transport (or "auto") to a usable one, or raise with the reason.

    "auto": when every rank of the group is on one node (`single_node`, the caller knows) and the
    `nvlink` transport is usable, it wins: its load/store kernels are the ones measured fastest there
    (docs/PERFORMANCE.md); otherwise the first usable backend of the registry that can span nodes.
    `internode_normal` (normal mode over several nodes): the first usable of internode_normal_transports()."""
    statuses = available_transports()
    if name == "auto" and internode_normal:
        name = next((n for n in internode_normal_transports() if statuses[n].usable and registry.row(n).in_auto),
                    "reference")
    if name == "auto":
        if single_node and statuses["nvlink"].usable:
            return "nvlink"
        for backend in registry.BACKENDS:
            if (single_node or backend.spans_nodes) and backend.in_auto and statuses[backend.name].usable:
                return backend.name
        raise RuntimeError("no usable transport: " + "; ".join(str(s) for s in statuses.values()))
    registry.row(name)   # ValueError for an unknown name
    status = statuses[name]
    if not status.usable:
        raise RuntimeError(f"transport {name!r} is unavailable: {status.reason}")
    return name


def backend_class(name: str) -> Type[Transport]:
    row = registry.row(name)
    if row.module is None:
        raise RuntimeError(f"transport {name!r} has no backend implementation in this build")
    return getattr(importlib.import_module(row.module, __package__), row.cls)


def internode_normal_transports() -> list:
    """Names of the backends that serve normal-mode ops over several nodes (whether usable here or not)."""
    names = []
    for backend in registry.BACKENDS:
        try:
            if backend.module is not None and backend_class(backend.name).internode_normal:
                names.append(backend.name)
        except Exception:   # a backend that does not import here is not one
            pass
    return names


__all__ = ["BufferContext", "Capabilities", "Transport", "TransportStatus", "TRANSPORT_NAMES", "available_transports",
           "resolve", "backend_class", "internode_normal_transports"]
