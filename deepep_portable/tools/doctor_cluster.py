"""`python -m deepep_portable doctor --cluster`: a preflight of every node, launched like the job (mpirun, srun,
torchrun). Every rank looks at its own machine and GPU; rank 0 prints one report: versions that must match, each
RDMA port (state, link layer, MTU, RoCE v2 GID, the traffic class and service level in effect) and each GPU's
distance to each NIC, findings (every FAIL and WARN says what to do), each transport's usability, and a real round
trip (a small low-latency dispatch and combine, checked bit for bit and timed) between the first ranks of every
pair of nodes over each network transport usable on every rank, the reference transport as a baseline.

`collect_local(root=...)` reads sysfs and procfs under `root` (tests point it at a fake tree); the findings are
pure functions of what was collected. Nothing here raises for a missing piece: a check that cannot look says why.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import hashlib
import os
import platform
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

import torch
import torch.distributed as dist

from ..transports import rdma, registry

FAIL, WARN, NOTE, OK = "FAIL", "WARN", "NOTE", "OK"
_ORDER = {FAIL: 0, WARN: 1, NOTE: 2, OK: 3}
IB_MTUS = (4096, 2048, 1024, 512, 256)
ROCE_HEADERS = 96          # bytes a RoCE v2 packet adds to its RDMA payload (IP, UDP, BTH, extended headers, ICRC)
EXPORT = "export the same value on every rank (mpirun -x NAME, srun --export=ALL, or the job script)"
SAME_SETTINGS = ("gid_index", "address_family", "traffic_class", "service_level", "hop_limit", "udp_sport_base",
                 "doorbell", "multi_port")


@dataclass(frozen=True)
class Finding:
    level: str          # FAIL, WARN, NOTE or OK
    subject: str        # what it is about: "mlx5_0:1", "GPUDirect RDMA", "version of NCCL", ...
    text: str
    todo: str = ""      # what to do (every FAIL and WARN has one)


# ---- what one rank sees -------------------------------------------------------------------------------------
def _path(root: str, *parts: str) -> str:
    return os.path.join(root, *[p.lstrip("/") for p in parts])


def _int(text) -> Optional[int]:
    return int(str(text).strip()) if str(text).strip().lstrip("-").isdigit() else None


def nvidia_params(text: Optional[str]) -> Dict[str, str]:
    """/proc/driver/nvidia/params as {name: value} ("EnableStreamMemOPs": "1", "RegistryDwords": "...")."""
    pairs = (line.partition(":") for line in (text or "").splitlines())
    return {k.strip(): v.strip().strip('"') for k, sep, v in pairs if sep}


def read_machine(root: str = "/") -> Dict:
    """The RDMA devices (rdma.rdma_devices_sysfs, plus PCI path, NUMA node, netdev and its MTU per port, a NIC-wide
    traffic class setting), /dev/infiniband, the kernel modules and the NVIDIA driver's files, all under `root`."""
    ib = _path(root, "sys/class/infiniband")
    nics = rdma.rdma_devices_sysfs(ib)
    for d in nics:
        dev_dir = os.path.join(ib, d["name"], "device")
        d["pci_path"] = os.path.realpath(dev_dir) if os.path.exists(dev_dir) else None
        d["numa_node"] = _int(rdma.read_text(os.path.join(dev_dir, "numa_node")))
        nets = sorted(os.listdir(os.path.join(dev_dir, "net"))) if os.path.isdir(os.path.join(dev_dir, "net")) else []
        for p in d["ports"]:
            netdev = next((g["netdev"] for g in p["gids"] if g.get("netdev")), None) or (nets[0] if nets else None)
            p["netdev"] = netdev
            p["netdev_mtu"] = _int(rdma.read_text(_path(root, "sys/class/net", netdev, "mtu"))) if netdev else None
            p["nic_traffic_class"] = rdma.read_text(os.path.join(ib, d["name"], "tc", str(p["port"]), "traffic_class"))
    return {"infiniband": ib, "infiniband_exists": os.path.isdir(ib), "nics": nics,
            "uverbs": sorted(os.path.basename(p) for p in glob.glob(_path(root, "dev/infiniband/uverbs*"))),
            "modules": {m: os.path.isdir(_path(root, "sys/module", m))
                        for m in ("nvidia", "nvidia_peermem", "nv_peer_mem")},
            "nvidia_version": rdma.read_text(_path(root, "proc/driver/nvidia/version")),
            "nvidia_params": nvidia_params(rdma.read_text(_path(root, "proc/driver/nvidia/params"))),
            "params_path": _path(root, "proc/driver/nvidia/params"),
            "kernel": rdma.read_text(_path(root, "proc/sys/kernel/osrelease"))}


def read_gpu(root: str, bus_id: Optional[str]) -> Dict:
    """A GPU's PCI directory under `root` (sys/bus/pci/devices/<bus id>) and NUMA node."""
    d = _path(root, "sys/bus/pci/devices", bus_id.lower()) if bus_id else None
    found = d is not None and os.path.exists(d)
    return {"bus_id": bus_id, "dir": d if found else None, "searched": d,
            "numa_node": _int(rdma.read_text(os.path.join(d, "numa_node"))) if found else None}


