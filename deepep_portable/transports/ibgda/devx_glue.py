"""The ibgda backend's DevX glue: csrc/backends/ibgda/devx.cc compiled at run time with the host C++ compiler against
the system's rdma-core headers, loaded with ctypes and wrapped in `DevxGlue` (Python ints and bytes in and out).

Why a C++ file: the verbs / mlx5dv structs and several entry points (macros, static inlines) are only right when
compiled against the installed headers; devx.cc's top comment has the ABI's rules and the teardown order. The build
is cached in the JIT cache (`<cache>/ibgda/devx.host.<key>.so`), keyed by the source, the compiler (path and
`--version`), the flags and the contents of the rdma-core (and cuda.h) headers it includes; `jit.cached_artifact`
gives the per-key lock and the atomic rename, so ranks building at once are safe.

`glue_status()` never raises: (True, "ok"), or (False, why) for a missing compiler, missing headers
(infiniband/mlx5dv.h: libibverbs-dev), missing libraries or a failed build. The transport's probe uses it.

Environment: DEEPEP_PORTABLE_CXX (else CXX, else c++ / g++ / clang++ on PATH) picks the compiler; CUDA_HOME /
CUDA_PATH (else /usr/local/cuda) is where cuda.h is looked for (optional: devx.cc has checked fallbacks).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

from ... import jit
from .. import system

SOURCE = "backends/ibgda/devx.cc"
PROXY_SOURCE = "backends/ibgda/doorbell_proxy.cc"   # the CPU doorbell, built into the same library
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17")
LIBS = ("-libverbs", "-lmlx5")
HEADER = "infiniband/mlx5dv.h"

_vp, _i, _u32, _u64, _sz, _cp = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t,
                                 ctypes.c_char_p)
_pvp, _pi, _pu32, _pu64 = (ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                           ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64))

# Every exported function: name -> (restype, argtypes). Buffers go as c_void_p (bytes in, string buffers out).
SIGNATURES: Dict[str, Tuple[object, List[object]]] = {
    "dx_last_error": (_cp, []),
    "dx_constant": (_i, [_cp]),
    "dx_constant_names": (_cp, []),
    "dx_open": (_i, [_cp, _pvp]),
    "dx_close": (_i, [_vp]),
    "dx_query_port": (_i, [_vp, _i, _pi, _pi, _pi, _pi, _pi, _pi]),
    "dx_query_gid": (_i, [_vp, _i, _i, _vp]),
    "dx_general_cmd": (_i, [_vp, _vp, _sz, _vp, _sz]),
    "dx_alloc_pd": (_i, [_vp, _pvp, _pu32]),
    "dx_dealloc_pd": (_i, [_vp]),
    "dx_query_eqn": (_i, [_vp, _u32, _pu32]),
    "dx_alloc_uar": (_i, [_vp, _pvp, _pu32, _pu64]),
    "dx_uar_info": (_i, [_vp, _pu32, _pu64]),
    "dx_free_uar": (_i, [_vp]),
    "dx_umem_reg": (_i, [_vp, _u64, _sz, _i, _u32, _pvp, _pu32]),
    "dx_umem_dereg": (_i, [_vp]),
    "dx_obj_create": (_i, [_vp, _vp, _sz, _vp, _sz, _pvp]),
    "dx_obj_modify": (_i, [_vp, _vp, _sz, _vp, _sz]),
    "dx_obj_destroy": (_i, [_vp]),
    "dx_reg_mr": (_i, [_vp, _u64, _sz, _i, _u64, _u32, _pvp, _pu32, _pu32]),
    "dx_dereg_mr": (_i, [_vp]),
    "dx_resolve_rmac": (_i, [_vp, _i, _i, _vp, _i, _vp]),
    "dx_cuda_entry_names": (_cp, []),
    "dx_use_cuda": (_i, [_cp, _pu64, _i]),
    "dx_cuda_dmabuf_fd": (_i, [_u64, _sz, _pi]),
    "dx_cuda_map_io": (_i, [_u64, _sz, _pu64]),
    "dx_cuda_unmap_io": (_i, [_u64]),
    "dx_proxy_start": (_i, [_vp, _vp, _i, _pvp]),
    "dx_proxy_forwarded": (_u64, [_vp]),
    "dx_proxy_stop": (_i, [_vp]),
}


class GlueError(RuntimeError):
    """The glue cannot be built or loaded here (the message says what is missing)."""


class DevxError(RuntimeError):
    """A glue call failed: `.errno` is its errno-style code, the message `"{call}: {dx_last_error()}"`."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call}: {message}")
        self.call, self.errno = call, code


