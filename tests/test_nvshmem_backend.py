"""The nvshmem backend on the CPU: device.cuh compiles and device-links against libnvshmem_device.a,
the ctypes layer loads libnvshmem_host.so.3 and resolves every symbol it uses, the structs it
reimplements match the headers byte for byte, and the backend is still not registered.

Needs nvcc (and g++ for the layout check) and the NVSHMEM pip package (nvidia-nvshmem-cu13); each
test skips with the reason when one is missing. Nothing here touches a GPU.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
from types import SimpleNamespace

import pytest

from deepep_portable import jit
from deepep_portable.transports import libraries, probe, system
from deepep_portable.transports.nvshmem import link as jit_link
from deepep_portable.transports.nvshmem import runtime as nr
from deepep_portable.engines import transport_selftest as selftest
from deepep_portable.transports.nvshmem.window import NVSHMEM_BUILD as BUILD

ARCHS = ("sm_80", "sm_90")
EM_CUDA = 190
ET_EXEC = 2


def _nvcc_or_skip() -> str:
    try:
        return jit.find_nvcc()
    except jit.JitCompileError as e:
        pytest.skip(f"no nvcc: {e}")


def _nvshmem_or_skip() -> jit_link.NvshmemBuildPaths:
    try:
        return jit_link.nvshmem_build_paths()
    except jit.JitCompileError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvshmem_jit"))


# ---- a small ELF reader (just what is needed to look at a cubin) ---------------------------------

def _elf_symbols(image: bytes):
    """(e_type, e_machine, e_flags, {name: (type, bind, size)}) of a 64-bit little-endian ELF."""
    assert image[:4] == b"\x7fELF", "not an ELF image"
    assert image[4] == 2 and image[5] == 1, "not ELF64 little-endian"
    e_type, e_machine = struct.unpack_from("<HH", image, 16)
    e_shoff, = struct.unpack_from("<Q", image, 40)
    e_flags, = struct.unpack_from("<I", image, 48)
    e_shentsize, e_shnum = struct.unpack_from("<HH", image, 58)
    sections = []
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        _name, sh_type, _fl, _addr, sh_offset, sh_size, sh_link, _info, _al, sh_entsize = struct.unpack_from(
            "<IIQQQQIIQQ", image, off)
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    syms = {}
    for sh_type, off, size, link, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        str_off, str_size = sections[link][1], sections[link][2]
        strtab = image[str_off:str_off + str_size]
        for j in range(size // (entsize or 24)):
            st_name, st_info, _other, _shndx, _value, st_size = struct.unpack_from("<IBBHQQ", image, off + j * 24)
            name = strtab[st_name:strtab.index(b"\0", st_name)].decode(errors="replace")
            if name:
                syms[name] = (st_info & 0xF, st_info >> 4, st_size)
    return e_type, e_machine, e_flags, syms


# ---- device side: compile + device link ---------------------------------------------------------

def _selftest(arch: str, cache: str, nvshmem=None):
    """The transport conformance kernel built for this backend (what engines/transport_selftest.py loads)."""
    return jit_link.compile_linked_cached(selftest.SOURCE, BUILD.kernel_defines({}), arch, cache=cache,
                                          extra_flags=BUILD.flags, nvshmem=nvshmem)


@pytest.mark.parametrize("arch", ARCHS)
def test_selftest_kernel_links_into_a_cubin(arch, cache):
    _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    res = _selftest(arch, cache)
    assert res.path.startswith(cache) and res.path.endswith(".cubin") and os.path.isfile(res.path)
    e_type, e_machine, e_flags, syms = _elf_symbols(res.image)
    assert e_machine == EM_CUDA
    assert e_type == ET_EXEC, "a device-linked cubin is an executable ELF (relocatable = not linked)"
    assert (e_flags >> 8) & 0xFF == int(arch[3:]), f"cubin is for another architecture (e_flags {e_flags:#x})"
    kind, bind, size = syms[selftest.KERNEL]
    assert (kind, bind) == (2, 1) and size > 0, "kernel must be a global, non-empty FUNC"
    # NVSHMEM's device state came in from libnvshmem_device.a: what nvshmemx_cumodule_init fills.
    assert "nvshmemi_device_state_d" in syms, f"not linked against {paths.device_lib}?"
    # nothing of NVSHMEM left unresolved (vprintf and .nv.reservedSmem.* are the driver's)
    undefined = [n for n, (k, b, s) in syms.items() if "nvshmem" in n and k == 0 and s == 0 and b == 1]
    assert not undefined, undefined
    # second call: a cache hit with the same bytes
    again = _selftest(arch, cache)
    assert again.cache_hit and again.image == res.image


def test_cache_key_covers_defines_and_nvshmem(cache):
    _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    a = _selftest("sm_90", cache)
    b = jit_link.compile_linked_cached(selftest.SOURCE, {**BUILD.kernel_defines({}), "UNUSED_DEFINE": 1}, "sm_90",
                                       cache=cache, extra_flags=BUILD.flags)
    assert a.path != b.path
    other = jit_link.NvshmemBuildPaths(paths.include_dir, paths.lib_dir, paths.device_lib, paths.version + "-x")
    c = _selftest("sm_90", cache, nvshmem=other)
    assert c.path != a.path and not c.cache_hit, "the NVSHMEM version must be part of the key"


def test_compile_errors_are_reported(tmp_path, cache):
    _nvcc_or_skip()
    _nvshmem_or_skip()
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "backends/nvshmem/device.cuh"\nextern "C" __global__ void k() { nvshmem_no_such(); }\n')
    with pytest.raises(jit.JitCompileError) as e:
        jit_link.compile_linked_cached(str(bad), None, "sm_90", cache=cache)
    assert "-rdc=true" in str(e.value) and "nvshmem_no_such" in str(e.value)
    with pytest.raises(ValueError):
        jit_link.compile_linked_cached(str(bad), None, "compute_90", cache=cache)


# ---- host side: the ctypes layer ----------------------------------------------------------------

def _lib_or_skip():
    _nvshmem_or_skip()
    why = nr.load_error()
    if why:
        # It must say what failed and where (library path or what was searched).
        assert "libnvshmem_host.so.3" in why or "nvshmem" in why.lower(), why
        pytest.skip(f"libnvshmem_host.so.3 does not load here: {why}")
    return nr.load_library()


def test_host_library_loads_and_resolves_every_symbol():
    lib = _lib_or_skip()
    for name in nr.SYMBOLS:
        assert getattr(lib, name), name
    v = nr.version()
    assert v >= (3, 0, 0)
    info = libraries.nvshmem_info()
    pip = info["pip"].get("nvidia-nvshmem-cu13")
    from_pip = os.sep + os.path.join("nvidia", "nvshmem", "lib") + os.sep in info["host_lib"]
    if pip and from_pip and not os.environ.get("NVSHMEM_HOME"):
        assert ".".join(map(str, v)) == ".".join(pip.split(".")[:3])
    # the headers jit_link compiles against are the same release as the library loaded here
    assert jit_link.header_version(info["include_dir"]) == ".".join(map(str, v))


def test_missing_library_gives_a_reason(monkeypatch):
    monkeypatch.setattr(libraries, "nvshmem_info", lambda: {"host_lib": None, "searched": ["/nowhere/lib"], "pip": {}})
    nr._load.cache_clear()
    try:
        assert "libnvshmem_host.so.3 not found" in nr.load_error() and "/nowhere/lib" in nr.load_error()
        with pytest.raises(nr.NvshmemUnavailable, match="nvidia-nvshmem-cu13"):
            nr.load_library()
    finally:
        nr._load.cache_clear()


_LAYOUT_PROGRAM = r"""
#include <cstdio>
#include <cstddef>
#include <nvshmem.h>
#include <nvshmemx.h>
#define S(T) std::printf("sizeof %s %zu\n", #T, sizeof(T))
#define O(T, f) std::printf("offsetof %s.%s %zu\n", #T, #f, offsetof(T, f))
// init attr / args v2 (cuda_device_id) exist from NVSHMEM 3.8 on (3.4.x, on the lent H200: v1 only)
#define HAS_V2 (NVSHMEM_VENDOR_MAJOR_VERSION * 100 + NVSHMEM_VENDOR_MINOR_VERSION >= 308)
int main() {
    std::printf("value has_v2 %d\n", (int)HAS_V2);
    S(nvshmemx_uniqueid_v1); O(nvshmemx_uniqueid_v1, version); O(nvshmemx_uniqueid_v1, internal);
    S(nvshmemx_uniqueid_args_v1); O(nvshmemx_uniqueid_args_v1, version); O(nvshmemx_uniqueid_args_v1, id);
    O(nvshmemx_uniqueid_args_v1, myrank); O(nvshmemx_uniqueid_args_v1, nranks);
    S(nvshmemx_init_args_v1); O(nvshmemx_init_args_v1, version); O(nvshmemx_init_args_v1, uid_args);
    O(nvshmemx_init_args_v1, content);
    S(nvshmemx_init_attr_v1); O(nvshmemx_init_attr_v1, version); O(nvshmemx_init_attr_v1, mpi_comm);
    O(nvshmemx_init_attr_v1, args);
    std::printf("same nvshmemx_uniqueid_t %d\n", (int)(sizeof(nvshmemx_uniqueid_t) == sizeof(nvshmemx_uniqueid_v1)));
    nvshmemx_uniqueid_t u = NVSHMEMX_UNIQUEID_INITIALIZER;
    std::printf("value uid.version %d\n", u.version);
    std::printf("value flag.uniqueid %d\n", (int)NVSHMEMX_INIT_WITH_UNIQUEID);
    std::printf("value signal.set %d\n", (int)NVSHMEM_SIGNAL_SET);
#if HAS_V2
    S(nvshmemx_init_args_v2); O(nvshmemx_init_args_v2, version); O(nvshmemx_init_args_v2, uid_args);
    O(nvshmemx_init_args_v2, cuda_device_id); O(nvshmemx_init_args_v2, content);
    S(nvshmemx_init_attr_v2); O(nvshmemx_init_attr_v2, version); O(nvshmemx_init_attr_v2, mpi_comm);
    O(nvshmemx_init_attr_v2, args);
    std::printf("same nvshmemx_init_attr_t %d\n", (int)(sizeof(nvshmemx_init_attr_t) == sizeof(nvshmemx_init_attr_v2)));
    nvshmemx_init_attr_t a = NVSHMEMX_INIT_ATTR_INITIALIZER;
    std::printf("value attr_v2.version %d\n", a.version);
    std::printf("value attr_v2.args.version %d\n", a.args.version);
    std::printf("value attr_v2.args.uid_args.version %d\n", a.args.uid_args.version);
    std::printf("value attr_v2.args.uid_args.myrank %d\n", a.args.uid_args.myrank);
    std::printf("value attr_v2.args.cuda_device_id %d\n", a.args.cuda_device_id);
    nvshmemx_init_attr_v1 b = NVSHMEMX_INIT_ATTR_V1_INITIALIZER;
#else
    std::printf("same nvshmemx_init_attr_t %d\n", (int)(sizeof(nvshmemx_init_attr_t) == sizeof(nvshmemx_init_attr_v1)));
    nvshmemx_init_attr_t b = NVSHMEMX_INIT_ATTR_INITIALIZER;  // v1 is the default there
    std::printf("value attr_v1.args.uid_args.version %d\n", b.args.uid_args.version);
    std::printf("value attr_v1.args.uid_args.myrank %d\n", b.args.uid_args.myrank);
#endif
    std::printf("value attr_v1.version %d\n", b.version);
    std::printf("value attr_v1.args.version %d\n", b.args.version);
    return 0;
}
"""


def _cuda_include_dir(nvcc: str):
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), jit_link.nvcc_toolkit_root(nvcc),
             "/usr/local/cuda"]
    for r in roots:
        if r and os.path.isfile(os.path.join(r, "include", "cuda.h")) and \
                os.path.isfile(os.path.join(r, "include", "cuda_runtime.h")):
            return os.path.join(r, "include")
    return None


def test_reimplemented_structs_match_the_headers(tmp_path):
    nvcc = _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no host C++ compiler (g++) to compile the layout program")
    cuda_inc = _cuda_include_dir(nvcc)
    if cuda_inc is None:
        pytest.skip("cuda.h / cuda_runtime.h not found (set CUDA_HOME)")
    src = tmp_path / "layout.cpp"
    src.write_text(_LAYOUT_PROGRAM)
    exe = tmp_path / "layout"
    cmd = [gxx, "-std=c++17", f"-I{paths.include_dir}", f"-I{cuda_inc}",
           *(f"-I{d}" for d in jit_link.cuda_include_dirs(nvcc)), str(src), "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    got = {tuple(ln.split()[:2]): int(ln.split()[2]) for ln in lines}

    mirrors = {"nvshmemx_uniqueid_v1": nr.UniqueId, "nvshmemx_uniqueid_args_v1": nr.UniqueIdArgs,
               "nvshmemx_init_args_v1": nr.InitArgsV1, "nvshmemx_init_args_v2": nr.InitArgsV2,
               "nvshmemx_init_attr_v1": nr.InitAttrV1, "nvshmemx_init_attr_v2": nr.InitAttrV2}
    has_v2 = got[("value", "has_v2")] == 1
    checked = 0
    for (what, name), value in got.items():
        if what == "sizeof":
            assert ctypes.sizeof(mirrors[name]) == value, name
            checked += 1
        elif what == "offsetof":
            t, f = name.split(".")
            assert getattr(mirrors[t], f).offset == value, name
            checked += 1
    # every sizeof and offsetof the program printed was compared (v1 always, v2 where it exists)
    assert checked == (4 + 12) + ((2 + 7) if has_v2 else 0)
    assert got[("same", "nvshmemx_uniqueid_t")] == 1
    assert got[("same", "nvshmemx_init_attr_t")] == 1, "nvshmemx_init_attr_t changed: update the mirror"
    # the runtime sends v2 exactly when the headers of that release define it
    assert has_v2 == (tuple(int(x) for x in paths.version.split(".")) >= (3, 8, 0))

    uid = nr.new_unique_id()
    assert uid.version == got[("value", "uid.version")]
    a1 = nr.new_init_attr(False)
    assert a1.version == got[("value", "attr_v1.version")]
    assert a1.args.version == got[("value", "attr_v1.args.version")]
    if has_v2:
        a2 = nr.new_init_attr(True, -1)
        assert a2.version == got[("value", "attr_v2.version")]
        assert a2.args.version == got[("value", "attr_v2.args.version")]
        assert a2.args.uid_args.version == got[("value", "attr_v2.args.uid_args.version")]
        assert a2.args.uid_args.myrank == got[("value", "attr_v2.args.uid_args.myrank")]
        assert a2.args.cuda_device_id == got[("value", "attr_v2.args.cuda_device_id")]
    else:
        assert a1.args.uid_args.version == got[("value", "attr_v1.args.uid_args.version")]
        assert a1.args.uid_args.myrank == got[("value", "attr_v1.args.uid_args.myrank")]
    assert nr.INIT_WITH_UNIQUEID == got[("value", "flag.uniqueid")]
    assert got[("value", "signal.set")] == 9


def test_wait_ge_uses_the_point_to_point_test_routine():
    """The receive side goes through nvshmem_uint64_test (the documented way a target PE orders its
    reads after a put-with-signal / fence) plus an acquire fence, never a bare load."""
    text = open(os.path.join(jit.kernel_root(), "backends", "nvshmem", "device.cuh")).read()
    body = text[text.index("DEEPEP_DEVICE bool wait_ge"):]
    body = body[:body.index("\n    }\n")]
    assert "nvshmem_uint64_test(" in body and "NVSHMEM_CMP_GE" in body
    assert "fence.acq_rel.sys" in body
    assert "deepep_portable::wait_ge(" not in body and "ld_acquire_sys" not in body


def test_environment():
    env = nr.nvshmem_environment()
    assert env == {"NVSHMEM_DISABLE_NVLS": "1"}
    env = nr.nvshmem_environment(dict(ibgda=True, ib_gid_index=3, ib_traffic_class=106, ib_sl=3,
                                      symmetric_size="2G", hca_list=None))
    assert env == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_IB_GID_INDEX": "3",
                   "NVSHMEM_IB_TRAFFIC_CLASS": "106", "NVSHMEM_IB_SL": "3", "NVSHMEM_SYMMETRIC_SIZE": "2G"}
    assert nr.nvshmem_environment({"bootstrap": "UID"})["NVSHMEM_BOOTSTRAP"] == "UID"
    with pytest.raises(ValueError, match="unknown NVSHMEM option"):
        nr.nvshmem_environment({"ib_gid": 3})


@pytest.mark.parametrize("source,kernels,logfmt,phase", [
    ("common/kernels/low_latency/dispatch.cu", ("_ZN15deepep_portable11low_latency8dispatchE16LLDispatchParams",),
     None, None),
    ("common/kernels/low_latency/combine.cu", ("_ZN15deepep_portable11low_latency7combineE15LLCombineParams",),
     False, 1),
    ("common/kernels/low_latency/combine.cu", ("_ZN15deepep_portable11low_latency7combineE15LLCombineParams",),
     False, 2),
    ("common/kernels/low_latency/combine.cu", ("_ZN15deepep_portable11low_latency7combineE15LLCombineParams",),
     True, 1),
    ("common/kernels/low_latency/combine.cu", ("_ZN15deepep_portable11low_latency7combineE15LLCombineParams",),
     True, 2),
    ("common/kernels/low_latency/clean.cu", ("_ZN15deepep_portable11low_latency12clean_bufferE13LLCleanParams",),
     None, None),
])
def test_low_latency_kernels_link_for_the_nvshmem_transport(source, kernels, logfmt, phase, cache):
    """The LL kernels, built against the NVSHMEM backend (what transport="nvshmem" loads), device-link
    with nothing of NVSHMEM left unresolved."""
    _nvcc_or_skip()
    _nvshmem_or_skip()
    from deepep_portable.engines import low_latency as ll

    from deepep_portable.transports.nvshmem.window import NVSHMEM_BUILD as build

    defines = {} if source == ll.CLEAN_SOURCE else ll.kernel_defines(7168, 8, logfmt, phase)   # phase: the combine's
    res = jit_link.compile_linked_cached(source, build.kernel_defines(defines), "sm_90", cache=cache,
                                         extra_flags=build.flags)
    e_type, _, _, syms = _elf_symbols(res.image)
    assert e_type == ET_EXEC
    for k in kernels:
        assert syms[k][:2] == (2, 1), k
    assert "nvshmemi_device_state_d" in syms
    undefined = [n for n, (k, b, s) in syms.items() if "nvshmem" in n and k == 0 and s == 0 and b == 1]
    assert not undefined, undefined


def test_backend_is_registered():
    from deepep_portable.transports import backend_class
    from deepep_portable.transports.kernel import KernelTransport

    cls = backend_class("nvshmem")
    assert cls.name == "nvshmem" and issubclass(cls, KernelTransport)
    probe.clear_cache()
    st = probe.probe("nvshmem")
    assert "not implemented" not in st.reason, st.reason


def test_shared_runtime_is_one_per_process(monkeypatch):
    """A second Buffer shares the process's NVSHMEM; over other ranks or another device it is refused."""
    fake = SimpleNamespace(rank=1, size=4, device=0)
    monkeypatch.setattr(nr, "_active", fake)
    assert nr.shared_runtime(SimpleNamespace(rank=1, size=4), 0) is fake
    with pytest.raises(RuntimeError, match="already initialised"):
        nr.shared_runtime(SimpleNamespace(rank=0, size=2), 0)
    with pytest.raises(RuntimeError, match="already initialised"):
        nr.shared_runtime(SimpleNamespace(rank=1, size=4), 1)
    assert nr._parse_size("2G") == 2 << 30 and nr._parse_size("512m") == 512 << 20 and nr._parse_size("4096") == 4096
    assert nr._parse_size("1GiB") == 1 << 30 and nr._parse_size("") == 0 and nr._parse_size("lots") == 0


