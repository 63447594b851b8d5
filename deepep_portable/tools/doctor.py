"""`python -m deepep_portable doctor`: what this machine has, and what each transport makes of it.

Every section prints what it found or exactly why it could not look; nothing here needs a GPU,
a NIC or any optional library, and a failing section never stops the others.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import traceback
from typing import List, Optional, TextIO

_ENV_VARS = ["CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_HOME",
             "NVSHMEM_HOME", "LD_LIBRARY_PATH", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
             "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME",
             "NVSHMEM_HCA_LIST", "NVSHMEM_IB_GID_INDEX", "NVSHMEM_IB_TRAFFIC_CLASS"]


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class _Out:
    def __init__(self, file: TextIO):
        self.file = file

    def section(self, title: str) -> None:
        print(f"\n== {title} " + "=" * max(0, 72 - len(title)), file=self.file)

    def line(self, text: str = "", indent: int = 2) -> None:
        for ln in str(text).splitlines() or [""]:
            print(" " * indent + ln, file=self.file)

    def kv(self, key: str, value, indent: int = 2) -> None:
        self.line(f"{key + ':':22s} {value}", indent)


def _python(o: _Out) -> None:
    o.kv("python", f"{platform.python_version()} ({sys.executable})")
    o.kv("platform", f"{platform.platform()} {platform.machine()}")
    try:
        import torch
        o.kv("torch", f"{torch.__version__} ({os.path.dirname(torch.__file__)})")
        o.kv("torch CUDA", torch.version.cuda or "none (CPU build)")
        o.kv("torch.cuda available", torch.cuda.is_available())
        try:
            import torch.distributed as dist
            backends = [b for b, f in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"),
                                       ("mpi", "is_mpi_available"))
                        if getattr(dist, f, lambda: False)()]
            o.kv("torch.distributed", ", ".join(backends) or "no backends")
        except Exception as e:
            o.kv("torch.distributed", f"unavailable: {e}")
    except Exception as e:
        o.kv("torch", f"not importable: {type(e).__name__}: {e}")
    try:
        from importlib import metadata

        version = metadata.version("deepep_portable")
    except Exception as e:   # a source tree on sys.path without an install
        version = f"not installed ({type(e).__name__})"
    o.kv("deepep_portable", f"{version} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})")
    try:
        from .. import _C  # type: ignore[attr-defined]
        o.kv("deepep_portable._C", getattr(_C, "__file__", "imported"))
    except Exception as e:
        o.kv("deepep_portable._C", f"not importable: {type(e).__name__}: {e}")
    try:
        import mpi4py
        from mpi4py import MPI
        lib = MPI.Get_library_version().replace("\x00", "").strip().splitlines()
        o.kv("mpi4py", f"{mpi4py.__version__}, {lib[0] if lib else '?'}")
    except Exception as e:
        o.kv("mpi4py", f"not importable: {type(e).__name__}: {e}")


def _driver_and_gpus(o: _Out) -> None:
    from ..transports import system

    ok, reason, source = system.driver_status()
    o.kv("driver", ("OK: " if ok else "") + reason)
    o.kv("checked via", source)
    gpus = system.gpu_info()
    if not gpus:
        o.kv("GPUs", "none visible")
    for g in gpus:
        o.line(f"GPU {g['index']}: {g['name']}, cc {g['cc']}, {g['sms']} SMs, "
               f"{_fmt_bytes(g['memory_bytes'])}, {g.get('uuid') or 'uuid ?'}"
               + (f", PCI {g['pci_bus_id']}" if g.get("pci_bus_id") else "")
               + (f"  [nvidia-smi {g['nvidia_smi_name']}]" if g.get("nvidia_smi_name") else ""))
        if g.get("links"):
            o.line("links: " + ", ".join(f"{k}={v}" for k, v in g["links"].items()), indent=4)
    text, why = system.nvidia_smi_topology()
    if text:
        o.line("nvidia-smi topo -m:")
        o.line(text.rstrip(), indent=4)
    else:
        o.kv("topology", why)


def _own_nvcc_search() -> Optional[str]:
    cands = []
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    w = shutil.which("nvcc")
    if w:
        cands.append(w)
    cands.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in cands if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _release(version_text: str) -> str:
    rel = [ln.strip() for ln in version_text.splitlines() if "release" in ln]
    return rel[-1] if rel else version_text.strip().splitlines()[-1] if version_text.strip() else "?"


def _compiler(o: _Out) -> None:
    o.kv("CUDA_HOME", os.environ.get("CUDA_HOME", "<unset>"))
    try:
        from .. import jit
    except Exception as e:
        o.kv("deepep_portable.jit", f"not importable: {type(e).__name__}: {e}")
        jit = None
    if jit is not None:
        try:
            nvcc = jit.find_nvcc()
            o.kv("nvcc (jit)", f"{nvcc}: {_release(jit.nvcc_version(nvcc))}")
        except Exception as e:
            o.kv("nvcc (jit)", f"{type(e).__name__}: {e}")
        try:
            o.kv("JIT cache", jit.cache_dir())
        except Exception as e:
            o.kv("JIT cache", f"{type(e).__name__}: {e}")
        return
    nvcc = _own_nvcc_search()
    if nvcc is None:
        o.kv("nvcc", "not found ($CUDA_HOME/bin, PATH, /usr/local/cuda/bin); "
                     "bash scripts/setup_env.sh installs the CUDA 13 compiler wheels")
        return
    from ..transports.libraries import _run

    rc, out = _run([nvcc, "--version"], timeout=30.0)
    o.kv("nvcc", f"{nvcc}: " + (_release(out) if rc == 0 else f"--version failed: {out.strip()[:200]}"))


def _rdma(o: _Out) -> None:
    from ..transports import rdma

    devs, source = rdma.rdma_devices()
    o.kv("source", source)
    if not devs:
        o.kv("devices", f"none ({rdma.SYSFS_INFINIBAND} "
                        + ("is empty)" if os.path.isdir(rdma.SYSFS_INFINIBAND) else "does not exist)"))
    for d in devs:
        extra = ", ".join(f"{k} {d[k]}" for k in ("driver", "hca_type", "fw_ver") if d.get(k))
        o.line(f"{d['name']}" + (f" ({extra})" if extra else ""))
        for p in d["ports"]:
            o.line(f"port {p['port']}: state {p.get('state')}, phys {p.get('phys_state')}, "
                   f"link layer {p.get('link_layer')}" + (f", rate {p['rate']}" if p.get("rate") else ""),
                   indent=4)
            for g in p["gids"]:
                o.line(f"gid[{g['index']}] {g['gid']}"
                       + (f" {g['type']}" if g.get("type") else "")
                       + (f" on {g['netdev']}" if g.get("netdev") else ""), indent=6)
            if not p["gids"]:
                o.line("no non-zero GIDs", indent=6)


def _backend_section(ref: str):
    """A section printing the lines of a backend's own doctor function (its registry row's `doctor`)."""
    def section(o: _Out) -> None:
        from ..transports import registry

        for ln in registry.entry(ref)():
            o.line(ln)
    return section


def _transports(o: _Out) -> None:
    from ..transports import available_transports, registry

    for name, st in available_transports().items():
        o.line(f"{name:10s} {'USABLE' if st.usable else 'unusable'}: {st.reason}")
        o.line(f"has run on: {registry.row(name).verified_hardware or 'nothing real yet'}", indent=14)
        for k, v in st.details.items():
            o.line(f"{k}: {v}", indent=14)
        if st.capabilities:
            o.line("capabilities: " + ", ".join(f"{k}={v}" for k, v in st.capabilities.items()), indent=14)
    _auto_choice(o)


def _auto_choice(o: _Out) -> None:
    """What transport="auto" picks here, for ranks on this machine and for ranks on several, and why."""
    from ..transports import choose

    for where, single in (("ranks on this machine only", True), ("ranks on several machines", False)):
        try:
            c = choose("auto", single_node=single, warn=False)
        except RuntimeError as e:
            o.line(f"auto, {where}: nothing ({e})")
            continue
        o.line(f"auto, {where}: {c.name}: {c.why} (it has run on: {c.verified_hardware})")
        if c.warning:
            o.line(f"WARNING: {c.warning}", indent=4)
        unusable = [n for n, why in c.not_chosen.items() if why.startswith("unusable")]
        if unusable:
            o.line(f"not {', '.join(unusable)}: unusable (reasons above)", indent=4)
        for name, why in c.not_chosen.items():
            if name not in unusable:
                o.line(f"not {name}: {why}", indent=4)


def _environment(o: _Out) -> None:
    for k in _ENV_VARS:
        if k in os.environ:
            o.kv(k, os.environ[k])
    others = sorted(k for k in os.environ if k.startswith("DEEPEP_"))
    for k in others:
        o.kv(k, os.environ[k])


_SECTIONS: List[tuple] = [
    ("Python / torch", _python),
    ("CUDA driver and GPUs", _driver_and_gpus),
    ("CUDA compiler (JIT)", _compiler),
    ("RDMA devices", _rdma),
    ("Transports", _transports),
    ("Environment", _environment),
]


def sections() -> List[tuple]:
    """(title, function) in print order: the machine's, then each backend's own (its registry row's `doctor`),
    then what each transport makes of it all."""
    from ..transports import registry

    own = [(f"Backend {b.name}", _backend_section(b.doctor)) for b in registry.BACKENDS if b.doctor]
    at = next(i for i, (title, _) in enumerate(_SECTIONS) if title == "Transports")
    return _SECTIONS[:at] + own + _SECTIONS[at:]


def run_doctor(file: TextIO = sys.stdout) -> int:
    """Print the report to `file`. Returns 0 (a missing component is a finding, not an error)."""
    o = _Out(file)
    print("deepep_portable doctor", file=file)
    for title, fn in sections():
        o.section(title)
        try:
            fn(o)
        except Exception as e:  # one broken section must not hide the others
            o.line(f"section failed: {type(e).__name__}: {e}")
            o.line(traceback.format_exc().rstrip(), indent=4)
    file.flush()
    return 0


if __name__ == "__main__":
    sys.exit(run_doctor())
