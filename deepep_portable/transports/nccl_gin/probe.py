"""Whether the `nccl_gin` backend can run in this process, and exactly why not (its registry row's `probe`;
transports/probe.py calls it, caches the answer and turns an exception into a reason). Never raises for a missing
piece: every "no" is a reason string naming what was looked at."""
from __future__ import annotations

from typing import Dict, List

from ...contract import TransportStatus
from ..libraries import _nccl_version_tuple, _searched_text, nccl_info
from ..probe import _backend_check, _gpu_check, _status

NCCL_GIN_MIN_VERSION = (2, 28, 7)   # GIN arrived in 2.28.7 (2.28.3 had the device API with LSA only)


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