def test_unique_id_and_attr_with_the_real_library():
    """nvshmemx_get_uniqueid and nvshmemx_set_attr_uniqueid_args need no GPU: run them for real."""
    lib = _lib_or_skip()
    uid = nr.new_unique_id()
    assert lib.nvshmemx_get_uniqueid(ctypes.byref(uid)) == 0
    assert uid.version == (1 << 16) + 128
    assert any(bytes(uid)[4:]), "the unique id is still all zero"
    for v2 in (True, False):
        attr = nr.new_init_attr(v2, 0)
        assert lib.nvshmemx_set_attr_uniqueid_args(1, 4, ctypes.byref(uid), ctypes.byref(attr)) == 0
        assert (attr.args.uid_args.myrank, attr.args.uid_args.nranks) == (1, 4)
        assert ctypes.addressof(attr.args.uid_args.id.contents) == ctypes.addressof(uid)
    assert lib.nvshmemx_init_status() == 0, "nothing may be initialised on the CPU"


class _FakeComm:
    """Ranks in one process, run one after the other: each rank's allgather contribution is
    recorded, and a rank sees every contribution made so far, padded with what `others` says the
    ranks not run yet contribute (rank 0 runs first, so later ranks see its unique id)."""

    def __init__(self, rank, size, box, others=("", "")):
        self.rank, self.size, self.box, self.others = rank, size, box, others

    def allgather_object(self, obj):
        self.box[self.rank] = obj
        return [self.box.get(r, (b"", self.others[1]) if r != self.rank else obj) for r in range(self.size)]


