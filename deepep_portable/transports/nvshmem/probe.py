"""Whether the `nvshmem` backend can run in this process, and exactly why not (its registry row's `probe`;
transports/probe.py calls it, caches the answer and turns an exception into a reason). Never raises for a missing
piece: every "no" is a reason string naming what was looked at."""
from __future__ import annotations

import os
from typing import Dict, List

from ...contract import TransportStatus
from ..libraries import _searched_text, nvshmem_info
from ..probe import _backend_check, _gpu_check, _nvcc_check, _status

NVSHMEM_MIN_CC = (7, 0)


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
