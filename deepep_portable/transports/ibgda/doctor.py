"""The `ibgda` backend's section of `python -m deepep_portable doctor` (its registry row's `doctor`): which GID it
would use on each RDMA port (options from the environment) and, per GPU, the RDMA devices by PCIe distance (the
ones it would pick first). Lines only; nothing here raises for a missing piece."""
from __future__ import annotations

from typing import List

from .. import rdma, system
from . import roce


def gid_choice(port) -> str:
    """Which GID the ibgda backend would use on this port (options from the environment), or why none."""
    try:
        index, gid, why = roce.pick_gid(port, roce.ibgda_options())
        return f"ibgda would use gid[{index}] {gid}: {why}"
    except ValueError as e:
        return f"ibgda: {e}"


def closest_nics(devs) -> List[str]:
    """Per GPU, the RDMA devices by PCIe distance (the ones the ibgda backend would pick first)."""
    out: List[str] = []
    if not devs:
        return out
    for g in system.gpu_info() or []:
        gpu_dir = system.gpu_sysfs_dir(g)
        if gpu_dir is None:
            continue
        ranked = roce.rank_nics(gpu_dir, devs, rdma.SYSFS_INFINIBAND)
        nics = ", ".join(f"{name} {roce.DISTANCE_NAMES[d].split()[0]}" for d, name in ranked)
        out.append(f"GPU {g.get('index', '?')} ({g.get('pci_bus_id')}), closest RDMA devices first: {nics}")
    return out


def doctor() -> List[str]:
    devs, _ = rdma.rdma_devices()
    if not devs:
        return ["no RDMA device: no GID or NIC to choose (the RDMA devices section says why)"]
    return [f"{d['name']}:{p['port']}: {gid_choice(p)}" for d in devs for p in d["ports"]] + closest_nics(devs)