class _FakeLib:
    """The real library for the id functions; init / PE queries / teardown recorded instead."""

    def __init__(self, real, pe, npes):
        self.real, self.pe, self.npes, self.calls = real, pe, npes, []
        self.nvshmemx_get_uniqueid = real.nvshmemx_get_uniqueid
        self.nvshmemx_set_attr_uniqueid_args = real.nvshmemx_set_attr_uniqueid_args
        self.nvshmemx_vendor_get_version_info = real.nvshmemx_vendor_get_version_info

    def nvshmemx_hostlib_init_attr(self, flags, attr_ref):
        attr = attr_ref._obj
        self.calls.append(("init", flags, type(attr).__name__, attr.args.uid_args.myrank,
                           attr.args.uid_args.nranks, bytes(attr.args.uid_args.id.contents)))
        return 0

    def nvshmem_my_pe(self):
        return self.pe

    def nvshmem_n_pes(self):
        return self.npes

    def nvshmemx_hostlib_finalize(self):
        self.calls.append(("finalize",))


def test_runtime_bootstrap_flow_without_a_gpu(monkeypatch):
    """NvshmemRuntime: rank 0's unique id reaches rank 1 byte for byte, both init with the UID flag
    and their own rank, the environment is set, one runtime per process."""
    real = _lib_or_skip()
    box = {}
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)  # restored afterwards
    monkeypatch.delenv("NVSHMEM_IB_SL", raising=False)
    contexts = []
    monkeypatch.setattr(nr, "ensure_primary_context", lambda d: contexts.append(d) or False)
    runtimes = []
    for rank in (0, 1):
        fake = _FakeLib(real, rank, 2)
        monkeypatch.setattr(nr, "_load", lambda fake=fake: (fake, "", "fake"))
        rt = nr.NvshmemRuntime(_FakeComm(rank, 2, box), device=rank, options={"ib_sl": 3})
        if rank == 0:
            with pytest.raises(RuntimeError, match="already initialised"):
                nr.NvshmemRuntime(_FakeComm(0, 2, {}), device=0)
        rt.finalize()
        runtimes.append((rt, fake))
    assert contexts == [0, 1], "each rank must check its device's context before init"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1" and os.environ["NVSHMEM_IB_SL"] == "3"
    inits = [f.calls[0] for _, f in runtimes]
    want_attr = "InitAttrV2" if nr.version() >= (3, 8, 0) else "InitAttrV1"
    assert [c[:5] for c in inits] == [("init", nr.INIT_WITH_UNIQUEID, want_attr, r, 2) for r in (0, 1)]
    assert inits[0][5] == inits[1][5] and any(inits[0][5][4:]), "rank 1 must use rank 0's unique id"
    assert all(f.calls[-1] == ("finalize",) for _, f in runtimes)


