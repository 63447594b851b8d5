"""Host side of the `nvshmem` backend: ctypes over libnvshmem_host.so.3, opened at run time.

Only NVSHMEM's public, exported host API is called:
  nvshmemx_vendor_get_version_info, nvshmemx_get_uniqueid, nvshmemx_set_attr_uniqueid_args,
  nvshmemx_hostlib_init_attr, nvshmemx_init_status, nvshmem_my_pe, nvshmem_n_pes, nvshmem_malloc,
  nvshmem_free, nvshmem_ptr, nvshmem_barrier_all, nvshmemx_barrier_all_on_stream,
  nvshmemx_cumodule_init, nvshmemx_cumodule_finalize, nvshmemx_hostlib_finalize.

What is reimplemented from the public headers (they are macros / static inline functions there, so
nothing to call through ctypes), each checked against the headers by tests/test_nvshmem_backend.py:
  * the structs nvshmemx_uniqueid_t (v1), nvshmemx_uniqueid_args_t (v1), nvshmemx_init_args_v1/v2
    and nvshmemx_init_attr_v1/v2 (bootstrap_device_host/nvshmem_uniqueid.h,
    device_host/nvshmem_types.h), and their version words `(major << 16) + sizeof(struct)`
    (NVSHMEMX_UNIQUEID_INITIALIZER, nvshmemx_init_init_attr_ver_only, NVSHMEM_INIT_ATTR_V*_IDENTIFIER);
  * NVSHMEMX_INIT_WITH_UNIQUEID (= 1 << 3, host/nvshmemx_api.h).
  * nvshmemx_init_attr() and nvshmem_finalize() are static inline functions that call
    nvshmemi_init_thread / nvshmemi_finalize, which are defined in libnvshmem_device.a (host code
    linked into the application), not exported by libnvshmem_host.so. A Python process has no such
    static part, so it uses the exported host-library entry points nvshmemx_hostlib_init_attr /
    nvshmemx_hostlib_finalize instead, and the device state of each JIT module (the only device
    code here) is filled by nvshmemx_cumodule_init.

CUDA context: NVSHMEM initialises in the calling thread's current context, _C.Module loads into the
device's primary context, and nvshmemx_cumodule_init must see the module in NVSHMEM's context. So
NvshmemRuntime checks, before init and before each cumodule_init, that the current context is
`device`'s primary context; with no current context it makes the primary context current itself
(what cudaSetDevice does); another context current raises.

One installation: the library loaded here is the one libraries.nvshmem_info finds, the same that
link.nvshmem_build_paths links against; load_module refuses a cubin linked against another
version or installation, and loading refuses when another libnvshmem_host.so is already mapped in
the process (two NVSHMEM host libraries in one process would mix their global symbols).

Init attr version: the v2 layout (with cuda_device_id) is what NVSHMEM 3.8's headers define; older
libraries (3.4.x on the lent H200) may only know v1 (the header's own fallback,
nvshmemx_init_init_attr_ver_only, writes v1 version words). We send v2 when the library reports
>= 3.8 (whose headers we checked), else v1; with v1 NVSHMEM uses the calling thread's current CUDA
device, so make the device's primary context current first (torch.cuda.set_device + any CUDA op).

Environment set before init (see nvshmem_environment): NVSHMEM_DISABLE_NVLS=1 always; the other
variables only when the caller passes the matching option (pass-through), else the user's
environment is left as it is.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import threading
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import libraries, system

__all__ = ["NvshmemUnavailable", "load_library", "library_path", "version", "SYMBOLS", "UniqueId",
           "UniqueIdArgs", "InitArgsV1", "InitArgsV2", "InitAttrV1", "InitAttrV2", "INIT_WITH_UNIQUEID",
           "nvshmem_environment", "apply_environment", "NvshmemRuntime", "check_linked_against_loaded",
           "ensure_primary_context", "release_primary_context"]

INIT_WITH_UNIQUEID = 1 << 3          # NVSHMEMX_INIT_WITH_UNIQUEID (host/nvshmemx_api.h, enum flags)
UNIQUEID_PADDING = 124               # bootstrap_device_host/nvshmem_uniqueid.h
INIT_ARGS_PADDING = 96               # device_host/nvshmem_types.h (v1)
INIT_ARGS_V2_PADDING = 92            # device_host/nvshmem_types.h (v2)
UNIQUEID_ARGS_INVALID = -1


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM cannot be used here; the message says why."""