def network_settings(env: Mapping[str, str]) -> Dict[str, Dict]:
    """The network settings each RDMA transport would use, from the environment (its transport_options set the same
    values): {transport: {gid_index, traffic_class, service_level, hca_list, ...}}, None where the library picks;
    {"error": ...} where the environment is invalid. Each backend answers for itself (its row's network_settings)."""
    return {b.name: registry.entry(b.network_settings)(env) for b in registry.BACKENDS if b.network_settings}


def _source_hash() -> str:
    """A hash of the package's Python and kernel sources (two installs of one version can still differ)."""
    from .. import jit

    h, tops = hashlib.sha256(), [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    with contextlib.suppress(jit.JitCompileError):   # without kernel sources the Python ones still tell them apart
        tops.append(jit.kernel_root())
    for top in tops:
        for dirpath, dirnames, files in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "csrc"))   # csrc: its own turn
            for f in sorted(f for f in files if f.endswith((".py", ".cu", ".cuh", ".cc", ".cpp", ".h", ".hpp"))):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(os.path.relpath(os.path.join(dirpath, f), top).encode() + fh.read())
    return h.hexdigest()[:12]


def versions(machine: Mapping) -> Dict[str, str]:
    """What must be the same on every rank: library, Python, torch, CUDA, driver, NCCL, NVSHMEM."""
    from importlib import metadata

    from ..transports import libraries

    try:
        version = metadata.version("deepep_portable")
    except metadata.PackageNotFoundError:   # a source tree on sys.path without an install
        version = "not installed"
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", machine.get("nvidia_version") or "")
    return {"deepep_portable": f"{version} (source {_source_hash()})", "python": platform.python_version(),
            "torch": torch.__version__, "CUDA (torch)": torch.version.cuda or "none (CPU build)",
            "NVIDIA driver": m.group(1) if m else "none", "NCCL": libraries.nccl_info().get("version") or "not found",
            "NVSHMEM": libraries.nvshmem_info().get("version") or "not found"}


def _this_gpu() -> Tuple[Optional[str], Optional[bool]]:
    """(PCI bus id, the driver's CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) of this rank's GPU; None where unknown."""
    import ctypes

    from ..transports import system

    if not torch.cuda.is_available():
        return None, None
    index, gpus = torch.cuda.current_device(), system.gpu_info()
    bus = gpus[index].get("pci_bus_id") if index < len(gpus) else None
    lib, _ = system.libcuda()
    dev, value = ctypes.c_int(), ctypes.c_int(-1)
    if lib is None or lib.cuDeviceGet(ctypes.byref(dev), index) \
            or lib.cuDeviceGetAttribute(ctypes.byref(value), 124, dev):   # 124: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
        return bus, None
    return bus, value.value == 1


def collect_local(root: str = "/", env: Optional[Mapping[str, str]] = None, gpu_bus_id: Optional[str] = "auto",
                  ask_driver: bool = True) -> Dict:
    """Everything this rank contributes to the report (plain data; never raises: a part that fails says why).
    gpu_bus_id "auto": this rank's current CUDA device; ask_driver: query the CUDA driver for dma-buf support."""
    from ..topology import node_identity
    from ..transports import available_transports

    env = os.environ if env is None else env
    facts: Dict = {"host": socket.gethostname(), "node": node_identity(), "errors": []}

    def part(key: str, fn) -> None:
        try:
            facts[key] = fn()
        except Exception as e:   # one broken part must not hide the others
            facts[key] = None
            facts["errors"].append(f"{key}: {type(e).__name__}: {e}")

    part("machine", lambda: read_machine(root))
    part("this_gpu", _this_gpu if ask_driver or gpu_bus_id == "auto" else lambda: (None, None))
    bus, dma_buf = facts.pop("this_gpu") or (None, None)
    facts["dma_buf"] = dma_buf if ask_driver else None
    part("gpu", lambda: read_gpu(root, bus if gpu_bus_id == "auto" else gpu_bus_id))
    part("settings", lambda: network_settings(env))
    part("versions", lambda: versions(facts["machine"] or {}))
    part("transports", lambda: {n: (s.usable, s.reason) for n, s in available_transports().items()})
    return facts


# ---- findings of one rank -----------------------------------------------------------------------------------
def rdma_mtu(netdev_mtu: Optional[int]) -> Optional[int]:
    """The largest RDMA MTU a RoCE port carries over a netdev of this MTU."""
    return next((m for m in IB_MTUS if m + ROCE_HEADERS <= netdev_mtu), None) if netdev_mtu else None


def backend_findings(part: str, facts: Mapping, context: Mapping) -> List[Finding]:
    """What each backend finds at this part of a rank's findings (its registry row's cluster_findings, asked with
    the rank's facts and the part's context: registry.CLUSTER_PARTS), in table order; a backend whose hook fails
    is a FAIL naming it, not a report that stops."""
    out: List[Finding] = []
    for name, hook in registry.hooks("cluster_findings"):
        try:
            out += [Finding(*f) if f[0] in _ORDER else Finding(FAIL, "doctor", f"{name}'s findings: bad level {f!r}",
                                                               "report it with this output")
                    for f in hook(part, facts, context)]
        except Exception as e:
            out.append(Finding(FAIL, "doctor", f"{name}'s findings ({part}): {type(e).__name__}: {e}",
                               "report it with this output"))
    return out