def test_a_failing_rank_stops_every_rank_before_the_bootstrap(monkeypatch):
    """A rank whose CUDA context is wrong reports it through the id exchange: no rank calls init
    (which would block in the UID bootstrap waiting for it)."""
    real = _lib_or_skip()

    def bad_context(device):
        if device == 1:
            raise RuntimeError("not the primary context")
        return False

    monkeypatch.setattr(nr, "ensure_primary_context", bad_context)
    fakes = []
    for rank in (0, 1):
        fake = _FakeLib(real, rank, 2)
        fakes.append(fake)
        monkeypatch.setattr(nr, "_load", lambda fake=fake: (fake, "", "fake"))
        # rank 0 sees rank 1's error (what a real allgather delivers), rank 1 sees its own
        comm = _FakeComm(rank, 2, {}, others=("", "RuntimeError: not the primary context"))
        with pytest.raises(RuntimeError, match="rank 1: RuntimeError: not the primary context"):
            nr.NvshmemRuntime(comm, device=rank)
    assert all(not f.calls for f in fakes), "nobody may enter nvshmemx_hostlib_init_attr"


class _FakeCuda:
    """cuDeviceGet / cuDevicePrimaryCtxRetain / cuCtxGetCurrent / cuCtxSetCurrent / release."""

    def __init__(self, current):
        self.current, self.primary, self.retains, self.set_to = current, 0xC0DE, 0, None

    def cuDeviceGet(self, ref, ordinal):
        ref._obj.value = ordinal.value
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, dev):
        self.retains += 1
        ref._obj.value = self.primary
        return 0

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = self.current
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.set_to = self.current = ctx.value
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        self.retains -= 1
        return 0