# ---- public struct layouts (mirrors of the header definitions) --------------------------------

class UniqueId(ctypes.Structure):
    """nvshmemx_uniqueid_v1: 128 bytes, opaque after the version word."""
    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * UNIQUEID_PADDING)]


class UniqueIdArgs(ctypes.Structure):
    """nvshmemx_uniqueid_args_v1: 24 bytes."""
    _fields_ = [("version", ctypes.c_int), ("id", ctypes.POINTER(UniqueId)), ("myrank", ctypes.c_int),
                ("nranks", ctypes.c_int)]


class InitArgsV1(ctypes.Structure):
    """nvshmemx_init_args_v1: 128 bytes."""
    _fields_ = [("version", ctypes.c_int), ("uid_args", UniqueIdArgs),
                ("content", ctypes.c_char * INIT_ARGS_PADDING)]


class InitArgsV2(ctypes.Structure):
    """nvshmemx_init_args_v2: 128 bytes."""
    _fields_ = [("version", ctypes.c_int), ("uid_args", UniqueIdArgs), ("cuda_device_id", ctypes.c_int),
                ("content", ctypes.c_char * INIT_ARGS_V2_PADDING)]


class InitAttrV1(ctypes.Structure):
    """nvshmemx_init_attr_v1: 144 bytes."""
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgsV1)]


class InitAttrV2(ctypes.Structure):
    """nvshmemx_init_attr_v2 (nvshmemx_init_attr_t in NVSHMEM 3.8): 144 bytes."""
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgsV2)]


def _ver(major: int, struct) -> int:
    return (major << 16) + ctypes.sizeof(struct)


def new_unique_id() -> UniqueId:
    """NVSHMEMX_UNIQUEID_INITIALIZER: version word set, rest zero."""
    uid = UniqueId()
    uid.version = _ver(1, UniqueId)
    return uid


def new_init_attr(v2: bool, device: int = -1):
    """NVSHMEMX_INIT_ATTR_INITIALIZER (v2) / NVSHMEMX_INIT_ATTR_V1_INITIALIZER (v1)."""
    attr = InitAttrV2() if v2 else InitAttrV1()
    attr.version = _ver(2 if v2 else 1, type(attr))
    attr.mpi_comm = None
    attr.args.version = _ver(2 if v2 else 1, type(attr.args))
    attr.args.uid_args.version = _ver(1, UniqueIdArgs)
    attr.args.uid_args.id = None
    attr.args.uid_args.myrank = UNIQUEID_ARGS_INVALID
    attr.args.uid_args.nranks = UNIQUEID_ARGS_INVALID
    if v2:
        attr.args.cuda_device_id = device  # INIT_ARGS_SCALAR_INVALID (-1) = "current device"
    return attr


# ---- the library --------------------------------------------------------------------------------

_c_int_p = ctypes.POINTER(ctypes.c_int)

# name -> (restype, argtypes). Every symbol this module calls; tests check each resolves.
SYMBOLS: Dict[str, Tuple[Any, list]] = {
    "nvshmemx_vendor_get_version_info": (None, [_c_int_p, _c_int_p, _c_int_p]),
    "nvshmemx_get_uniqueid": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    "nvshmemx_set_attr_uniqueid_args": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(UniqueId),
                                                       ctypes.c_void_p]),
    "nvshmemx_hostlib_init_attr": (ctypes.c_int, [ctypes.c_uint, ctypes.c_void_p]),
    "nvshmemx_init_status": (ctypes.c_int, []),
    "nvshmemx_hostlib_finalize": (None, []),
    "nvshmem_my_pe": (ctypes.c_int, []),
    "nvshmem_n_pes": (ctypes.c_int, []),
    "nvshmem_malloc": (ctypes.c_void_p, [ctypes.c_size_t]),
    "nvshmem_free": (None, [ctypes.c_void_p]),
    "nvshmem_ptr": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int]),
    "nvshmem_barrier_all": (None, []),
    "nvshmemx_barrier_all_on_stream": (None, [ctypes.c_void_p]),
    "nvshmemx_cumodule_init": (ctypes.c_int, [ctypes.c_void_p]),
    "nvshmemx_cumodule_finalize": (ctypes.c_int, [ctypes.c_void_p]),
}