def in_effect(settings: Mapping, key: str, transport: str) -> Optional[int]:
    """A transport's traffic_class / service_level: its setting, else its library's default."""
    s = settings.get(transport) or {}
    return s.get("defaults", {}).get(key) if s.get(key) is None else s[key]


def _port_down(where: str, port: Mapping) -> Finding:
    state, phys, netdev = str(port.get("state")), str(port.get("phys_state")), port.get("netdev") or "its netdev"
    roce = rdma.is_roce(port)
    if "INIT" in state and "LinkUp" in phys:
        todo = "the link is up but no subnet manager configured the port: check the fabric's subnet manager (opensm)"
    elif "Disabled" in phys:
        todo = f"the port is disabled: enable it ({f'ip link set {netdev} up' if roce else 'ibportstate'})"
    elif roce:
        todo = f"bring {netdev} up (ip link set {netdev} up) and check the cable and the switch port"
    else:
        todo = "no link: check the cable and the switch port (ibstat shows the physical state)"
    return Finding(WARN, where, f"port is {state} (physical {phys}, {port.get('link_layer')})",
                   todo + "; or leave it out (ibgda_options hca_list, NVSHMEM_HCA_LIST, NCCL_IB_HCA): only ACTIVE "
                   "ports carry traffic")


def _gid_findings(where: str, port: Mapping, facts: Mapping) -> List[Finding]:
    gids, netdev, out = port.get("gids") or [], port.get("netdev") or "its netdev", []
    settings = facts.get("settings") or {}
    v2 = [g for g in gids if rdma.routable_v2(g)]
    if rdma.is_roce(port) and not v2:
        listing = ", ".join(f"{g['index']}={rdma.gid_text(g['gid'])} ({g.get('type')})" for g in gids) or "none"
        out.append(Finding(FAIL, where, f"no routable RoCE v2 GID (GIDs: {listing})",
                           f"give {netdev} an IPv4 address (each address of the interface adds RoCE v1 and v2 GIDs) "
                           "and check the RoCE mode (rdma link; cma_roce_mode)"))
    out += backend_findings("port", facts, {"where": where, "port": port, "routable_v2": v2})
    if not rdma.is_roce(port) or not v2:
        return out
    for s in [s for s in settings.values() if "vars" in s]:   # the libraries' own GID index variables
        var, idx = s["vars"]["gid_index"], s.get("gid_index")
        g = next((g for g in gids if g["index"] == (0 if idx is None else idx)), None)
        if idx is None and s.get("unset_gid") and (g is None or not rdma.routable_v2(g)):
            out.append(Finding(WARN, where, f"{var} is unset: {s['unset_gid']} use gid[0] "
                               + (f"{rdma.gid_text(g['gid'])} ({g.get('type')})" if g else "(none)") + " here",
                               f"export {var}={v2[0]['index']} (a RoCE v2 GID of this port) on every rank"))
        elif idx is not None and (g is None or not rdma.routable_v2(g)):
            what = "is not a GID of this port" if g is None else \
                f"is {rdma.gid_text(g['gid'])} ({g.get('type')}), not routable RoCE v2"
            out.append(Finding(FAIL, where, f"{var}={idx} {what}", f"export {var}={v2[0]['index']} (a RoCE v2 GID of "
                               "this port)"))
    return out


def _port_findings(name: str, port: Mapping, facts: Mapping) -> List[Finding]:
    where, settings = f"{name}:{port['port']}", facts.get("settings") or {}
    if not str(port.get("state") or "").endswith("ACTIVE"):
        return [_port_down(where, port)]
    out = _gid_findings(where, port, facts)
    if not rdma.is_roce(port):
        return out
    mtu = rdma_mtu(port.get("netdev_mtu"))
    if port.get("netdev_mtu") and (mtu or 0) < 4096:
        out.append(Finding(WARN, where, f"RDMA MTU at most {mtu} ({port.get('netdev')} has MTU {port['netdev_mtu']})",
                           f"raise the MTU of {port.get('netdev')} and of the switch ports to 9000 (at least "
                           f"{4096 + ROCE_HEADERS}) on every host, for 4096-byte RDMA packets"))
    if port.get("nic_traffic_class"):
        out.append(Finding(NOTE, where, f"NIC-wide traffic class setting: {port['nic_traffic_class']} (it overrides "
                           "the class each queue pair asks for)"))
    elif not any(in_effect(settings, "traffic_class", t) for t in settings):
        out.append(Finding(WARN, where, "traffic class 0 (DSCP 0) for every transport: RoCE traffic goes in the "
                           "default class, lossy on most fabrics",
                           "ask the network team which DSCP is lossless (PFC) or ECN-marked and set it for every "
                           "transport: DEEPEP_PORTABLE_IB_TRAFFIC_CLASS, NVSHMEM_IB_TRAFFIC_CLASS, NCCL_IB_TC = "
                           "DSCP * 4 (+ ECN bits), e.g. 106 for DSCP 26"))
    return out


