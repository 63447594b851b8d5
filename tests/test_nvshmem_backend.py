"""The nvshmem backend on the CPU: device.cuh compiles and device-links against libnvshmem_device.a,
the ctypes layer loads libnvshmem_host.so.3 and resolves every symbol it uses, the structs it
reimplements match the headers byte for byte, and the backend is still not registered.

Needs nvcc (and g++ for the layout check) and the NVSHMEM pip package (nvidia-nvshmem-cu13); each
test skips with the reason when one is missing. Nothing here touches a GPU.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import struct
import subprocess

import pytest

from deepep_portable import jit, jit_link, nvshmem_runtime as nr
from deepep_portable.transports import probe

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

@pytest.mark.parametrize("arch", ARCHS)
def test_selftest_kernel_links_into_a_cubin(arch, cache):
    _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    res = jit_link.compile_selftest(arch, data_bytes=4096, cache=cache)
    assert res.path.startswith(cache) and res.path.endswith(".cubin") and os.path.isfile(res.path)
    e_type, e_machine, e_flags, syms = _elf_symbols(res.image)
    assert e_machine == EM_CUDA
    assert e_type == ET_EXEC, "a device-linked cubin is an executable ELF (relocatable = not linked)"
    assert (e_flags >> 8) & 0xFF == int(arch[3:]), f"cubin is for another architecture (e_flags {e_flags:#x})"
    kind, bind, size = syms[jit_link.SELFTEST_KERNEL]
    assert (kind, bind) == (2, 1) and size > 0, "kernel must be a global, non-empty FUNC"
    # NVSHMEM's device state came in from libnvshmem_device.a: what nvshmemx_cumodule_init fills.
    assert "nvshmemi_device_state_d" in syms, f"not linked against {paths.device_lib}?"
    # nothing of NVSHMEM left unresolved (vprintf and .nv.reservedSmem.* are the driver's)
    undefined = [n for n, (k, b, s) in syms.items() if "nvshmem" in n and k == 0 and s == 0 and b == 1]
    assert not undefined, undefined
    # second call: a cache hit with the same bytes
    again = jit_link.compile_selftest(arch, data_bytes=4096, cache=cache)
    assert again.cache_hit and again.image == res.image


def test_cache_key_covers_defines_and_nvshmem(cache):
    _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    a = jit_link.compile_selftest("sm_90", data_bytes=4096, cache=cache)
    b = jit_link.compile_selftest("sm_90", data_bytes=8192, cache=cache)
    assert a.path != b.path
    other = jit_link.NvshmemBuildPaths(paths.include_dir, paths.lib_dir, paths.device_lib, paths.version + "-x")
    src = jit_link.selftest_source_path(cache)
    c = jit_link.compile_linked_cached(src, {"DATA_BYTES": 4096}, "sm_90", cache=cache, nvshmem=other)
    assert c.path != a.path and not c.cache_hit, "the NVSHMEM version must be part of the key"


def test_selftest_param_struct_matches_kernel(cache, tmp_path):
    """SelftestParams (ctypes) has the kernel parameter's size (read from the PTX)."""
    nvcc = _nvcc_or_skip()
    paths = _nvshmem_or_skip()
    src = jit_link.selftest_source_path(cache)
    ptx = tmp_path / "k.ptx"
    cmd = [nvcc, *jit.BASE_FLAGS, "-rdc=true", "-ptx", "-arch=sm_90", f"-I{jit.kernel_root()}",
           f"-I{paths.include_dir}", "-DDATA_BYTES=4096", src, "-o", str(ptx)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    m = re.search(rf"\.entry {jit_link.SELFTEST_KERNEL}\(\s*\.param\s+\.align\s+(\d+)\s+\.b8\s+\w+\[(\d+)\]",
                  ptx.read_text())
    assert m, "kernel parameter not found in the PTX"
    assert int(m.group(2)) == ctypes.sizeof(nr.SelftestParams)
    assert ctypes.sizeof(nr.TransportParams) == 16


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
    pip = probe.nvshmem_info()["pip"].get("nvidia-nvshmem-cu13")
    if pip:
        assert ".".join(map(str, v)) == ".".join(pip.split(".")[:3])


def test_missing_library_gives_a_reason(monkeypatch):
    monkeypatch.setattr(probe, "nvshmem_info", lambda: {"host_lib": None, "searched": ["/nowhere/lib"], "pip": {}})
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
int main() {
    S(nvshmemx_uniqueid_v1); O(nvshmemx_uniqueid_v1, version); O(nvshmemx_uniqueid_v1, internal);
    S(nvshmemx_uniqueid_args_v1); O(nvshmemx_uniqueid_args_v1, version); O(nvshmemx_uniqueid_args_v1, id);
    O(nvshmemx_uniqueid_args_v1, myrank); O(nvshmemx_uniqueid_args_v1, nranks);
    S(nvshmemx_init_args_v1); O(nvshmemx_init_args_v1, version); O(nvshmemx_init_args_v1, uid_args);
    O(nvshmemx_init_args_v1, content);
    S(nvshmemx_init_args_v2); O(nvshmemx_init_args_v2, version); O(nvshmemx_init_args_v2, uid_args);
    O(nvshmemx_init_args_v2, cuda_device_id); O(nvshmemx_init_args_v2, content);
    S(nvshmemx_init_attr_v1); O(nvshmemx_init_attr_v1, version); O(nvshmemx_init_attr_v1, mpi_comm);
    O(nvshmemx_init_attr_v1, args);
    S(nvshmemx_init_attr_v2); O(nvshmemx_init_attr_v2, version); O(nvshmemx_init_attr_v2, mpi_comm);
    O(nvshmemx_init_attr_v2, args);
    std::printf("same nvshmemx_uniqueid_t %d\n", (int)(sizeof(nvshmemx_uniqueid_t) == sizeof(nvshmemx_uniqueid_v1)));
    std::printf("same nvshmemx_init_attr_t %d\n", (int)(sizeof(nvshmemx_init_attr_t) == sizeof(nvshmemx_init_attr_v2)));
    nvshmemx_uniqueid_t u = NVSHMEMX_UNIQUEID_INITIALIZER;
    std::printf("value uid.version %d\n", u.version);
    nvshmemx_init_attr_t a = NVSHMEMX_INIT_ATTR_INITIALIZER;
    std::printf("value attr_v2.version %d\n", a.version);
    std::printf("value attr_v2.args.version %d\n", a.args.version);
    std::printf("value attr_v2.args.uid_args.version %d\n", a.args.uid_args.version);
    std::printf("value attr_v2.args.uid_args.myrank %d\n", a.args.uid_args.myrank);
    std::printf("value attr_v2.args.cuda_device_id %d\n", a.args.cuda_device_id);
    nvshmemx_init_attr_v1 b = NVSHMEMX_INIT_ATTR_V1_INITIALIZER;
    std::printf("value attr_v1.version %d\n", b.version);
    std::printf("value attr_v1.args.version %d\n", b.args.version);
    std::printf("value flag.uniqueid %d\n", (int)NVSHMEMX_INIT_WITH_UNIQUEID);
    std::printf("value signal.set %d\n", (int)NVSHMEM_SIGNAL_SET);
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
    checked = 0
    for (what, name), value in got.items():
        if what == "sizeof":
            assert ctypes.sizeof(mirrors[name]) == value, name
            checked += 1
        elif what == "offsetof":
            t, f = name.split(".")
            assert getattr(mirrors[t], f).offset == value, name
            checked += 1
    assert checked == 6 + 19  # every sizeof and offsetof printed above was compared
    assert got[("same", "nvshmemx_uniqueid_t")] == 1
    assert got[("same", "nvshmemx_init_attr_t")] == 1, "nvshmemx_init_attr_t is no longer v2: update the mirror"

    uid = nr.new_unique_id()
    assert uid.version == got[("value", "uid.version")]
    a2 = nr.new_init_attr(True, -1)
    assert a2.version == got[("value", "attr_v2.version")]
    assert a2.args.version == got[("value", "attr_v2.args.version")]
    assert a2.args.uid_args.version == got[("value", "attr_v2.args.uid_args.version")]
    assert a2.args.uid_args.myrank == got[("value", "attr_v2.args.uid_args.myrank")]
    assert a2.args.cuda_device_id == got[("value", "attr_v2.args.cuda_device_id")]
    a1 = nr.new_init_attr(False)
    assert a1.version == got[("value", "attr_v1.version")]
    assert a1.args.version == got[("value", "attr_v1.args.version")]
    assert nr.INIT_WITH_UNIQUEID == got[("value", "flag.uniqueid")]
    assert got[("value", "signal.set")] == 9


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


def test_backend_is_not_registered():
    """Until its kernels have run on a GPU, the nvshmem transport stays 'not implemented'."""
    import deepep_portable.transports as transports

    assert not os.path.exists(os.path.join(os.path.dirname(transports.__file__), "nvshmem.py"))
    probe.clear_cache()
    st = probe.probe("nvshmem")
    assert not st.usable and "not implemented" in st.reason, st.reason


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
    """Two ranks in one process: rank 0's broadcast payload is replayed to rank 1."""

    def __init__(self, rank, size, box):
        self.rank, self.size, self.box = rank, size, box

    def broadcast_object(self, obj, root=0):
        if self.rank == root:
            self.box["b"] = obj
        return self.box["b"]


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
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1" and os.environ["NVSHMEM_IB_SL"] == "3"
    inits = [f.calls[0] for _, f in runtimes]
    want_attr = "InitAttrV2" if nr.version() >= (3, 8, 0) else "InitAttrV1"
    assert [c[:5] for c in inits] == [("init", nr.INIT_WITH_UNIQUEID, want_attr, r, 2) for r in (0, 1)]
    assert inits[0][5] == inits[1][5] and any(inits[0][5][4:]), "rank 1 must use rank 0's unique id"
    assert all(f.calls[-1] == ("finalize",) for _, f in runtimes)


def test_cuda_module_without_driver_says_why():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(nr.NvshmemUnavailable, match="libcuda.so.1"):
            nr.CudaModule(b"\x7fELF", 0)
    else:
        pytest.skip("a CUDA driver is installed here")
