"""Whether the `ibgda` backend can run in this process, and exactly why not (its registry row's `probe`;
transports/probe.py calls it, caches the answer and turns an exception into a reason). Never raises for a missing
piece: every "no" is a reason string naming what was looked at."""
from __future__ import annotations

import os
from typing import Dict, List

from ...contract import TransportStatus
from ..libraries import _load_lib
from ..probe import _backend_check, _gpu_check, _nvcc_check, _status
from ..rdma import SYSFS_INFINIBAND, is_mlx5, pyverbs_module, rdma_devices_sysfs


def probe_ibgda(sysfs_root: str = SYSFS_INFINIBAND) -> TransportStatus:
    problems: List[str] = []
    details: Dict = {}
    from . import provider

    if provider.installed() is not None:   # the tests' NIC model (ibgda/provider.py): no NIC needed
        gpu = _gpu_check()
        _nvcc_check("ibgda", details, problems)
        backend = _backend_check("ibgda", None)
        problems += [p for p in (gpu, backend) if p]
        return _status("ibgda", problems, "ibgda over an installed NIC provider (tests)", details)
    devs = rdma_devices_sysfs(sysfs_root)
    if not devs:
        why = "directory does not exist" if not os.path.isdir(sysfs_root) else "directory is empty"
        problems.append(f"no RDMA device in {sysfs_root} ({why})")
    else:
        details["rdma_devices"] = ",".join(
            f"{d['name']}[{d.get('driver')}]" for d in devs)
        mlx5 = [d for d in devs if is_mlx5(d)]
        if not mlx5:
            problems.append("no mlx5 RDMA device (IBGDA writes mlx5 WQEs); found: "
                            + ", ".join(f"{d['name']} (driver {d.get('driver')})" for d in devs))
        else:
            active = [f"{d['name']}:{p['port']}" for d in mlx5 for p in d["ports"]
                      if str(p.get("state") or "").endswith("ACTIVE")]
            details["active_mlx5_ports"] = ",".join(active) or "none"
            if not active:
                problems.append("no mlx5 port is ACTIVE: " + ", ".join(
                    f"{d['name']}:{p['port']} {p.get('state')}" for d in mlx5 for p in d["ports"]))
    pvd, why = pyverbs_module()
    details["pyverbs"] = "importable" if pvd is not None else why
    libs = []
    for soname in ("libibverbs.so.1", "libmlx5.so.1"):
        path, err = _load_lib(soname)
        if path is None:
            problems.append(f"{soname} not loadable ({err}); install rdma-core / libibverbs")
        else:
            details[soname] = path
            libs.append(path)
    gpu = _gpu_check()
    if gpu:
        problems.append(gpu)
    details["nvidia_peermem_loaded"] = str(os.path.isdir("/sys/module/nvidia_peermem"))
    if len(libs) == 2 and not problems:   # only where a NIC could use it: the DevX glue builds (compiler, headers)
        from .devx_glue import glue_status

        glue_ok, glue_why = glue_status()
        details["devx_glue"] = glue_why
        if not glue_ok:
            problems.append(f"the mlx5 DevX glue cannot be built: {glue_why}")
    backend = _backend_check("ibgda", ", ".join(libs) if len(libs) == 2 and not problems else None)
    if backend:
        problems.append(backend)
    return _status("ibgda", problems, "mlx5 IBGDA on " + details.get("active_mlx5_ports", "?") +
                   " (never run on a real NIC: docs/IBGDA.md)",
                   details)
