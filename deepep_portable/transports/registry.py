"""The list of backends: one row each. Everything that needs to know which backends exist reads this
table (`available_transports`, `resolve`, `Buffer(transport=...)`, the probes, `doctor`), so a new
backend is its folders (csrc/backends/<name>/, transports/<name>/), its probe function and one row here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Backend:
    name: str
    module: Optional[str]     # its Transport class's module, relative to this package (None: not built yet)
    cls: Optional[str]        # the Transport class in that module
    probe: str                # its probe function in transports/probe.py (never raises: reasons, not exceptions)
    spans_nodes: bool         # can serve ranks on several nodes ("auto" skips it otherwise)
    in_auto: bool = True      # "auto" may pick it (False: asked for by name only, e.g. not run at several ranks yet)
    rdma: bool = False        # reaches other machines by RDMA through a NIC (doctor --cluster tests it between nodes)
    verified_hardware: str = ""        # where it has run for real, in words (Buffer.transport_info, doctor)
    ran_on_hardware: bool = False      # it has run on real hardware at all ("auto" warns when it picks one that has not)
    ran_across_machines: bool = False  # its path between machines has run over a real network (same warning)


# In the order transport="auto" prefers them (nvlink first when every rank is on one node: see resolve).
BACKENDS: Tuple[Backend, ...] = (
    Backend("nvshmem", ".nvshmem.transport", "NvshmemTransport", "probe_nvshmem", spans_nodes=True, rdma=True,
            verified_hardware="one GPU shared by ranks (H200); never between machines", ran_on_hardware=True),
    Backend("nccl_gin", ".nccl_gin.transport", "NcclGinTransport", "probe_nccl_gin", spans_nodes=True, rdma=True,
            in_auto=False,   # run on a GPU at one rank only
            verified_hardware="one rank on a GPU (H200); GIN paths never on a NIC (mock only)", ran_on_hardware=True),
    Backend("ibgda", ".ibgda.transport", "IbgdaTransport", "probe_ibgda", spans_nodes=True, rdma=True,
            verified_hardware="never on a real NIC (NIC model only)"),
    Backend("nvlink", ".nvlink.transport", "NvlinkTransport", "probe_nvlink", spans_nodes=False,
            verified_hardware="one GPU shared by ranks (H200)", ran_on_hardware=True),
    Backend("reference", ".reference", "ReferenceTransport", "probe_reference", spans_nodes=True,
            verified_hardware="CPU (gloo; torch.distributed carries it between machines)", ran_on_hardware=True,
            ran_across_machines=True),
)

BY_NAME: Dict[str, Backend] = {b.name: b for b in BACKENDS}
TRANSPORT_NAMES = [b.name for b in BACKENDS]


def row(name: str) -> Backend:
    """The row of backend `name`; ValueError naming the known ones otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"unknown transport {name!r}; choose one of {['auto'] + TRANSPORT_NAMES}")
    return BY_NAME[name]


# Bumped by whatever changes a probe's answer inside a running process (a test installing the ibgda backend's
# NIC provider): probe.probe() caches per value, so the next call asks again.
_changes = 0


def changed() -> None:
    global _changes
    _changes += 1


def changes() -> int:
    return _changes