def _other_nvshmem_host_libs(path: str) -> List[str]:
    """libnvshmem_host.so* files mapped in this process that are not `path` (after realpath)."""
    mine = os.path.realpath(path)
    others = []
    for f in libraries.mapped_files():
        if os.path.basename(f).startswith("libnvshmem_host.so") and os.path.realpath(f) != mine \
                and f not in others:
            others.append(f)
    return others


@functools.lru_cache(maxsize=None)
def _load() -> Tuple[Optional[ctypes.CDLL], str, Optional[str]]:
    info = libraries.nvshmem_info()
    path = info.get("host_lib")
    if path is None:
        return None, ("libnvshmem_host.so.3 not found (searched: " + ", ".join(info.get("searched", []))
                      + "); pip install nvidia-nvshmem-cu13 or set NVSHMEM_HOME"), None
    others = _other_nvshmem_host_libs(path)
    if others:
        return None, (f"another NVSHMEM host library ({', '.join(others)}) is already loaded in this process; "
                      f"loading {path} as well would give two NVSHMEMs with mixed symbols. Point NVSHMEM_HOME "
                      "at that installation (or unset it) so that one installation is used"), path
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load {path}: {e}", path
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        return None, f"{path} lacks the symbol(s) {', '.join(missing)} (NVSHMEM too old?)", path
    for name, (res, args) in SYMBOLS.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib, "", path


def load_library() -> ctypes.CDLL:
    """The loaded libnvshmem_host.so.3 with every symbol typed; NvshmemUnavailable(reason) if not."""
    lib, why, _ = _load()
    if lib is None:
        raise NvshmemUnavailable(why)
    return lib


def library_path() -> Optional[str]:
    return _load()[2]


def load_error() -> str:
    """"" when the library loads, else why not."""
    return _load()[1]


def version() -> Tuple[int, int, int]:
    lib = load_library()
    v = [ctypes.c_int(-1) for _ in range(3)]
    lib.nvshmemx_vendor_get_version_info(*(ctypes.byref(x) for x in v))
    return tuple(x.value for x in v)  # type: ignore[return-value]


# ---- environment ---------------------------------------------------------------------------------

# option name -> (environment variable, why it is passed through)
PASS_THROUGH = {
    # Size of each PE's symmetric heap (NVSHMEM's default is 1 GiB); every window lives in it.
    "symmetric_size": "NVSHMEM_SYMMETRIC_SIZE",
    # GPU-initiated RDMA (IBGDA) instead of the CPU proxy for network peers.
    "ibgda": "NVSHMEM_IB_ENABLE_IBGDA",
    # RoCE: which GID table entry (RoCE v2 / IPv4-mapped), chosen by the cluster's network setup.
    "ib_gid_index": "NVSHMEM_IB_GID_INDEX",
    # RoCE: traffic class (DSCP << 2) the fabric's lossless / priority queue expects.
    "ib_traffic_class": "NVSHMEM_IB_TRAFFIC_CLASS",
    # IB service level (maps to the virtual lane / priority on the switches).
    "ib_sl": "NVSHMEM_IB_SL",
    # Which HCAs (and ports) NVSHMEM may use, e.g. "mlx5_0:1,mlx5_1:1".
    "hca_list": "NVSHMEM_HCA_LIST",
    # Network transport for non-P2P peers ("ibrc", "ucx", "libfabric", "none").
    "remote_transport": "NVSHMEM_REMOTE_TRANSPORT",
}


