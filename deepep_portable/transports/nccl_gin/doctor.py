"""The `nccl_gin` backend's section of `python -m deepep_portable doctor` (its registry row's `doctor`): the NCCL
library on disk, its device header, the pip wheels, and torch's own NCCL. Lines only; never raises for a missing
piece."""
from __future__ import annotations

from typing import Dict, List

from .. import libraries


def doctor() -> List[str]:
    def kv(key: str, value) -> str:
        return f"{key + ':':22s} {value}"

    n = libraries.nccl_info()
    if n["lib"]:
        out = [kv("NCCL", f"{n['version'] or 'version unknown: ' + str(n.get('version_error'))} at {n['lib']}"),
               kv("nccl_device.h", n["device_header"] or "not found")]
    else:
        out = [kv("NCCL", "libnccl.so.2 not found; searched " + ", ".join(n["searched"]))]
    out += [kv(f"  pip {dist}", ver) for dist, ver in n["pip"].items()]
    try:
        import torch
        if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
            out.append(kv("torch's NCCL", ".".join(map(str, torch.cuda.nccl.version()))))
    except Exception:
        pass
    return out


def network_settings(env) -> Dict:
    """The network settings NCCL would use, from the environment (doctor --cluster: the row's network_settings)."""
    from .options import PASS_THROUGH as NCCL

    return libraries.library_settings(
        env, {"gid_index": NCCL["ib_gid_index"][0], "traffic_class": NCCL["ib_traffic_class"][0],
              "service_level": NCCL["ib_sl"][0], "hca_list": NCCL["hca_list"][0]})
