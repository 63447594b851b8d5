"""RDMA devices as the probes and `doctor` see them: sysfs first (always readable), pyverbs where
it imports (Debian's python3-pyverbs is built for the system Python only)."""
from __future__ import annotations

import functools
import os
import sys
from typing import Dict, List, Optional, Tuple

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
