"""RDMA devices as the probes and `doctor` see them: sysfs first (always readable), pyverbs where
it imports (Debian's python3-pyverbs is built for the system Python only). Also what any RDMA user reads from
those records: a port's kind and RoCE v2 GIDs (`is_roce`, `routable_v2`, `gid_text`) and the PCIe distance
between a GPU and each NIC (`nic_distance`, `rank_nics`), shared by the backends and `doctor --cluster`."""
from __future__ import annotations

import functools
import ipaddress
import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .libraries import _run

SYSFS_INFINIBAND = "/sys/class/infiniband"


def read_text(path: str) -> Optional[str]:
    """A sysfs / procfs file's text, stripped; None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def rdma_devices_sysfs(root: str = SYSFS_INFINIBAND) -> List[Dict]:
    """RDMA devices from sysfs: name, driver, fw, node_guid and per port: state, phys_state,
    link_layer, rate, non-zero GIDs (with type "RoCE v2"/"IB/RoCE v1" and netdev where known)."""
    if not os.path.isdir(root):
        return []
    devs = []
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        drv = os.path.realpath(os.path.join(d, "device", "driver"))
        dev = {"name": name,
               "driver": os.path.basename(drv) if os.path.exists(os.path.join(d, "device", "driver")) else None,
               "hca_type": read_text(os.path.join(d, "hca_type")),
               "fw_ver": read_text(os.path.join(d, "fw_ver")),
               "node_guid": read_text(os.path.join(d, "node_guid")),
               "ports": []}
        pdir = os.path.join(d, "ports")
        ports = sorted(os.listdir(pdir), key=lambda s: int(s) if s.isdigit() else 0) \
            if os.path.isdir(pdir) else []
        for p in ports:
            pp = os.path.join(pdir, p)
            gids = []
            gdir = os.path.join(pp, "gids")
            if os.path.isdir(gdir):
                for idx in sorted(os.listdir(gdir), key=lambda s: int(s) if s.isdigit() else 0):
                    g = read_text(os.path.join(gdir, idx))
                    if not g or set(g.replace(":", "")) <= {"0"}:
                        continue
                    gids.append({"index": int(idx) if idx.isdigit() else idx, "gid": g,
                                 "type": read_text(os.path.join(pp, "gid_attrs", "types", idx)),
                                 "netdev": read_text(os.path.join(pp, "gid_attrs", "ndevs", idx))})
            dev["ports"].append({"port": int(p) if p.isdigit() else p,
                                 "state": read_text(os.path.join(pp, "state")),
                                 "phys_state": read_text(os.path.join(pp, "phys_state")),
                                 "link_layer": read_text(os.path.join(pp, "link_layer")),
                                 "rate": read_text(os.path.join(pp, "rate")),
                                 "gids": gids})
        devs.append(dev)
    return devs


def is_mlx5(dev: Dict) -> bool:
    return dev.get("driver") == "mlx5_core" or str(dev.get("name", "")).startswith("mlx5") or \
        str(dev.get("hca_type") or "").upper().startswith("MT4")


@functools.lru_cache(maxsize=None)
def pyverbs_module():
    """(pyverbs.device module, "") or (None, why not importable)."""
    try:
        import pyverbs.device as pvd  # type: ignore
        return pvd, ""
    except Exception as e:
        first = f"{type(e).__name__}: {e}"
    sysdir = "/usr/lib/python3/dist-packages"
    if not os.path.isdir(os.path.join(sysdir, "pyverbs")):
        return None, f"pyverbs not importable: {first} (and no {sysdir}/pyverbs)"
    # Debian's python3-pyverbs is built for the system python: only try it with the same X.Y.
    sys_py = None
    for cand in ("/usr/bin/python3",):
        if os.path.exists(cand):
            rc, out = _run([cand, "-c", "import sys;print('%d.%d'%sys.version_info[:2])"])
            sys_py = out.strip() if rc == 0 else None
    ours = "%d.%d" % sys.version_info[:2]
    if sys_py != ours:
        return None, (f"pyverbs not importable: {first}; {sysdir}/pyverbs is built for the system "
                      f"python {sys_py}, this is python {ours}")
    saved = list(sys.path)
    try:
        sys.path = saved + [sysdir]
        import pyverbs.device as pvd  # type: ignore
        return pvd, ""
    except Exception as e:
        return None, f"pyverbs not importable: {type(e).__name__}: {e} (with {sysdir} on sys.path)"
    finally:
        sys.path = saved


def _rdma_devices_pyverbs(pvd) -> List[Dict]:
    try:
        devlist = pvd.get_device_list()
    except Exception as e:
        if not os.path.isdir(SYSFS_INFINIBAND):
            return []  # libibverbs fails the list when the class dir is absent: that is "none"
        raise RuntimeError(f"get_device_list failed: {e}")
    out = []
    for dv in devlist:
        name = dv.name.decode() if isinstance(dv.name, bytes) else str(dv.name)
        entry = {"name": name, "ports": []}
        ctx = pvd.Context(name=name)
        try:
            nports = ctx.query_device().phys_port_cnt
            for p in range(1, nports + 1):
                pa = ctx.query_port(p)
                gids = []
                for i in range(pa.gid_tbl_len):
                    try:
                        g = str(ctx.query_gid(p, i))
                    except Exception:
                        continue
                    if g and set(g.replace(":", "")) > {"0"}:
                        try:
                            gtype = pvd.translate_gid_type(ctx.query_gid_type(p, i))
                        except Exception:
                            gtype = None
                        gids.append({"index": i, "gid": g, "type": gtype, "netdev": None})
                entry["ports"].append({"port": p, "state": pvd.port_state_to_str(pa.state),
                                       "phys_state": pvd.phys_state_to_str(pa.phys_state),
                                       "link_layer": pvd.translate_link_layer(pa.link_layer),
                                       "rate": None, "gids": gids})
        finally:
            ctx.close()
        out.append(entry)
    return out


def rdma_devices() -> Tuple[List[Dict], str]:
    """(devices, source): via pyverbs when importable (enriched with sysfs driver/fw/netdev),
    else sysfs. `source` says which, and why pyverbs was not used."""
    pvd, why = pyverbs_module()
    sysfs = rdma_devices_sysfs()
    if pvd is None:
        return sysfs, f"sysfs {SYSFS_INFINIBAND} ({why})"
    try:
        devs = _rdma_devices_pyverbs(pvd)
    except Exception as e:
        return sysfs, f"sysfs {SYSFS_INFINIBAND} (pyverbs query failed: {type(e).__name__}: {e})"
    by_name = {d["name"]: d for d in sysfs}
    for d in devs:
        s = by_name.get(d["name"], {})
        for k in ("driver", "hca_type", "fw_ver", "node_guid"):
            d[k] = s.get(k)
        sports = {p["port"]: p for p in s.get("ports", [])}
        for p in d["ports"]:
            sp = sports.get(p["port"], {})
            p["rate"] = sp.get("rate")
            snet = {g["index"]: g for g in sp.get("gids", [])}
            for g in p["gids"]:
                g["netdev"] = snet.get(g["index"], {}).get("netdev")
    return devs, "pyverbs"


# ---- ports and GIDs (rdma_devices_sysfs's port records) ---------------------------------------------------
def is_roce(port: Mapping) -> bool:
    """An Ethernet (RoCE) port, as opposed to InfiniBand."""
    return str(port.get("link_layer") or "").lower() == "ethernet"


def routable_v2(g: Mapping) -> bool:
    """A RoCE v2 GID that routes: not zero, not link-local (fe80::)."""
    gid = str(g.get("gid") or "").lower()
    return str(g.get("type") or "").strip().lower() == "roce v2" and not gid.startswith("fe80") \
        and set(gid.replace(":", "")) > {"0"}


def gid_text(gid: str) -> str:
    """A GID as people write it: ::ffff:10.0.0.1, fe80::1."""
    try:
        a = ipaddress.IPv6Address(gid)
    except ValueError:
        return gid
    return f"::ffff:{a.ipv4_mapped}" if a.ipv4_mapped else a.compressed


# ---- PCIe distance between a GPU and the NICs ---------------------------------------------------------------
# Distance classes, closest first (NCCL's / nvidia-smi topo's words).
PIX, PXB, PHB, SYS = 0, 1, 2, 3
DISTANCE_NAMES = {PIX: "PIX (same PCIe switch)", PXB: "PXB (several switches)", PHB: "PHB (same host bridge)",
                  SYS: "SYS (other root complex / socket)"}


def _pci_chain(sysfs_device: str) -> List[str]:
    """The PCI path of a sysfs device directory: its realpath's components from the root complex down."""
    parts = os.path.realpath(sysfs_device).split(os.sep)
    return [p for p in parts if p.startswith("pci") or (p.count(":") == 2 and "." in p)]


def nic_distance(gpu_device_dir: str, nic_device_dir: str) -> int:
    """PIX / PXB / PHB / SYS between two PCI devices (their sysfs `device` directories)."""
    a, b = _pci_chain(gpu_device_dir), _pci_chain(nic_device_dir)
    if not a or not b or a[0] != b[0]:
        return SYS
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    below_root = shared - 1   # bridges both devices share below the root complex
    if below_root <= 0:
        return PHB
    # siblings under one switch port (their chains differ only in the last two components) share a switch
    return PIX if len(a) - shared <= 2 and len(b) - shared <= 2 else PXB


def rank_nics(gpu_device_dir: str, nics: Sequence[Mapping], sysfs_infiniband: str) -> List[Tuple[int, str]]:
    """[(distance, name)] of the RDMA devices `nics` (rdma_devices_sysfs records), closest first, ties by name."""
    out = []
    for dev in nics:
        out.append((nic_distance(gpu_device_dir, os.path.join(sysfs_infiniband, dev["name"], "device")), dev["name"]))
    return sorted(out)