def _gpudirect(machine: Mapping, dma_buf: Optional[bool]) -> Finding:
    peermem = [m for m in ("nvidia_peermem", "nv_peer_mem") if (machine.get("modules") or {}).get(m)]
    text, kernel = machine.get("nvidia_version") or "", machine.get("kernel") or "?"
    k = re.match(r"(\d+)\.(\d+)", kernel)
    new_kernel = bool(k) and (int(k.group(1)), int(k.group(2))) >= (5, 12)
    if dma_buf or peermem:
        return Finding(OK, "GPUDirect RDMA", ", ".join((["dma-buf (the driver reports support)"] if dma_buf else [])
                                                       + [f"{m} loaded" for m in peermem]))
    if dma_buf is None and "Open Kernel Module" in text and new_kernel:
        return Finding(OK, "GPUDirect RDMA", f"dma-buf expected (NVIDIA open kernel modules, Linux {kernel}); the "
                       "round trips below confirm it")
    why = ("the driver reports no dma-buf support" if dma_buf is False else
           f"{'closed' if text else 'unknown'} NVIDIA kernel modules" + ("" if new_kernel else f", Linux {kernel}"))
    return Finding(FAIL, "GPUDirect RDMA", f"no path for the NIC to reach GPU memory: nvidia-peermem is not loaded and "
                   f"dma-buf is unavailable ({why})",
                   "load nvidia-peermem (modprobe nvidia-peermem; persist it in /etc/modules-load.d/), or use NVIDIA's "
                   "open kernel modules on Linux >= 5.12 (dma-buf)")


def _driver_settings(facts: Mapping, has_nic: bool) -> List[Finding]:
    machine = facts.get("machine") or {}
    params = machine.get("nvidia_params") or {}
    if not params:
        return [Finding(NOTE, "NVIDIA driver", f"cannot read {machine.get('params_path')}: driver settings not "
                        "checked")]
    stream_mem_ops = params.get("EnableStreamMemOPs", "").strip() == "1"
    peer_override = re.search(r"PeerMappingOverride\s*=\s*1\b", params.get("RegistryDwords", "")) is not None
    missing = ([] if stream_mem_ops else ["NVreg_EnableStreamMemOPs=1"]) + \
        ([] if peer_override else ['NVreg_RegistryDwords="PeerMappingOverride=1;"'])
    todo = ("add `options nvidia " + " ".join(missing) + "` to /etc/modprobe.d/nvidia.conf, then rebuild the initramfs "
            "and reboot (or reload the nvidia modules)")
    out = [] if missing else [Finding(OK, "NVIDIA driver", "EnableStreamMemOPs=1 and PeerMappingOverride=1 (NVSHMEM's "
                                      "IBGDA, the ibgda GPU doorbell)")]
    return out + backend_findings("driver", facts, {"has_nic": has_nic, "stream_mem_ops": stream_mem_ops,
                                                    "peer_mapping_override": peer_override, "missing": missing,
                                                    "todo": todo})


def affinity(facts: Mapping) -> Tuple[List[Dict], List[Finding]]:
    """This rank's GPU against each NIC, closest first ([{name, distance, numa, code}]), and the findings."""
    machine, gpu, settings = facts.get("machine") or {}, facts.get("gpu") or {}, facts.get("settings") or {}
    nics = machine.get("nics") or []
    if not gpu.get("bus_id"):
        return [], [Finding(NOTE, "GPU", "no GPU on this rank: GPU-NIC affinity not checked")]
    if not gpu.get("dir"):
        return [], [Finding(WARN, "GPU", f"GPU {gpu['bus_id']} not found at {gpu.get('searched')}",
                            "run where the host's /sys is visible (a container needs it mounted)")]
    if not nics:
        return [], []
    numa = {d["name"]: d.get("numa_node") for d in nics}
    up = {d["name"] for d in nics if any(str(p.get("state") or "").endswith("ACTIVE") for p in d["ports"])}
    ranked = [{"name": n, "distance": rdma.DISTANCE_NAMES[c].split()[0], "numa": numa[n], "code": c, "active": n in up}
              for c, n in rdma.rank_nics(gpu["dir"], nics, machine["infiniband"])]
    out: List[Finding] = []
    best = next((r for r in ranked if r["active"]), None)   # no active port at all: the port findings say so
    if best and (best["code"] == rdma.SYS or None not in (best["numa"], gpu.get("numa_node"))
                 and best["numa"] != gpu["numa_node"]):
        closer = ", ".join(f"{r['name']} {r['distance']}" for r in ranked if r["code"] < best["code"])
        out.append(Finding(WARN, f"GPU {gpu['bus_id']}", f"its closest RDMA NIC with an active port, {best['name']}, "
                           f"is {best['distance']} (GPU NUMA node {gpu.get('numa_node')}, NIC {best['numa']}): "
                           "traffic crosses the CPUs' link" + (f" (closer, with no active port: {closer})" if closer
                                                               else ""),
                           "bring the closer NIC's port up, run ranks on the GPUs that share a PCIe switch with a NIC, "
                           "or name each rank's NIC (ibgda hca_list, NVSHMEM_HCA_LIST, NCCL_IB_HCA per local rank)"))
    out += backend_findings("affinity", facts, {"gpu_dir": gpu["dir"], "nics": nics, "ranked": ranked, "best": best,
                                                "infiniband": machine["infiniband"]})
    for transport, s in settings.items():
        listed = [e.lstrip("^=").split(":")[0] for e in str(s.get("hca_list") or "").split(",") if e.strip("^= ")]
        unknown = [n for n in listed if not any(x.startswith(n) for x in numa)]
        if unknown and "vars" in s:
            out.append(Finding(FAIL, transport, f"{s['vars']['hca_list']} names {', '.join(unknown)}, not an RDMA "
                               f"device here ({', '.join(sorted(numa))})", f"fix {s['vars']['hca_list']}"))
    return ranked, out


