"""Addressing choices for the ibgda backend's RC QPs, decided on the host from sysfs and the user's
options (facts: shared/research/IBGDA.md §3):

- `IbgdaOptions` / `ibgda_options()`: `Buffer(..., ibgda_options={...})` and their environment defaults,
  validated by name and range before anything is set up.
- `pick_gid()`: the local GID of a port. InfiniBand: index 0 unless overridden. RoCE: RoCE v2 before
  v1, an IPv4-mapped address (`::ffff:a.b.c.d`) before a global IPv6 one (or the reverse with
  address_family="ipv6"), never a zero or link-local (`fe80::`) GID (a link-local RoCE v2 GID is the
  classic "modify_qp 110 / retry exceeded" misconfiguration), lowest index on ties.
- `udp_sport()`: RoCE v2 UDP source port per QP. DevX QPs get no kernel hash, and one fixed port (what
  NVSHMEM uses) pins every QP to one ECMP path and one LAG port: ours hash (local QPN, remote QPN,
  channel) into 0xC000-0xFFFF, or count up from a given base.
- `rank_nics()` (rdma.py's, as are `nic_distance()` and the distance classes) / `spread_channels()`: NICs by
  PCIe distance to the GPU, and channels spread round-robin over the (device, port) rails of the closest NICs.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, fields
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..rdma import DISTANCE_NAMES, PHB, PIX, PXB, SYS, nic_distance, rank_nics  # noqa: F401 (this module's names too)

ENV_PREFIX = "DEEPEP_PORTABLE_IB_"


@dataclass(frozen=True)
class IbgdaOptions:
    gid_index: Optional[int] = None          # local GID index; None: pick_gid() chooses
    address_family: str = "ipv4"             # RoCE: prefer IPv4-mapped ("ipv4") or global IPv6 ("ipv6") GIDs
    traffic_class: int = 0                   # 0-255: DSCP = tc >> 2, ECN bits = tc & 3 (e.g. 106: DSCP 26, ECT0)
    service_level: int = 0                   # 0-15: IB SL; RoCE priority (PCP) = sl & 7
    hop_limit: int = 255                     # RoCE IPv4 TTL / IPv6 hop limit
    udp_sport_base: Optional[int] = None     # None: hashed per QP; else base + channel, within 0xC000-0xFFFF
    hca_list: Optional[Tuple[str, ...]] = None   # NICs to use ("mlx5_0", "mlx5_1:1"); None: the closest to the GPU
    multi_port: bool = True                  # spread channels over every up port of the chosen NICs
    doorbell: str = "auto"                   # "gpu": the GPU rings the UAR; "cpu": a host thread does (devx.py);
    #                                          "auto": gpu, else cpu where the driver refuses the GPU mapping


_RANGES = {"traffic_class": (0, 255), "service_level": (0, 15), "hop_limit": (1, 255), "gid_index": (0, 1 << 16),
           "udp_sport_base": (0xC000, 0xFFFF)}


def _parse(name: str, value):
    if name == "hca_list":
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"ibgda option hca_list must be device names like 'mlx5_0' or 'mlx5_1:1', got {value!r}")
        return tuple(value)
    if name == "address_family":
        if value not in ("ipv4", "ipv6"):
            raise ValueError(f"ibgda option address_family must be 'ipv4' or 'ipv6', got {value!r}")
        return value
    if name == "doorbell":
        if value not in ("auto", "gpu", "cpu"):
            raise ValueError(f"ibgda option doorbell must be 'auto', 'gpu' or 'cpu', got {value!r}")
        return value
    if name == "multi_port":
        if isinstance(value, str):
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"ibgda option multi_port must be a bool, got {value!r}")
            return value.lower() in ("1", "true")
        return bool(value)
    try:
        number = int(value, 0) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"ibgda option {name} must be an integer, got {value!r}") from None
    if isinstance(number, bool) or not isinstance(number, int):
        raise ValueError(f"ibgda option {name} must be an integer, got {value!r}")
    lo, hi = _RANGES[name]
    if not lo <= number <= hi:
        raise ValueError(f"ibgda option {name}={number} is outside [{lo}, {hi}]")
    return number


def ibgda_options(user: Optional[Mapping] = None, environ: Optional[Mapping[str, str]] = None) -> IbgdaOptions:
    """The options of one Buffer: `user` (Buffer(..., ibgda_options=...)) over the environment
    (DEEPEP_PORTABLE_IB_<NAME>, e.g. DEEPEP_PORTABLE_IB_GID_INDEX=3) over the defaults."""
    environ = os.environ if environ is None else environ
    names = [f.name for f in fields(IbgdaOptions)]
    unknown = sorted(set(user or {}) - set(names))
    if unknown:
        raise ValueError(f"unknown ibgda option(s) {unknown}; known: {names}")
    values: Dict = {}
    for name in names:
        env = environ.get(ENV_PREFIX + name.upper())
        if env is not None and env != "":
            values[name] = _parse(name, env)
        if user and name in user and user[name] is not None:
            values[name] = _parse(name, user[name])
    return IbgdaOptions(**values)


def validate_options(options: Mapping) -> IbgdaOptions:
    """The registry's options schema of this backend: `Buffer(transport_options=...)` over the environment, parsed
    before any set-up (ibgda_options' ValueErrors)."""
    return ibgda_options(options)


# ---- GIDs ------------------------------------------------------------------------------------------
def _gid_address(gid: str) -> Optional[ipaddress.IPv6Address]:
    try:
        return ipaddress.IPv6Address(gid)
    except ValueError:
        return None


def pick_gid(port: Mapping, options: IbgdaOptions = IbgdaOptions()) -> Tuple[int, str, str]:
    """(index, gid, why) of the GID to use on `port` (rdma.rdma_devices_sysfs's port record: link_layer
    and gids with index, gid, type). Raises ValueError naming the port's GIDs when none will do."""
    gids = list(port.get("gids") or [])
    listing = ", ".join(f"{g['index']}={g['gid']} ({g.get('type')})" for g in gids) or "none"
    if options.gid_index is not None:
        for g in gids:
            if g["index"] == options.gid_index:
                return g["index"], g["gid"], f"gid_index={options.gid_index} given"
        raise ValueError(f"gid_index={options.gid_index} is not a valid GID of port {port.get('port')} "
                         f"(its GIDs: {listing})")
    if str(port.get("link_layer", "")).lower() != "ethernet":   # InfiniBand: the port's default GID
        for g in gids:
            if g["index"] == 0:
                return 0, g["gid"], "InfiniBand: the default GID"
        raise ValueError(f"InfiniBand port {port.get('port')} has no GID 0 (its GIDs: {listing})")
    best = None
    for g in gids:
        addr = _gid_address(g["gid"])
        if addr is None or addr.is_unspecified or addr.is_link_local:
            continue
        v2 = str(g.get("type") or "").strip().lower() == "roce v2"
        ipv4 = addr.ipv4_mapped is not None
        family_match = ipv4 == (options.address_family == "ipv4")
        score = (v2, family_match, -int(g["index"]))
        if best is None or score > best[0]:
            best = (score, g, v2, ipv4)
    if best is None:
        raise ValueError(f"RoCE port {port.get('port')} has no usable GID (zero and link-local fe80:: GIDs do not "
                         f"route; its GIDs: {listing}); configure an IP address on its netdev or pass gid_index")
    _, g, v2, ipv4 = best
    return g["index"], g["gid"], f"RoCE {'v2' if v2 else 'v1'}, {'IPv4-mapped' if ipv4 else 'IPv6'}, lowest such index"


# ---- UDP source ports ------------------------------------------------------------------------------
def udp_sport(local_qpn: int, remote_qpn: int, channel: int, base: Optional[int] = None) -> int:
    """The RoCE v2 UDP source port of one QP: base + channel when a base is given (it must stay <= 0xFFFF),
    else 0xC000 | a 14-bit hash of (local QPN, remote QPN, channel): distinct QPs land on distinct ECMP
    paths with high probability, the same QP always on the same one."""
    if base is not None:
        port = base + channel
        if not 0xC000 <= port <= 0xFFFF:
            raise ValueError(f"udp_sport_base {base:#x} + channel {channel} leaves 0xC000-0xFFFF")
        return port
    h = 0x811C9DC5   # FNV-1a over the three 32-bit values
    for v in (local_qpn, remote_qpn, channel):
        for shift in (0, 8, 16, 24):
            h = ((h ^ ((v >> shift) & 0xFF)) * 0x01000193) & 0xFFFFFFFF
    return 0xC000 | ((h ^ (h >> 14) ^ (h >> 28)) & 0x3FFF)


# ---- NICs and channels -----------------------------------------------------------------------------
# PCIe distance (PIX, PXB, PHB, SYS) and the NICs ranked by it: shared with doctor --cluster, in rdma.py.


def spread_channels(num_channels: int, rails: Sequence[Tuple[str, int]]) -> List[Tuple[str, int]]:
    """The rail (device, port) of each channel: channel c uses rails[c % len(rails)], so consecutive
    channels (a warp's neighbours, a node pair's chunks) alternate ports and NICs."""
    if not rails:
        raise ValueError("no usable (device, port): every chosen NIC port is down or filtered out")
    return [tuple(rails[c % len(rails)]) for c in range(num_channels)]


def _is_active(port: Mapping) -> bool:
    return str(port.get("state") or "").endswith("ACTIVE")


def choose_rails(devices: Sequence[Mapping], options: IbgdaOptions = IbgdaOptions(),
                 gpu_device_dir: Optional[str] = None, sysfs_infiniband: str = "/sys/class/infiniband"
                 ) -> List[Tuple[str, int]]:
    """The (device, port) rails a GPU's channels use (spread_channels then spreads channels over them).

    `devices`: rdma.rdma_devices_sysfs records. With `hca_list`, exactly its entries ("mlx5_0": every active
    port of it; "mlx5_1:1": that port), in its order; else the mlx5 devices closest to the GPU by PCIe distance
    (all of the closest distance class, by name; every mlx5 device when the GPU's sysfs directory is unknown).
    Only ACTIVE ports; with multi_port False, one (the first active) port per device. Raises ValueError naming
    what was found when nothing is usable."""
    by_name = {d["name"]: d for d in devices}
    found = ", ".join(f"{d['name']}:{p['port']} {p.get('state')}" for d in devices for p in d.get("ports", [])) \
        or "no RDMA device"
    rails: List[Tuple[str, int]] = []
    if options.hca_list:
        for entry in options.hca_list:
            name, _, port = entry.partition(":")
            dev = by_name.get(name)
            if dev is None:
                raise ValueError(f"hca_list names {name!r}, which is not an RDMA device here ({found})")
            ports = [p for p in dev.get("ports", []) if _is_active(p) and (not port or str(p["port"]) == port)]
            if port and not ports:
                raise ValueError(f"hca_list entry {entry!r}: that port is not ACTIVE ({found})")
            rails += [(name, int(p["port"])) for p in (ports if options.multi_port or port else ports[:1])]
    else:
        mlx5 = [d for d in devices if str(d.get("driver") or "").startswith("mlx5") or d["name"].startswith("mlx5")]
        usable = [d for d in mlx5 if any(_is_active(p) for p in d.get("ports", []))]
        if usable and gpu_device_dir and os.path.exists(gpu_device_dir):
            ranked = rank_nics(gpu_device_dir, usable, sysfs_infiniband)
            closest = ranked[0][0]
            usable = [by_name[name] for dist, name in ranked if dist == closest]
        for dev in usable:
            ports = [p for p in dev.get("ports", []) if _is_active(p)]
            rails += [(dev["name"], int(p["port"])) for p in (ports if options.multi_port else ports[:1])]
    if not rails:
        raise ValueError(f"no ACTIVE mlx5 port to use ({found})")
    return rails
