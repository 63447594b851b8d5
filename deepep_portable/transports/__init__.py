"""Transports: the backends, which of them can run here and why not (one table: registry.py).

Each backend lives in its own module or folder (reference.py; nvlink/, nvshmem/, each with its window);
kernel.py is what the kernel-running ones share, probe.py answers for each, system.py and libraries.py
say what the machine has."""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple, Type

from ..contract import BufferContext, Capabilities, Transport, TransportStatus, TransportTable
from . import probe, registry
from .registry import TRANSPORT_NAMES


def available_transports() -> TransportTable:
    """For every transport: can it be used in this process, and if not, the exact reason. A dict of name ->
    TransportStatus that prints as a table."""
    out = TransportTable()
    for name in TRANSPORT_NAMES:
        status = probe.probe(name)
        try:
            caps = backend_class(name).capabilities.as_dict()
        except Exception:   # no backend in this build (or it does not import): the reason says why
            caps = {}
        out[name] = replace(status, capabilities=caps)
    return out


@dataclass(frozen=True)
class Choice:
    """Which backend a Buffer got, and why (`Buffer.transport_info`): `why` it was chosen, `not_chosen` the
    reason each other backend was not, where it has run for real (registry `verified_hardware`), and the
    warning `auto` gave when it picked one that has not run on such hardware (None otherwise)."""

    name: str
    requested: str
    why: str
    not_chosen: Dict[str, str]
    verified_hardware: str
    ran_on_hardware: bool
    warning: Optional[str] = None

    def as_dict(self) -> Dict:
        return {"name": self.name, "requested": self.requested, "why": self.why, "not_chosen": dict(self.not_chosen),
                "verified_hardware": self.verified_hardware, "ran_on_hardware": self.ran_on_hardware,
                "warning": self.warning}


def resolve(name: str, single_node: bool = False, internode_normal: bool = False) -> str:
    """The name `choose` picks (without its warning)."""
    return choose(name, single_node, internode_normal, warn=False).name


def choose(name: str, single_node: bool = False, internode_normal: bool = False, warn: bool = True) -> Choice:
    """Map a requested transport (or "auto") to a usable one, with the reasons, or raise saying what to do.

    "auto": when every rank of the group is on one node (`single_node`, the caller knows) and the
    `nvlink` transport is usable, it wins: its load/store kernels are the ones measured fastest there
    (docs/PERFORMANCE.md); otherwise the first usable backend of the registry that can span nodes.
    `internode_normal` (normal mode over several nodes): the first usable of internode_normal_transports().
    When "auto" picks a backend that has not run on real hardware (or, for ranks on several machines, whose
    path between machines has not), `warn` gives a RuntimeWarning at the caller's line outside this package."""
    statuses = available_transports()
    if name != "auto":
        row = registry.row(name)   # ValueError for an unknown name
        if not statuses[name].usable:
            raise RuntimeError(_unavailable(name, statuses, single_node, internode_normal))
        return Choice(name, name, f"asked for by name (transport={name!r})", {}, row.verified_hardware,
                      row.ran_on_hardware)
    picked, why = _auto(statuses, single_node, internode_normal)
    if picked is None:
        raise RuntimeError("no usable transport: " + _grouped_reasons(statuses) + ". " + WHAT_TO_DO + ".")
    row = registry.row(picked)
    internode = internode_normal_transports() if internode_normal else []
    not_chosen = {n: _why_not(n, statuses[n], picked, single_node, internode_normal, internode)
                  for n in TRANSPORT_NAMES if n != picked}
    warning = _unproven(row, single_node)
    if warning and warn:
        warnings.warn(warning, RuntimeWarning, stacklevel=_caller_level())
    return Choice(picked, "auto", why, not_chosen, row.verified_hardware, row.ran_on_hardware, warning)


WHAT_TO_DO = "Run `python -m deepep_portable doctor` to see what each transport needs"


def _auto(statuses: Dict[str, TransportStatus], single_node: bool, internode_normal: bool
          ) -> Tuple[Optional[str], str]:
    """(the backend "auto" picks, why), or (None, "") when none is usable."""
    if internode_normal:
        for n in internode_normal_transports():
            if statuses[n].usable and registry.row(n).in_auto:
                return n, ("normal mode over several nodes; the first usable backend with internode "
                           "kernels, in the registry's order")
        if statuses["reference"].usable:
            return "reference", ("normal mode over several nodes and no backend with internode kernels is "
                                 "usable: the reference transport serves it")
        return None, ""
    if single_node and statuses["nvlink"].usable:
        return "nvlink", ("every rank is on one machine and nvlink is usable; its load/store kernels are "
                          "the fastest there")
    for backend in registry.BACKENDS:
        if (single_node or backend.spans_nodes) and backend.in_auto and statuses[backend.name].usable:
            where = "on one machine" if single_node else "spanning machines"
            return backend.name, (f"the first usable backend, in the registry's order, for ranks {where}")
    return None, ""


def _why_not(name: str, status: TransportStatus, picked: str, single_node: bool, internode_normal: bool,
             internode: List[str]) -> str:
    row = registry.row(name)
    if not status.usable:
        return f"unusable: {status.reason}"
    if not row.in_auto:
        return f"auto leaves it to be asked for by name (it has run on: {row.verified_hardware})"
    if internode_normal and name not in internode:
        return "it has no kernels for the normal mode over several nodes"
    if not single_node and not row.spans_nodes:
        return "it serves the ranks of one machine only, and these ranks span machines"
    return f"usable, but auto prefers {picked!r} here"


def _unproven(row: registry.Backend, single_node: bool) -> Optional[str]:
    """The warning for "auto" picking `row`, or None when it has run where it is about to run."""
    if not row.ran_on_hardware:
        return (f"transport='auto' chose {row.name!r}, which has never run on real hardware ({row.verified_hardware}); "
                "check its results against transport='reference', and see `python -m deepep_portable doctor --cluster`")
    if not single_node and not row.ran_across_machines:
        return (f"transport='auto' chose {row.name!r} for ranks on several machines; its path between machines has "
                f"never run on real hardware (it has run on: {row.verified_hardware}); check its results against "
                "transport='reference', and see `python -m deepep_portable doctor --cluster`")
    return None


def _caller_level() -> int:
    """warnings.warn's stacklevel, seen from choose(), of the first frame outside this package."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    level, frame = 2, sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        level, frame = level + 1, frame.f_back
    return level


def _grouped_reasons(statuses: Dict[str, TransportStatus]) -> str:
    """Every unusable transport's reason, each reason once ("a, b: <reason>; c: <other reason>")."""
    by_reason: Dict[str, List[str]] = {}
    for n, s in statuses.items():
        if not s.usable:
            by_reason.setdefault(s.reason, []).append(n)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


def _unavailable(name: str, statuses: Dict[str, TransportStatus], single_node: bool, internode_normal: bool) -> str:
    """The error for a named transport that cannot run here: its reason (once), and what to do."""
    picked, _ = _auto(statuses, single_node, internode_normal)
    auto = (f"transport='auto' would use {picked!r} here" if picked is not None else
            "transport='auto' finds no usable transport here either")
    return (f"transport {name!r} is unavailable: {statuses[name].reason}. Try transport='auto' ({auto}). "
            + WHAT_TO_DO + ".")


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
           "Choice", "choose", "resolve", "backend_class", "internode_normal_transports"]