def test_context_check(monkeypatch):
    none = _FakeCuda(current=None)
    monkeypatch.setattr(system, "_driver", lambda: none)
    assert nr.ensure_primary_context(0) is True and none.set_to == 0xC0DE and none.retains == 1
    nr.release_primary_context(0)
    assert none.retains == 0
    primary = _FakeCuda(current=0xC0DE)
    monkeypatch.setattr(system, "_driver", lambda: primary)
    assert nr.ensure_primary_context(0) is False and primary.set_to is None and primary.retains == 0
    other = _FakeCuda(current=0xBAD)
    monkeypatch.setattr(system, "_driver", lambda: other)
    with pytest.raises(RuntimeError, match="not device 0's primary context"):
        nr.ensure_primary_context(0)
    assert other.retains == 0 and other.set_to is None


# ---- one installation: link and run with the same NVSHMEM ---------------------------------------

def test_compiled_cubin_names_its_installation(cache):
    _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    res = _selftest("sm_90", cache)
    assert isinstance(res, jit_link.LinkedCompileResult) and res.nvshmem == paths
    assert paths.host_lib and os.path.dirname(paths.host_lib) == paths.lib_dir


def test_headers_of_another_release_are_refused(monkeypatch, tmp_path):
    paths = _nvshmem_or_skip()
    info = dict(libraries.nvshmem_info())
    assert jit_link.header_version(paths.include_dir) == paths.version
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "nvshmem.h").write_text("#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 4\n"
                                   "#  define NVSHMEM_VENDOR_PATCH_VERSION 5\n")
    assert jit_link.header_version(str(inc)) == "3.4.5"
    monkeypatch.setattr(libraries, "nvshmem_info", lambda: {**info, "include_dir": str(inc), "version": "3.8.0"})
    with pytest.raises(jit.JitCompileError, match=r"version mismatch.*3\.4\.5.*3\.8\.0"):
        jit_link.nvshmem_build_paths()


