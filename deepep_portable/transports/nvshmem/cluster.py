"""The `nvshmem` backend's findings in `python -m deepep_portable doctor --cluster` (its registry row's
`cluster_findings`): whether the NVIDIA driver's parameters allow NVSHMEM's IBGDA (GPU-initiated) path. Plain
(level, subject, text, todo) tuples (registry.CLUSTER_PARTS); nothing here raises for a missing piece."""
from __future__ import annotations

from typing import List, Mapping, Tuple


def findings(part: str, facts: Mapping, context: Mapping) -> List[Tuple[str, str, str, str]]:
    """At the "driver" part, when the driver lacks what IBGDA needs: a FAIL if NVSHMEM_IB_ENABLE_IBGDA is on (its
    network settings' gpu_initiated), else a NOTE (its default CPU proxy does not need them)."""
    missing = list(context.get("missing") or [])
    if part != "driver" or not missing:
        return []
    if ((facts.get("settings") or {}).get("nvshmem") or {}).get("gpu_initiated"):
        return [("FAIL", "NVSHMEM IBGDA", "NVSHMEM_IB_ENABLE_IBGDA is on but the driver lacks " + ", ".join(missing),
                 context.get("todo", ""))]
    return [("NOTE", "NVSHMEM IBGDA", "NVSHMEM's IBGDA (nvshmem_options ibgda=True) would need " + ", ".join(missing)
             + "; its default CPU proxy does not", context.get("todo", ""))]