def local_findings(facts: Mapping, one_machine: bool = False) -> List[Finding]:
    """What is wrong (or worth knowing) on one rank, each FAIL and WARN with what to do. `one_machine`: every rank
    of the job is on this machine (logical nodes), where no traffic needs a NIC, so its absence is only noted."""
    machine, settings = facts.get("machine") or {}, facts.get("settings") or {}
    out = [Finding(FAIL, "doctor", f"could not look at {e}", "report it with this output")
           for e in facts.get("errors", [])]
    out += backend_findings("rank", facts, {})
    nics = machine.get("nics") or []
    no_nic = (f"no RDMA NIC ({machine.get('infiniband', '/sys/class/infiniband')} "
              + ("is empty)" if machine.get("infiniband_exists") else "does not exist)"))
    if not nics and one_machine:
        out.append(Finding(NOTE, "RDMA", no_nic + ": every rank is on this machine, so none is needed; ranks on "
                           "separate hosts need one"))
    elif not nics:
        out.append(Finding(FAIL, "RDMA", no_nic,
                           "install the NIC driver and rdma-core (mlx5_core, ib_uverbs); in a container mount "
                           "/sys/class/infiniband and pass --device=/dev/infiniband. Without a NIC, ranks on different "
                           "hosts can use only the reference transport (TCP)"))
    elif not machine.get("uverbs"):
        out.append(Finding(FAIL, "RDMA", "RDMA NICs in sysfs but no /dev/infiniband/uverbs*: verbs cannot open them",
                           "load ib_uverbs (modprobe ib_uverbs); in a container pass --device=/dev/infiniband"))
    for d in nics:
        for p in d["ports"]:
            out += _port_findings(d["name"], p, facts)
    if (machine.get("modules") or {}).get("nvidia"):
        out += [_gpudirect(machine, facts.get("dma_buf"))] if nics else []
        out += _driver_settings(facts, bool(nics))
    return out + affinity(facts)[1]