def nvshmem_environment(options: Optional[Mapping[str, Any]] = None) -> Dict[str, str]:
    """The NVSHMEM_* variables to set before init for these options (pure; see apply_environment).

    Always NVSHMEM_DISABLE_NVLS=1: NVLink SHARP multicast objects are a per-machine resource that
    other jobs on shared machines contend for, and their setup fails or hangs under MPS with several
    PEs per GPU; nothing here uses NVLS collectives.
    NVSHMEM_BOOTSTRAP is NOT set: the NVSHMEMX_INIT_WITH_UNIQUEID flag selects the UID bootstrap
    plugin by itself (NVSHMEM_BOOTSTRAP only steers flag-less nvshmem_init); pass
    bootstrap="UID" to force it anyway.
    Unknown option names raise ValueError; None values are skipped; booleans become "1"/"0"."""
    env = {"NVSHMEM_DISABLE_NVLS": "1"}
    for key, value in (options or {}).items():
        if value is None:
            continue
        if key == "bootstrap":
            env["NVSHMEM_BOOTSTRAP"] = str(value)
            continue
        var = PASS_THROUGH.get(key)
        if var is None:
            raise ValueError(f"unknown NVSHMEM option {key!r}; known: {sorted([*PASS_THROUGH, 'bootstrap'])}")
        env[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


def validate_options(options: Mapping[str, Any]) -> Dict[str, Any]:
    """The registry's options schema of this backend: `Buffer(transport_options=...)` checked before any set-up
    (unknown names raise ValueError, as nvshmem_environment); NVSHMEM reads them at its initialisation."""
    nvshmem_environment(options)
    return dict(options)


def apply_environment(options: Optional[Mapping[str, Any]] = None) -> Dict[str, str]:
    """Set nvshmem_environment(options) in os.environ (NVSHMEM reads it at init); returns it."""
    env = nvshmem_environment(options)
    os.environ.update(env)
    return env


# ---- installation checks ----------------------------------------------------------------------

def ensure_primary_context(device: int) -> bool:
    """system.ensure_primary_context; NvshmemUnavailable when there is no CUDA driver."""
    try:
        return system.ensure_primary_context(device)
    except system.DriverUnavailable as e:
        raise NvshmemUnavailable(str(e)) from e


def release_primary_context(device: int) -> None:
    try:
        system.release_primary_context(device)
    except system.DriverUnavailable as e:
        raise NvshmemUnavailable(str(e)) from e


def check_linked_against_loaded(paths) -> None:
    """Raise NvshmemUnavailable unless `paths` (link.NvshmemBuildPaths a cubin was linked with)
    names the NVSHMEM installation and version this process loaded."""
    loaded_path = library_path()
    lib = load_library()
    v = [ctypes.c_int(-1) for _ in range(3)]
    lib.nvshmemx_vendor_get_version_info(*(ctypes.byref(x) for x in v))
    loaded = ".".join(str(x.value) for x in v)
    if paths.version != loaded:
        raise NvshmemUnavailable(f"NVSHMEM version mismatch: the kernel was device-linked against "
                                 f"{paths.device_lib} (NVSHMEM {paths.version}) but this process runs "
                                 f"{loaded_path} (NVSHMEM {loaded}); rebuild it against the loaded installation")
    if loaded_path and os.path.realpath(paths.lib_dir) != os.path.realpath(os.path.dirname(loaded_path)):
        raise NvshmemUnavailable(f"NVSHMEM installation mismatch: the kernel was device-linked against "
                                 f"{paths.device_lib} but this process runs {loaded_path}; link and run with "
                                 "one installation")


# ---- the runtime ---------------------------------------------------------------------------------

_state_lock = threading.Lock()
_active: Optional["NvshmemRuntime"] = None


class NvshmemRuntime:
    """NVSHMEM initialised over our Comm by unique id. One per process (NVSHMEM is process-global).

    `comm` is a deepep_portable.comm.Comm (or anything with rank, size, allgather_object). Rank r
    of the comm becomes PE r. `device`'s primary context must be current on this thread, or no
    context at all (then it is made current here); see the module docstring.
    """

    def __init__(self, comm: Any, device: int, options: Optional[Mapping[str, Any]] = None) -> None:
        global _active
        self.lib = load_library()
        self.device = int(device)
        self.rank, self.size = int(comm.rank), int(comm.size)
        self.env = apply_environment(options)  # before any NVSHMEM call that may read it
        self.version = version()
        self._modules: Dict[int, Any] = {}
        self._loaded: Dict[bytes, Any] = {}   # load_module's modules by image digest
        self._allocs: Dict[int, int] = {}
        self._own_context = False
        self._extra_retains = 0
        self.finalized = False
        with _state_lock:
            if _active is not None:
                raise RuntimeError("NVSHMEM is already initialised in this process (one NvshmemRuntime "
                                   "per process; finalize() the previous one first)")
            # Every rank checks its CUDA context and rank 0 creates the unique id; one allgather then
            # gives every rank rank 0's id AND every rank's error, so nobody enters the UID bootstrap
            # (where it would wait for the missing ranks) unless all ranks are ready.
            err = ""
            try:
                self._own_context = ensure_primary_context(self.device)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                self._own_context = False
                err = f"{type(e).__name__}: {e}"
            uid = new_unique_id()
            if self.rank == 0 and not err:
                rc = self.lib.nvshmemx_get_uniqueid(ctypes.byref(uid))
                if rc != 0:
                    err = f"nvshmemx_get_uniqueid failed with {rc}"
            everyone = comm.allgather_object((bytes(uid) if self.rank == 0 else b"", err))
            bad = [f"rank {r}: {e}" for r, (_, e) in enumerate(everyone) if e]
            if bad:
                raise RuntimeError("NVSHMEM init skipped on every rank: " + "; ".join(bad))
            blob = everyone[0][0]
            ctypes.memmove(ctypes.byref(uid), blob, ctypes.sizeof(UniqueId))
            self._uid = uid  # keep alive: attr points at it
            v2 = self.version >= (3, 8, 0)
            attr = new_init_attr(v2, self.device)
            rc = self.lib.nvshmemx_set_attr_uniqueid_args(self.rank, self.size, ctypes.byref(uid),
                                                          ctypes.byref(attr))
            if rc != 0:
                raise RuntimeError(f"nvshmemx_set_attr_uniqueid_args(rank={self.rank}, nranks={self.size}) "
                                   f"failed with {rc}")
            self._attr = attr
            rc = self.lib.nvshmemx_hostlib_init_attr(INIT_WITH_UNIQUEID, ctypes.byref(attr))
            if rc != 0:
                raise RuntimeError(f"nvshmemx_hostlib_init_attr(UNIQUEID) failed with {rc} on rank {self.rank} "
                                   f"(NVSHMEM {'.'.join(map(str, self.version))}, attr v{2 if v2 else 1}); "
                                   "set NVSHMEM_DEBUG=INFO for NVSHMEM's own log")
            _active = self
        self.my_pe = int(self.lib.nvshmem_my_pe())
        self.n_pes = int(self.lib.nvshmem_n_pes())
        if (self.my_pe, self.n_pes) != (self.rank, self.size):
            raise RuntimeError(f"NVSHMEM PE {self.my_pe}/{self.n_pes} != comm rank {self.rank}/{self.size}")

    # memory
    def malloc(self, nbytes: int) -> int:
        """Collective: a symmetric allocation of nbytes on every PE; this PE's address."""
        ptr = self.lib.nvshmem_malloc(int(nbytes))
        if not ptr and nbytes:
            raise MemoryError(f"nvshmem_malloc({nbytes}) failed (symmetric heap exhausted? "
                              f"NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE', '<default>')})")
        self._allocs[int(ptr or 0)] = int(nbytes)
        return int(ptr or 0)

    def free(self, ptr: int) -> None:
        """Collective."""
        self._allocs.pop(int(ptr), None)
        self.lib.nvshmem_free(ctypes.c_void_p(int(ptr)))

    def ptr(self, addr: int, pe: int) -> int:
        """nvshmem_ptr: load/store address of `addr` on `pe`, 0 when not P2P-reachable."""
        return int(self.lib.nvshmem_ptr(ctypes.c_void_p(int(addr)), int(pe)) or 0)

    # synchronisation
    def barrier_all(self) -> None:
        self.lib.nvshmem_barrier_all()

    def barrier_all_on_stream(self, stream: int) -> None:
        self.lib.nvshmemx_barrier_all_on_stream(ctypes.c_void_p(int(stream)))

    # JIT modules
    def load_module(self, compiled: Any) -> Any:
        """Load a link.LinkedCompileResult as a deepep_portable._C.Module on this runtime's device
        and register it with nvshmemx_cumodule_init. Refuses a cubin linked against another NVSHMEM
        version or installation. The runtime keeps the Module alive until finalize()."""
        paths = getattr(compiled, "nvshmem", None)
        if paths is None:
            raise TypeError("load_module takes a link.LinkedCompileResult (the cubin and the NVSHMEM "
                            f"installation it was linked against), got {type(compiled).__name__}")
        check_linked_against_loaded(paths)
        if getattr(self, "finalized", False):
            raise RuntimeError("load_module after the NVSHMEM runtime was finalized")
        # One loaded module per image for the runtime's life, shared by every window (its device state is the runtime's;
        # windows pass their addresses as parameters): per window, each Buffer's ~1 MB modules stayed until finalize.
        digest = hashlib.sha256(compiled.image).digest()
        module = self._loaded.get(digest)
        if module is None:
            from ... import _C

            module = _C.Module(compiled.image, self.device)
            self.cumodule_init(module)
            self._loaded[digest] = module
        return module

    def cumodule_init(self, module: Any) -> None:
        """Fill NVSHMEM's device state in a loaded, device-linked module (a _C.Module, kept alive until
        finalize) before its first launch. Prefer load_module, which also checks the installation."""
        handle = int(getattr(module, "handle", module))
        if ensure_primary_context(self.device):  # the module's context must be current (raises if not)
            self._extra_retains += 1
        rc = self.lib.nvshmemx_cumodule_init(ctypes.c_void_p(handle))
        if rc != 0:
            raise RuntimeError(f"nvshmemx_cumodule_init failed with {rc} (was the module device-linked "
                               "with libnvshmem_device.a of the same NVSHMEM version?)")
        self._modules[handle] = module

    def cumodule_finalize(self, module: Any) -> None:
        handle = int(getattr(module, "handle", module))
        if handle in self._modules:
            self.lib.nvshmemx_cumodule_finalize(ctypes.c_void_p(handle))
            del self._modules[handle]  # drops our reference after NVSHMEM let go of it
            self._loaded = {d: m for d, m in self._loaded.items() if int(getattr(m, "handle", m)) != handle}

    def finalize(self) -> None:
        """Collective: frees what is left, finalizes registered modules, then NVSHMEM itself."""
        global _active
        if self.finalized:
            return
        for m in list(self._modules):
            self.cumodule_finalize(m)
        for p in list(self._allocs):
            self.free(p)
        self.lib.nvshmemx_hostlib_finalize()
        self.finalized = True
        for _ in range(self._extra_retains + (1 if self._own_context else 0)):
            release_primary_context(self.device)
        self._own_context, self._extra_retains = False, 0
        with _state_lock:
            if _active is self:
                _active = None


def active_runtime() -> Optional[NvshmemRuntime]:
    """The process's initialised runtime, or None."""
    return _active


def shared_runtime(comm: Any, device: int, options: Optional[Mapping[str, Any]] = None,
                   min_heap_bytes: int = 0) -> NvshmemRuntime:
    """Collective on first use: the process's runtime, created over `comm` if there is none yet.

    NVSHMEM is process-global and is initialised once: every later Buffer (and test) shares it, so
    they must use the same ranks (the PEs are the ranks of the first comm) and the same device.
    `min_heap_bytes` raises NVSHMEM_SYMMETRIC_SIZE at creation when the default (or the given
    option) is smaller; it cannot grow afterwards."""
    rt = _active
    if rt is not None:
        if (rt.rank, rt.size, rt.device) != (int(comm.rank), int(comm.size), int(device)):
            raise RuntimeError(f"NVSHMEM is already initialised in this process for rank {rt.rank} of {rt.size} on "
                               f"device {rt.device}; a Buffer over rank {comm.rank} of {comm.size} on device {device} "
                               f"cannot share it (one NVSHMEM job per process)")
        return rt
    opts = dict(options or {})
    if min_heap_bytes:
        given = opts.get("symmetric_size") or os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        if given is None or _parse_size(str(given)) < min_heap_bytes:   # unparsable counts as too small
            opts["symmetric_size"] = str(min_heap_bytes)
    return NvshmemRuntime(comm, device, opts)


def _parse_size(text: str) -> int:
    """NVSHMEM's size syntax: a number with an optional k/m/g/t suffix (powers of 1024; "b", "ib"
    after the suffix tolerated); 0 when it cannot be read."""
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        return 0