class PortInfo(NamedTuple):
    state: int            # ibv_port_state (compare with glue.constant("IBV_PORT_ACTIVE"))
    link_layer: int       # IBV_LINK_LAYER_INFINIBAND / _ETHERNET
    active_mtu: int       # bytes (256 .. 4096)
    lid: int
    gid_tbl_len: int
    max_qp_rd_atom: int   # the device's max_qp_rd_atom


# ---- building ---------------------------------------------------------------------------------------------------

def find_compiler() -> Tuple[Optional[str], str]:
    """(path of the C++ compiler, "") or (None, what was looked at)."""
    for var in ("DEEPEP_PORTABLE_CXX", "CXX"):
        value = os.environ.get(var)
        if value:   # an explicit choice is not second-guessed
            path = shutil.which(value)
            return (path, "") if path else (None, f"{var}={value!r} is not an executable")
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path, ""
    return None, "no c++, g++ or clang++ on PATH and neither DEEPEP_PORTABLE_CXX nor CXX set"


def cuda_include() -> Optional[str]:
    """The directory holding cuda.h ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda), or None."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        if os.path.isfile(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GlueError(f"cannot run {cmd[0]}: {e}") from e


def _explain(log: str, what: str) -> GlueError:
    """A compiler / linker failure as a GlueError saying what is missing."""
    if "infiniband/" in log and ("No such file" in log or "not found" in log):
        return GlueError(f"{HEADER} (rdma-core headers) not found: install libibverbs-dev (rdma-core >= 44)")
    if "cannot find -libverbs" in log or "cannot find -lmlx5" in log:
        return GlueError("libibverbs / libmlx5 not found by the linker: install libibverbs-dev (it ships the "
                         "libibverbs.so and libmlx5.so links)")
    tail = "\n".join(log.strip().splitlines()[-15:])
    return GlueError(f"{what} failed:\n{tail}")


_key_memo: Dict[Tuple[str, Optional[str]], Tuple[str, List[str]]] = {}


def _compiler_facts(cxx: str, include: Optional[str], src: str) -> Tuple[str, List[str]]:
    """(`cxx --version`, the rdma-core / cuda.h headers devx.cc includes), once per process and compiler."""
    memo = _key_memo.get((cxx, include))
    if memo is None:
        ver = _run([cxx, "--version"])
        if ver.returncode != 0:
            raise GlueError(f"{cxx} --version failed: {ver.stderr.strip()}")
        cmd = [cxx, "-std=c++17", "-M", *([f"-I{include}"] if include else []), src]
        deps = _run(cmd)
        if deps.returncode != 0:
            raise _explain(deps.stdout + deps.stderr, " ".join(cmd))
        files = deps.stdout.replace("\\\n", " ").split(":", 1)[-1].split()
        headers = sorted(f for f in files if "/infiniband/" in f or os.path.basename(f) == "cuda.h")
        memo = _key_memo[(cxx, include)] = (ver.stdout.strip(), headers)
    return memo


def build() -> str:
    """Path of devx.cc compiled for this system (built once per source, compiler and headers); GlueError if not."""
    cxx, why = find_compiler()
    if cxx is None:
        raise GlueError(f"no C++ compiler for the ibgda DevX glue: {why} (install g++)")
    src = os.path.join(jit.kernel_root(), SOURCE)
    proxy = os.path.join(jit.kernel_root(), PROXY_SOURCE)
    include = cuda_include()
    version, headers = _compiler_facts(cxx, include, src)
    if not any(h.endswith(HEADER) for h in headers):
        raise GlueError(f"{HEADER} not among devx.cc's includes ({cxx} -M): install libibverbs-dev")
    key = hashlib.sha256()
    for tag, data in [("source", open(src, "rb").read()), ("proxy", open(proxy, "rb").read()),
                      ("cxx", f"{cxx}\n{version}".encode()),
                      ("flags", repr((FLAGS, LIBS, include is not None)).encode())] + \
            [("header:" + h, open(h, "rb").read()) for h in headers]:
        key.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    out = jit.artifact_path(src, "host", key.hexdigest(), "so", os.path.join(jit.cache_dir(), "ibgda"))

    def compile_glue() -> bytes:
        with tempfile.TemporaryDirectory(prefix="deepep_portable_devx_") as tmp:
            target = os.path.join(tmp, "devx.so")
            cmd = [cxx, *FLAGS, *([f"-I{include}"] if include else []), src, proxy, "-o", target, "-pthread", *LIBS]
            res = _run(cmd)
            if res.returncode != 0 or not os.path.isfile(target):
                raise _explain(res.stdout + res.stderr, " ".join(cmd))
            with open(target, "rb") as f:
                return f.read()

    jit.cached_artifact(out, compile_glue)
    return out


# ---- loading ----------------------------------------------------------------------------------------------------

def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)   # AttributeError names a symbol the glue lacks
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _hand_over_cuda(lib: ctypes.CDLL) -> None:
    """Gives the glue the CUDA driver's entry points from the library's one loader (system.driver_entry_points, as
    _C takes them), or why there is none (its CUDA calls then fail with that). The glue keeps the first hand-over
    of the process; an entry point the driver lacks is 0 and the glue reports the driver too old for that call."""
    names = (lib.dx_cuda_entry_names() or b"").decode().split(",")
    _, addresses, why = system.driver_entry_points(names)
    if addresses is None:
        rc = lib.dx_use_cuda(why.encode(), None, 0)
    else:
        rc = lib.dx_use_cuda(None, (ctypes.c_uint64 * len(names))(*addresses), len(names))
    if rc != 0:
        raise GlueError(f"dx_use_cuda: {(lib.dx_last_error() or b'').decode(errors='replace')}")


class DevxGlue:
    """The loaded glue. Methods take the C functions' arguments in the same order (less the out-pointers) and return
    what those write. Handles are ints (opaque pointers the caller releases with the matching method, in devx.cc's
    teardown order); each method raises DevxError (a RuntimeError) naming the call when the C function fails.
    `load()` gives the process's instance; DevxGlue() builds (cached) and loads it again."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path or build()
        try:
            self.lib = _declare(ctypes.CDLL(self.path))
        except OSError as e:
            raise GlueError(f"cannot load {self.path}: {e} (libibverbs.so.1 / libmlx5.so.1 missing?)") from e
        names = (self.lib.dx_constant_names() or b"").decode()
        self.constants: Dict[str, int] = {n: self.lib.dx_constant(n.encode()) for n in names.split(",") if n}
        _hand_over_cuda(self.lib)

    def last_error(self) -> str:
        return (self.lib.dx_last_error() or b"").decode(errors="replace")

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise DevxError(call, rc, self.last_error())

    def constant(self, name: str) -> int:
        """A verbs / mlx5dv constant as this system's headers define it; KeyError if the glue does not export it."""
        if name not in self.constants:
            raise KeyError(f"{name}: not exported by devx.cc (known: {', '.join(sorted(self.constants))})")
        return self.constants[name]

    # -- device, port, commands
    def open(self, dev_name: str) -> int:
        ctx = ctypes.c_void_p()
        self._check(self.lib.dx_open(dev_name.encode(), ctypes.byref(ctx)), f"open({dev_name})")
        return ctx.value

    def close(self, ctx: int) -> None:
        self._check(self.lib.dx_close(ctx), "close")

    def query_port(self, ctx: int, port: int) -> PortInfo:
        vals = [ctypes.c_int() for _ in range(6)]
        self._check(self.lib.dx_query_port(ctx, port, *map(ctypes.byref, vals)), f"query_port({port})")
        return PortInfo(*(v.value for v in vals))

    def query_gid(self, ctx: int, port: int, index: int) -> bytes:
        gid = ctypes.create_string_buffer(16)
        self._check(self.lib.dx_query_gid(ctx, port, index, gid), f"query_gid({port}, {index})")
        return gid.raw

    def general_cmd(self, ctx: int, cmd_in: bytes, outlen: int) -> bytes:
        out = ctypes.create_string_buffer(outlen)
        self._check(self.lib.dx_general_cmd(ctx, cmd_in, len(cmd_in), out, outlen), "general_cmd")
        return out.raw

    def query_eqn(self, ctx: int, vector: int = 0) -> int:
        eqn = ctypes.c_uint32()
        self._check(self.lib.dx_query_eqn(ctx, vector, ctypes.byref(eqn)), f"query_eqn({vector})")
        return eqn.value

    # -- protection domain, UAR, UMEM, DevX objects
    def alloc_pd(self, ctx: int) -> Tuple[int, int]:
        """(pd handle, pdn)."""
        pd, pdn = ctypes.c_void_p(), ctypes.c_uint32()
        self._check(self.lib.dx_alloc_pd(ctx, ctypes.byref(pd), ctypes.byref(pdn)), "alloc_pd")
        return pd.value, pdn.value

    def dealloc_pd(self, pd: int) -> None:
        self._check(self.lib.dx_dealloc_pd(pd), "dealloc_pd")

    def alloc_uar(self, ctx: int) -> Tuple[int, int, int]:
        """(uar handle, page_id, reg_addr: the doorbell register's host address). NC type when available, else BF."""
        uar, page, reg = ctypes.c_void_p(), ctypes.c_uint32(), ctypes.c_uint64()
        self._check(self.lib.dx_alloc_uar(ctx, ctypes.byref(uar), ctypes.byref(page), ctypes.byref(reg)), "alloc_uar")
        return uar.value, page.value, reg.value

    def uar_info(self, uar: int) -> Tuple[int, int]:
        """(MLX5DV_UAR_ALLOC_TYPE_* the UAR got, base_addr of its page mapping)."""
        kind, base = ctypes.c_uint32(), ctypes.c_uint64()
        self._check(self.lib.dx_uar_info(uar, ctypes.byref(kind), ctypes.byref(base)), "uar_info")
        return kind.value, base.value

    def free_uar(self, uar: int) -> None:
        self._check(self.lib.dx_free_uar(uar), "free_uar")

    def umem_reg(self, ctx: int, addr: int, size: int, dmabuf_fd: int, access: int) -> Tuple[int, int]:
        """(umem handle, umem_id). dmabuf_fd >= 0: `addr` is the offset inside the dmabuf (normally 0); -1: `addr` is
        a virtual address (GPU memory then needs nvidia-peermem)."""
        umem, umem_id = ctypes.c_void_p(), ctypes.c_uint32()
        rc = self.lib.dx_umem_reg(ctx, addr, size, dmabuf_fd, access, ctypes.byref(umem), ctypes.byref(umem_id))
        self._check(rc, f"umem_reg(size {size}, dmabuf_fd {dmabuf_fd})")
        return umem.value, umem_id.value

    def umem_dereg(self, umem: int) -> None:
        self._check(self.lib.dx_umem_dereg(umem), "umem_dereg")

    def obj_create(self, ctx: int, cmd_in: bytes, outlen: int) -> Tuple[int, bytes]:
        """(object handle, the command's output mailbox)."""
        obj, out = ctypes.c_void_p(), ctypes.create_string_buffer(outlen)
        self._check(self.lib.dx_obj_create(ctx, cmd_in, len(cmd_in), out, outlen, ctypes.byref(obj)), "obj_create")
        return obj.value, out.raw

    def obj_modify(self, obj: int, cmd_in: bytes, outlen: int) -> bytes:
        out = ctypes.create_string_buffer(outlen)
        self._check(self.lib.dx_obj_modify(obj, cmd_in, len(cmd_in), out, outlen), "obj_modify")
        return out.raw

    def obj_destroy(self, obj: int) -> None:
        self._check(self.lib.dx_obj_destroy(obj), "obj_destroy")

    # -- memory regions, addressing
    def reg_mr(self, pd: int, addr: int, length: int, dmabuf_fd: int, dmabuf_offset: int,
               access: int) -> Tuple[int, int, int]:
        """(mr handle, lkey, rkey). dmabuf_fd >= 0: ibv_reg_dmabuf_mr with iova `addr`; -1: ibv_reg_mr at `addr`."""
        mr, lkey, rkey = ctypes.c_void_p(), ctypes.c_uint32(), ctypes.c_uint32()
        rc = self.lib.dx_reg_mr(pd, addr, length, dmabuf_fd, dmabuf_offset, access, ctypes.byref(mr),
                                ctypes.byref(lkey), ctypes.byref(rkey))
        self._check(rc, f"reg_mr(len {length}, dmabuf_fd {dmabuf_fd})")
        return mr.value, lkey.value, rkey.value

    def dereg_mr(self, mr: int) -> None:
        self._check(self.lib.dx_dereg_mr(mr), "dereg_mr")

    def resolve_rmac(self, pd: int, port: int, gid_index: int, dgid: bytes, hop_limit: int = 255) -> bytes:
        """The next hop's MAC (6 bytes) toward the peer GID `dgid` (RoCE), through an address handle."""
        if len(dgid) != 16:
            raise ValueError(f"dgid must be 16 bytes, got {len(dgid)}")
        mac = ctypes.create_string_buffer(6)
        self._check(self.lib.dx_resolve_rmac(pd, port, gid_index, bytes(dgid), hop_limit, mac),
                    f"resolve_rmac(port {port}, gid index {gid_index})")
        return mac.raw

    # -- CUDA (the driver system.open_libcuda opened; a CUDA context must be current on the calling thread)
    def cuda_dmabuf_fd(self, dptr: int, size: int) -> int:
        """A dmabuf fd for [dptr, dptr + size) (size page-aligned); the caller closes it (os.close)."""
        fd = ctypes.c_int(-1)
        self._check(self.lib.dx_cuda_dmabuf_fd(dptr, size, ctypes.byref(fd)), f"cuda_dmabuf_fd(size {size})")
        return fd.value

    def cuda_map_io(self, host_addr: int, size: int) -> int:
        """The GPU's address of the MMIO range at `host_addr` (the UAR doorbell)."""
        dev = ctypes.c_uint64()
        self._check(self.lib.dx_cuda_map_io(host_addr, size, ctypes.byref(dev)), f"cuda_map_io(size {size})")
        return dev.value

    def cuda_unmap_io(self, host_addr: int) -> None:
        self._check(self.lib.dx_cuda_unmap_io(host_addr), "cuda_unmap_io")

    # -- the CPU doorbell (doorbell_proxy.cc): a host thread forwarding mailbox words to UAR registers
    def proxy_start(self, mailboxes: List[int], registers: List[int]) -> int:
        """Forward each mailbox (host address of a pinned u64 the GPU stores doorbells to) to its register."""
        n = len(mailboxes)
        if n == 0 or n != len(registers):
            raise ValueError(f"proxy_start: {n} mailboxes for {len(registers)} registers")
        m, r, h = (ctypes.c_uint64 * n)(*mailboxes), (ctypes.c_uint64 * n)(*registers), ctypes.c_void_p()
        rc = self.lib.dx_proxy_start(m, r, n, ctypes.byref(h))
        if rc:
            raise DevxError(f"proxy_start({n} queues)", rc, os.strerror(rc))
        return h.value

    def proxy_forwarded(self, proxy: int) -> int:
        return int(self.lib.dx_proxy_forwarded(proxy))

    def proxy_stop(self, proxy: int) -> None:
        rc = self.lib.dx_proxy_stop(proxy)
        if rc:
            raise DevxError("proxy_stop", rc, os.strerror(rc))


_lock = threading.Lock()
_loaded: Dict[str, DevxGlue] = {}


def load() -> DevxGlue:
    """The glue for this system, built if needed and loaded once per process (GlueError if it cannot be)."""
    with _lock:
        path = build()
        if path not in _loaded:
            _loaded[path] = DevxGlue(path)
        return _loaded[path]


def glue_status() -> Tuple[bool, str]:
    """(True, "ok") when the glue builds and loads here, else (False, why). Never raises."""
    try:
        load()
        return True, "ok"
    except Exception as e:   # noqa: BLE001 - a probe reports, it does not fail
        return False, f"ibgda DevX glue unavailable: {e}"