# ---- across ranks ------------------------------------------------------------------------------------------
def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: List[List[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _differ(values: Sequence, what: str, todo: str) -> List[Finding]:
    by_value: Dict[str, List[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(str(v), []).append(r)
    return [] if len(by_value) < 2 else [Finding(FAIL, what, "differs between ranks: " + "; ".join(
        f"{v} on ranks {rank_ranges(rs)}" for v, rs in by_value.items()), todo)]


def transport_states(everyone: Sequence[Mapping], name: str) -> Tuple[List[int], Dict[str, List[int]]]:
    """(ranks where transport `name` is usable, {reason: ranks} where it is not)."""
    usable: List[int] = []
    reasons: Dict[str, List[int]] = {}
    for r, e in enumerate(everyone):
        ok, why = (e.get("transports") or {}).get(name, (False, "not reported"))
        if ok:
            usable.append(r)
        else:
            reasons.setdefault(why, []).append(r)
    return usable, reasons


def cross_rank_findings(everyone: Sequence[Mapping]) -> List[Finding]:
    """Versions, network settings and transports that differ between ranks."""
    out: List[Finding] = []
    for k in sorted({k for e in everyone for k in (e.get("versions") or {})}):
        out += _differ([(e.get("versions") or {}).get(k) for e in everyone], f"version of {k}",
                       "install the same software on every host (the same venv or container image at the same path)")
    for t in sorted({t for e in everyone for t in (e.get("settings") or {})}):
        for key in SAME_SETTINGS:
            out += _differ([((e.get("settings") or {}).get(t) or {}).get(key, "-") for e in everyone], f"{t} {key}",
                           EXPORT)
    for name in registry.TRANSPORT_NAMES:
        usable, reasons = transport_states(everyone, name)
        if usable and reasons:
            out.append(Finding(FAIL, f"transport {name}", f"usable on ranks {rank_ranges(usable)} only; " + "; ".join(
                f"ranks {rank_ranges(rs)}: {why}" for why, rs in reasons.items()),
                "make the hosts alike (a Buffer needs its transport on every rank)"))
    return out


def nodes_of(everyone: Sequence[Mapping], ranks_per_node: Optional[int]) -> Tuple[List[List[int]], bool]:
    """The ranks of each node (the machines; or logical nodes of `ranks_per_node` consecutive ranks, ValueError when
    one would span machines) and whether every node is a machine of its own."""
    from ..topology import layout_from_hosts

    hosts = [e["node"] for e in everyone]
    if ranks_per_node is None:
        by_host: Dict[str, List[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h, []).append(r)
        return list(by_host.values()), True
    layout = layout_from_hosts(hosts, ranks_per_node)
    nodes = [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(layout.num_nodes)]
    return nodes, len(set(hosts)) == len(nodes)


# ---- the round trips ---------------------------------------------------------------------------------------
def _pair(buf, me: int, a: int, b: int, n: int, tokens: int, hidden: int, iters: int, device) -> Optional[Dict]:
    """Collective over `buf`'s group of n ranks: ranks a and b send each other `tokens` tokens (low-latency dispatch,
    identity experts, combine with weight 1: what comes back must be what was sent, bit for bit); the others send
    nothing. Returns this rank's result when it is a or b."""
    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    peer = b if me == a else a if me == b else None
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7919 * a + 104729 * b + me))
    x = x.to(torch.bfloat16).to(device)
    idx = torch.full((tokens, 1), -1 if peer is None else peer, dtype=torch.int64, device=device)
    weights = torch.ones(tokens, 1, dtype=torch.float32, device=device)
    best, wrong = [float("inf"), float("inf")], 0
    for i in range(iters + 1):   # the first is a warm-up (it may compile the kernels)
        t0 = sync()
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, n, use_fp8=False)
        t1 = sync()
        y = recv.clone()
        t2 = sync()
        out, _, _ = buf.low_latency_combine(y, idx, weights, handle)
        t3 = sync()
        if i:
            best = [min(best[0], t1 - t0), min(best[1], t3 - t2)]
        if peer is not None:
            wrong += int((out.view(torch.int16) != x.view(torch.int16)).sum())
    return None if peer is None else {"wrong": wrong, "values": tokens * hidden * (iters + 1), "dispatch_s": best[0],
                                      "combine_s": best[1], "bytes": tokens * hidden * 2}


def round_trips(group, leaders: Sequence[int], transports: Sequence[str], timeout_s: float = 30.0, tokens: int = 64,
                hidden: int = 2048, iters: int = 3) -> List[Dict]:
    """Collective over `group` (every rank calls it): per transport, a Buffer over the `leaders` (one rank per node)
    and a round trip between every pair of them. Returns this rank's results (none off the leaders)."""
    from ..buffer import Buffer

    leaders = list(leaders)
    sub = dist.new_group(leaders) if len(leaders) < dist.get_world_size(group) else group   # every rank makes it
    me = dist.get_rank(group)
    if me not in leaders:
        return []
    i_me, n = leaders.index(me), len(leaders)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pairs, results = [(a, b) for a in range(n) for b in range(a + 1, n)], []
    for name in transports:
        if i_me == 0:
            print(f"doctor --cluster: round trips over {name}, {len(pairs)} node pair(s) (the first use may compile "
                  "kernels)", file=sys.stderr, flush=True)
        try:
            buf = Buffer(sub, 0, Buffer.get_low_latency_rdma_size_hint(tokens, hidden, n, n), low_latency_mode=True,
                         transport=name, timeout_s=timeout_s, ranks_per_node=1, explicitly_destroy=True)
        except Exception as e:
            results.append({"transport": name, "pair": None, "error": f"{type(e).__name__}: {e}"})
            continue
        broken = None
        for a, b in pairs:
            entry: Dict = {"transport": name, "pair": (leaders[a], leaders[b])}
            if broken is not None:
                entry["error"] = f"not run: an earlier pair failed ({broken})"
            else:
                try:
                    entry.update(_pair(buf, i_me, a, b, n, tokens, hidden, iters, device) or {})
                except Exception as e:   # the Buffer told every rank (failures.py): all stop here together
                    broken = entry["error"] = f"{type(e).__name__}: {e}"
            if i_me in (a, b):
                results.append(entry)
        notes: Dict[str, str] = {}
        try:
            describe = getattr(buf.backend, "runtime_notes", None)   # what the backend chose (ibgda: rails, doorbell)
            notes = {k: str(v) for k, v in (describe() if describe else {}).items()}
            buf.destroy()
        except Exception as e:
            notes["destroy"] = f"{type(e).__name__}: {e}"
        results.append({"transport": name, "pair": None, "notes": notes})
    return results


# ---- the report --------------------------------------------------------------------------------------------
RT_TODO = ("check both nodes' findings above (ports, GIDs, MTU, traffic class, GPUDirect); rerun with NCCL_DEBUG=INFO "
           "or NVSHMEM_DEBUG=INFO for the library's own view; jobs can run on transport='reference' meanwhile")


def _round_trip_lines(results: Sequence[Dict], transports: Sequence[str], nodes: List[List[int]],
                      everyone: Sequence[Mapping]) -> Tuple[List[str], int, int]:
    lines, fails, oks = [], 0, 0
    node_of = {r: i for i, rs in enumerate(nodes) for r in rs}
    for name in transports:
        label = name + ("" if registry.row(name).rdma else " (baseline: torch.distributed, not RDMA)")
        mine = [r for r in results if r["transport"] == name]
        setup = [r["error"] for r in mine if r["pair"] is None and "error" in r]
        if setup:
            fails += 1
            lines += [f"FAIL  {label}: the Buffer could not be made: {setup[0]}", f"      what to do: {RT_TODO}"]
            continue
        by_pair: Dict[Tuple[int, int], List[Dict]] = {}
        for r in mine:
            if r["pair"] is not None:
                by_pair.setdefault(tuple(r["pair"]), []).append(r)
        for (a, b), rs in sorted(by_pair.items()):
            who = (f"node {node_of[a]} ({everyone[a]['host']}, rank {a}) <-> node {node_of[b]} "
                   f"({everyone[b]['host']}, rank {b})")
            errors, wrong = [r["error"] for r in rs if r.get("error")], sum(r.get("wrong", 0) for r in rs)
            if errors or wrong or len(rs) < 2:
                fails += 1
                why = "; ".join(dict.fromkeys(errors)) or (f"{wrong} of {sum(r['values'] for r in rs)} values came "
                                                           "back wrong" if wrong else "a rank reported nothing")
                lines += [f"FAIL  {label}: {who}: {why}", f"      what to do: {RT_TODO}"]
                continue
            oks += 1
            d, c, nbytes = max(r["dispatch_s"] for r in rs), max(r["combine_s"] for r in rs), rs[0]["bytes"]
            lines.append(f"OK    {label}: {who}: bit-exact; each way dispatch {nbytes / d / 1e9:.2f} GB/s, combine "
                         f"{nbytes / c / 1e9:.2f} GB/s; round trip {(d + c) * 1e6:.0f} us")
        notes = next((r["notes"] for r in mine if r.get("notes")), None)
        if notes:
            lines.append("      " + "; ".join(f"{k}: {v}" for k, v in notes.items()))
    return lines, fails, oks


def _port_line(p: Mapping, settings: Mapping) -> str:
    if rdma.is_roce(p):
        v2 = [g for g in p.get("gids") or [] if rdma.routable_v2(g)]
        path = (f"MTU {rdma_mtu(p.get('netdev_mtu')) or '?'} ({p.get('netdev')} {p.get('netdev_mtu') or '?'}), "
                + (f"RoCE v2 GID {v2[0]['index']} {rdma.gid_text(v2[0]['gid'])}" if v2 else "no routable RoCE v2 GID"))
    else:
        path = "MTU not in sysfs (ibv_devinfo shows active_mtu)"
    tc_sl = ", ".join(f"{t} tc {in_effect(settings, 'traffic_class', t)} sl {in_effect(settings, 'service_level', t)}"
                      for t in settings if "error" not in settings[t])
    rate = f", {p['rate']}" if p.get("rate") else ""
    return (f"port {p['port']}: {str(p.get('state')).split(': ')[-1]}, {p.get('link_layer')}{rate}, {path}; "
            f"in effect: {tc_sl} (tc = DSCP * 4 + ECN)")


def format_report(everyone: Sequence[Mapping], nodes: List[List[int]], separate_machines: bool,
                  results: Sequence[Dict], tested: Sequence[str], tokens: int = 64, hidden: int = 2048) -> str:
    """Rank 0's report of what every rank saw and of the round trips (pure: tests call it on made-up facts)."""
    hosts = sorted({e["host"] for e in everyone})
    w = [f"deepep_portable doctor --cluster: {len(everyone)} ranks, {len(nodes)} nodes on {len(hosts)} machine(s): "
         + ", ".join(hosts)]

    def section(title: str) -> None:
        w.extend(["", f"== {title} " + "=" * max(0, 72 - len(title))])

    section("Versions")
    for k, v in (everyone[0].get("versions") or {}).items():
        same = all((e.get("versions") or {}).get(k) == v for e in everyone)
        w.append(f"  {k + ':':18s} {v}" + ("" if same else "   <- differs between ranks (see Findings)"))
    section("Nodes")
    for i, ranks in enumerate(nodes):
        head = everyone[ranks[0]]
        w.append(f"  node {i}: {head['host']}, ranks {rank_ranges(ranks)}")
        for d in (head.get("machine") or {}).get("nics") or []:
            pci = os.path.basename(d.get("pci_path") or "?")
            w.append(f"    {d['name']} ({d.get('driver') or 'driver ?'}, PCI {pci}, NUMA {d.get('numa_node')})")
            w += ["      " + _port_line(p, head.get("settings") or {}) for p in d["ports"]]
        if not (head.get("machine") or {}).get("nics"):
            w.append("    no RDMA NIC")
        for r in ranks:
            gpu = everyone[r].get("gpu") or {}
            if gpu.get("bus_id"):
                w.append(f"    rank {r}: GPU {gpu['bus_id']} (NUMA {gpu.get('numa_node')}): " + (", ".join(
                    f"{x['name']} {x['distance']} (NUMA {x['numa']})" for x in affinity(everyone[r])[0]) or "no NIC"))
    if not separate_machines and len(nodes) > 1:
        w.append("  (logical nodes on one machine: the round trips below do not cross a NIC)")

    section("Findings")
    grouped: Dict[Finding, List[int]] = {}
    one_machine = len({e["node"] for e in everyone}) == 1   # by node identity: hostnames can repeat across hosts
    for r, e in enumerate(everyone):
        for f in local_findings(e, one_machine=one_machine):
            grouped.setdefault(f, []).append(r)
    counts = {FAIL: 0, WARN: 0, NOTE: 0, OK: 0}
    for f in cross_rank_findings(everyone):
        grouped.setdefault(f, [])
    for f, ranks in sorted(grouped.items(), key=lambda kv: (_ORDER[kv[0].level], kv[0].subject)):
        where = ("across ranks" if not ranks else "every rank" if len(ranks) == len(everyone) else
                 f"ranks {rank_ranges(ranks)}")
        counts[f.level] += 1
        w.append(f"  {f.level:4s}  {f.subject}: {f.text}  [{where}]")
        if f.todo:
            w.append(f"        what to do: {f.todo}")

    section("Transports")
    for name in registry.TRANSPORT_NAMES:
        usable, reasons = transport_states(everyone, name)
        w.append(f"  {name:10s} " + ("usable on every rank" if not reasons else "unusable on every rank" if not usable
                                     else f"usable on ranks {rank_ranges(usable)} only") + "".join(
            f"; {why}" if not usable and len(reasons) == 1 else f"; ranks {rank_ranges(rs)}: {why}"
            for why, rs in reasons.items()))

    section("Round trips between nodes")
    rdma_names = [b.name for b in registry.BACKENDS if b.rdma]
    if not [n for n in rdma_names if not transport_states(everyone, n)[1]]:
        counts[FAIL] += 1
        w += [f"  FAIL  no network transport is usable on every rank ({', '.join(rdma_names)}: reasons under "
              "Transports): ranks on different nodes can use only the reference transport (torch.distributed), far "
              "slower", "        what to do: fix what those reasons name, on the ranks they name, then run this again"]
    oks = 0
    if len(nodes) < 2:
        w.append("  one node: no pair of nodes to test")
    elif tested:
        lines, fails, oks = _round_trip_lines(results, tested, nodes, everyone)
        w += ["  " + ln for ln in lines]
        counts[FAIL] += fails
        if oks:
            w.append(f"  (each way {tokens} tokens x {hidden} bf16 = {tokens * hidden * 2 / 1e6:.2f} MB per pair: "
                     "small messages, a floor rather than the fabric's peak; `python -m deepep_portable bench --mode "
                     "internode` measures real shapes)")
    section("Verdict")
    w.append(f"  {counts[FAIL]} failed, {counts[WARN]} warnings; {oks} round trip(s) passed. " + (
        "Ready." if not counts[FAIL] else "Not ready: fix the FAIL lines first (each says what to do)."))
    return "\n".join(w) + "\n"


def cluster_report(group=None, file: TextIO = sys.stdout, ranks_per_node: Optional[int] = None, root: str = "/",
                   timeout_s: float = 30.0, tokens: int = 64, hidden: int = 2048, iters: int = 3) -> int:
    """Collective over `group` (None: this process alone): every rank collects, the first ranks of the nodes run the
    round trips, rank 0 prints the report to `file`. Returns 0 (the findings are the report's business), 2 when
    `ranks_per_node` does not fit the job."""
    facts = collect_local(root=root)
    everyone, me, exchange = [facts], 0, None
    if group is not None:   # the doctor's own exchanges go over gloo: they must work even where NCCL does not
        exchange = group if dist.get_backend(group) == "gloo" else \
            dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=1))
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, facts, group=exchange)
        me = dist.get_rank(group)
    try:
        nodes, separate = nodes_of(everyone, ranks_per_node)
    except ValueError as e:
        if me == 0:
            print(f"doctor --cluster: {e}", file=file)
        return 2
    tested = [b.name for b in registry.BACKENDS if b.spans_nodes and not transport_states(everyone, b.name)[1]] \
        if group is not None and len(nodes) > 1 else []
    results: List[Dict] = []
    if tested:
        try:
            mine = round_trips(group, [rs[0] for rs in nodes], tested, timeout_s, tokens, hidden, iters)
        except Exception as e:   # the round trips' own set-up failed on this rank
            traceback.print_exc()
            mine = [{"transport": t, "pair": None, "error": f"rank {me}: {type(e).__name__}: {e}"} for t in tested]
        gathered: List = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=exchange)
        results = [r for rs in gathered for r in rs]
    if me == 0:
        file.write(format_report(everyone, nodes, separate, results, tested, tokens, hidden))
        file.flush()
    return 0


def main(args) -> int:
    """`python -m deepep_portable doctor --cluster`: join the job's group (tools/spawn.py) and report."""
    from .. import launch_env
    from . import spawn

    info = launch_env.read_launch()
    kw = dict(ranks_per_node=args.ranks_per_node, root=args.root, timeout_s=args.timeout, tokens=args.tokens,
              hidden=args.hidden)
    if info is None or info.world_size == 1:
        print("doctor --cluster: this process alone (no launcher, or a world of one): launch it like the job (mpirun, "
              "srun, torchrun: docs/CLUSTER.md) to check every node and the network between them", file=sys.stderr)
        return cluster_report(None, **kw)
    try:
        group = spawn.init_group(info.rank, info.world_size)
    except Exception as e:
        print(f"doctor --cluster: rank {info.rank} could not join the job's group: {type(e).__name__}: {e}\n"
              "what to do: docs/CLUSTER.md, Launching (the rendezvous address, and the network interface: "
              "DEEPEP_PORTABLE_IFNAME)", file=sys.stderr)
        return 1
    try:
        return cluster_report(group, **kw)
    finally:
        dist.barrier(group)
        dist.destroy_process_group()
