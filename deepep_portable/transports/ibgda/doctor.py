"""The `ibgda` backend's section of `python -m deepep_portable doctor` (its registry row's `doctor`): which GID it
would use on each RDMA port (options from the environment) and, per GPU, the RDMA devices by PCIe distance (the
ones it would pick first). Lines only; nothing here raises for a missing piece."""
from __future__ import annotations

from typing import Dict, List

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


# The options doctor --cluster compares between ranks (and against each port).
CLUSTER_SETTINGS = ("gid_index", "address_family", "traffic_class", "service_level", "hop_limit", "udp_sport_base",
                    "doorbell", "multi_port")


def network_settings(env) -> Dict:
    """The network settings ibgda would use, from the environment (doctor --cluster: the row's network_settings);
    {"error": ...} where the environment is invalid."""
    try:
        o = roce.ibgda_options(environ=env)
    except ValueError as e:
        return {"error": str(e)}
    out = {k: getattr(o, k) for k in CLUSTER_SETTINGS}
    out["hca_list"] = ",".join(o.hca_list) if o.hca_list else None
    return out