def test_a_cubin_of_another_installation_is_refused():
    _lib_or_skip()
    paths = _nvshmem_or_skip()
    nr.check_linked_against_loaded(paths)  # the real pair matches
    other_version = jit_link.NvshmemBuildPaths(paths.include_dir, paths.lib_dir, paths.device_lib, "3.4.5-x")
    with pytest.raises(nr.NvshmemUnavailable, match="version mismatch"):
        nr.check_linked_against_loaded(other_version)
    other_place = jit_link.NvshmemBuildPaths("/elsewhere/include", "/elsewhere/lib",
                                             "/elsewhere/lib/libnvshmem_device.a", paths.version)
    with pytest.raises(nr.NvshmemUnavailable, match="installation mismatch"):
        nr.check_linked_against_loaded(other_place)
    rt = object.__new__(nr.NvshmemRuntime)
    with pytest.raises(TypeError, match="LinkedCompileResult"):
        rt.load_module(b"\x7fELF")
    with pytest.raises(nr.NvshmemUnavailable, match="version mismatch"):
        rt.load_module(jit_link.LinkedCompileResult(b"\x7fELF", "x", True, 0.0, "sm_90", False, other_version))


def test_a_second_nvshmem_in_the_process_is_refused(monkeypatch):
    _nvshmem_or_skip()
    monkeypatch.setattr(nr.libraries, "mapped_files", lambda: ["/opt/other/lib/libnvshmem_host.so.3"])
    nr._load.cache_clear()
    try:
        why = nr.load_error()
        assert "already loaded" in why and "/opt/other/lib/libnvshmem_host.so.3" in why, why
    finally:
        nr._load.cache_clear()


