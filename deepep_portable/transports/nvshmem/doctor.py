"""The `nvshmem` backend's section of `python -m deepep_portable doctor` (its registry row's `doctor`): the NVSHMEM
host and device libraries on disk and the pip wheels. Lines only; never raises for a missing piece."""
from __future__ import annotations

import os
from typing import Dict, List

from .. import libraries


def doctor() -> List[str]:
    def kv(key: str, value) -> str:
        return f"{key + ':':22s} {value}"

    s = libraries.nvshmem_info()
    if s["host_lib"]:
        out = [kv("NVSHMEM", f"{s.get('version') or 'version unknown: ' + str(s.get('version_error'))} "
                             f"at {s['host_lib']}"),
               kv("device library", ", ".join(os.path.basename(p) for p in s["device_libs"])
                  or "not found; searched " + ", ".join(s["device_searched"]))]
    else:
        out = [kv("NVSHMEM", "libnvshmem_host.so.3 not found; searched " + ", ".join(s["searched"]))]
    return out + [kv(f"  pip {dist}", ver) for dist, ver in s["pip"].items()]


def network_settings(env) -> Dict:
    """The network settings NVSHMEM would use, from the environment (doctor --cluster: the row's network_settings)."""
    from .runtime import PASS_THROUGH as NVSHMEM

    return libraries.library_settings(
        env, {"gid_index": NVSHMEM["ib_gid_index"], "traffic_class": NVSHMEM["ib_traffic_class"],
              "service_level": NVSHMEM["ib_sl"], "hca_list": NVSHMEM["hca_list"]}, NVSHMEM["ibgda"],
        "NVSHMEM releases that default to index 0")
