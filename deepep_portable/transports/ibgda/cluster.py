"""The `ibgda` backend's findings in `python -m deepep_portable doctor --cluster` (its registry row's
`cluster_findings`): its options from the environment, the GID it would use on each RDMA port, whether the driver
lets the GPU ring the NIC's doorbell, and the rails its channels would spread over. Plain (level, subject, text,
todo) tuples, asked at each part of a rank's findings (registry.CLUSTER_PARTS); nothing here raises for a missing
piece."""
from __future__ import annotations

from typing import List, Mapping, Tuple

from .. import rdma
from . import roce

Found = Tuple[str, str, str, str]


def _options_error(facts: Mapping) -> List[Found]:
    ib = (facts.get("settings") or {}).get("ibgda") or {}
    if "error" not in ib:
        return []
    return [("FAIL", "ibgda options", ib["error"], f"fix the {roce.ENV_PREFIX}* variable it names")]


def _gid(ib: Mapping, where: str, port: Mapping, v2) -> List[Found]:
    """The GID ibgda would use on this ACTIVE port: a FAIL when none will do, a WARN when a RoCE port has routable
    RoCE v2 GIDs and the one picked is not one of them."""
    netdev = port.get("netdev") or "its netdev"
    try:
        idx, gid, why = roce.pick_gid(port, roce.ibgda_options(
            {k: ib.get(k) for k in ("gid_index", "address_family")}, environ={}))
    except ValueError as e:
        return [("FAIL", where, f"ibgda: {e}", (f"configure an IP address on {netdev}, or set "
                 if rdma.is_roce(port) else "check the port's GID table (ibv_devinfo -v), or set ")
                 + f"{roce.ENV_PREFIX}GID_INDEX to a valid index")]
    if rdma.is_roce(port) and v2 and not any(g["index"] == idx for g in v2):
        return [("WARN", where, f"ibgda uses gid[{idx}] {rdma.gid_text(gid)}, not a routable RoCE v2 GID ({why})",
                 f"set {roce.ENV_PREFIX}GID_INDEX to a RoCE v2 index of this port: "
                 + ", ".join(str(g["index"]) for g in v2))]
    return []


def _doorbell(ib: Mapping, context: Mapping) -> List[Found]:
    """Without PeerMappingOverride=1 the GPU doorbell is usually refused: a FAIL when it is the only one allowed."""
    if not context.get("has_nic") or context.get("peer_mapping_override"):
        return []
    gpu_only = ib.get("doorbell") == "gpu"
    return [("FAIL" if gpu_only else "WARN", "ibgda doorbell",
             ("doorbell='gpu', but " if gpu_only else "") + "without PeerMappingOverride=1 the driver usually refuses "
             "to map the NIC's doorbell page into the GPU" + ("" if gpu_only else ": ibgda then has a host thread ring "
                                                              "it (slower)"),
             context.get("todo", "") + (f"; or set {roce.ENV_PREFIX}DOORBELL=auto" if gpu_only else ""))]


def _rails(ib: Mapping, context: Mapping) -> List[Found]:
    """The (device, port) rails this rank's channels would use, and a WARN when hca_list puts them farther from the
    GPU than the closest NIC with an active port."""
    ranked, best = context.get("ranked") or [], context.get("best")
    try:
        rails = roce.choose_rails(context.get("nics") or [], roce.ibgda_options(
            {k: ib.get(k) for k in ("hca_list", "multi_port")}, environ={}), context.get("gpu_dir"),
            context.get("infiniband") or rdma.SYSFS_INFINIBAND)
    except ValueError as e:
        return [("FAIL", "ibgda rails", str(e), f"bring a port up, or fix {roce.ENV_PREFIX}HCA_LIST / ibgda_options "
                 "hca_list")]
    out: List[Found] = []
    far = sorted({d for d, _ in rails} - {r["name"] for r in ranked if best and r["code"] <= best["code"]})
    if far and best and ib.get("hca_list"):
        out.append(("WARN", "ibgda rails", f"hca_list puts channels on {', '.join(far)}, farther from the GPU than "
                    f"{best['name']}", f"check {roce.ENV_PREFIX}HCA_LIST / ibgda_options hca_list"))
    out.append(("NOTE", "ibgda rails", "channels spread over " + ", ".join(f"{d}:{p}" for d, p in rails), ""))
    return out


def findings(part: str, facts: Mapping, context: Mapping) -> List[Found]:
    """This backend's findings at one part of a rank's findings (registry.CLUSTER_PARTS says what each gets)."""
    if part == "rank":
        return _options_error(facts)
    ib = (facts.get("settings") or {}).get("ibgda") or {}
    if "error" in ib:   # the "rank" part's FAIL says why: nothing else can be judged
        return []
    if part == "port":
        return _gid(ib, context["where"], context["port"], context.get("routable_v2") or [])
    if part == "driver":
        return _doorbell(ib, context)
    if part == "affinity":
        return _rails(ib, context)
    return []