def test_module_exposes_its_cumodule_handle():
    """_C.Module.handle (the CUmodule as an int) is what nvshmemx_cumodule_init takes."""
    _C = pytest.importorskip("deepep_portable._C")
    prop = _C.Module.__dict__.get("handle")
    assert isinstance(prop, property) and prop.fset is None, "Module.handle: a read-only property"
    assert not hasattr(nr, "CudaModule"), "the ctypes module loader is gone: _C.Module does it"


def test_runtime_capabilities_follow_the_window():
    """peer_load_store is known once the window exists: true only when no PE is behind a network."""
    from deepep_portable.transports.nvshmem.transport import NvshmemTransport

    t = NvshmemTransport.__new__(NvshmemTransport)   # no Buffer set-up: only the record is under test
    t.ll_engine = None
    assert t.runtime_capabilities() == NvshmemTransport.capabilities
    t.ll_engine = SimpleNamespace(window=SimpleNamespace(base=0x1000, network_peers=[]))
    assert t.runtime_capabilities().peer_load_store is True
    t.ll_engine.window.network_peers = [3]
    caps = t.runtime_capabilities()
    assert caps.peer_load_store is False and caps.remote_atomics is True and caps.graph_safe is True


def test_windows_share_one_loaded_module_per_image(monkeypatch):
    """load_module loads and registers an image once per runtime (1000 Buffers over nvshmem
    lost 4.4 GiB at 4 ranks when each window loaded its own copies); another image is another module."""
    _C = pytest.importorskip("deepep_portable._C")
    loads, inits = [], []

    class FakeModule:
        def __init__(self, image, device):
            loads.append(image)
            self.handle = len(loads)

    monkeypatch.setattr(_C, "Module", FakeModule)
    monkeypatch.setattr(nr, "check_linked_against_loaded", lambda paths: None)
    rt = object.__new__(nr.NvshmemRuntime)
    rt.device, rt._modules, rt._loaded = 0, {}, {}
    monkeypatch.setattr(rt, "cumodule_init", lambda m: inits.append(m), raising=False)
    paths = jit_link.NvshmemBuildPaths("/i", "/l", "/l/libnvshmem_device.a", "3.4.5")

    def compiled(image):
        return jit_link.LinkedCompileResult(image, "x", True, 0.0, "sm_90", False, paths)

    a1, a2, b = rt.load_module(compiled(b"A" * 64)), rt.load_module(compiled(b"A" * 64)), rt.load_module(compiled(b"B"))
    assert a1 is a2 and b is not a1
    assert loads == [b"A" * 64, b"B"] and inits == [a1, b]
    # a finalized module (by handle, as finalize() passes them) is never handed out again
    finalized = []
    rt.lib = type("Lib", (), {"nvshmemx_cumodule_finalize": staticmethod(lambda h: finalized.append(h.value))})()
    rt._modules = {a1.handle: a1, b.handle: b}
    rt.cumodule_finalize(a1.handle)
    assert finalized == [a1.handle] and rt.load_module(compiled(b"A" * 64)) is not a1 and len(loads) == 3
    rt.finalized = True
    with pytest.raises(RuntimeError, match="finalized"):
        rt.load_module(compiled(b"B"))
