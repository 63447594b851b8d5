"""Whether the `nvlink` backend can run in this process, and exactly why not (its registry row's `probe`;
transports/probe.py calls it, caches the answer and turns an exception into a reason). Never raises for a missing
piece: every "no" is a reason string naming what was looked at."""
from __future__ import annotations

import os
from typing import Dict, List

from ...contract import TransportStatus
from ..probe import _backend_check, _gpu_check, _nvcc_check, _status


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
        from ... import _C  # noqa: F401
    except Exception as e:
        problems.append(f"host module deepep_portable._C not importable: {type(e).__name__}: {e}")
    _nvcc_check("the kernels", details, problems)
    if not problems:
        backend = _backend_check("nvlink", None)
        if backend:
            problems.append(backend)
    return _status("nvlink", problems, "load/store of peer-mapped memory between ranks of one node", details)
