"""CPU tests of the host module and the JIT (no GPU needed; nvcc needed for the compile tests)."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys

import pytest

from deepep_portable import _C, jit, jit_key

try:
    NVCC, NVCC_MISSING = jit.find_nvcc(), ""
except jit.JitCompileError as e:  # pragma: no cover - CI always has a compiler
    NVCC, NVCC_MISSING = None, str(e)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason=NVCC_MISSING)

ELF_MAGIC = b"\x7fELF"
FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
# The layout kernel takes every shape at run time; defines here only vary the cache key (nvcc accepts
# defines the source never reads).
LAYOUT_VARIANTS = [
    dict(),
    dict(EXAMPLE_DEFINE=1, OTHER_DEFINE=2),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jit_cache"))


# ---- _C without a GPU -----------------------------------------------------------------------

def test_driver_status_is_clean():
    ok, reason = _C.driver_status()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if not ok:
        # Everything that needs the driver raises RuntimeError naming the reason; nothing crashes.
        for call in (_C.device_count, lambda: _C.device_info(0), lambda: _C.Module(b"\0" * 16, 0),
                     lambda: _C.mem_alloc(0, 16), lambda: _C.ipc_open_mem_handle(0, b"\0" * 64)):
            with pytest.raises(RuntimeError, match="CUDA driver unavailable"):
                call()
    assert _C.IPC_HANDLE_BYTES == 64


def test_driver_status_names_missing_library(tmp_path):
    # A fresh interpreter pointed at a library that does not exist reports exactly that.
    env = dict(os.environ, DEEPEP_PORTABLE_LIBCUDA=str(tmp_path / "libcuda-missing.so.1"))
    out = subprocess.run([sys.executable, "-c", "from deepep_portable import _C; print(_C.driver_status())"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert "(False," in out and "libcuda-missing.so.1 not found" in out


# ---- compiling --------------------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("defines", LAYOUT_VARIANTS, ids=["plain", "defines"])
def test_compile_layout_cubin_and_cache(cache, arch, defines):
    first = jit.compile_cached("common/kernels/layout.cu", defines, arch, cache=cache)
    assert first.image[:4] == ELF_MAGIC
    assert b"routing_layout" in first.image
    assert os.path.isfile(first.path) and os.path.dirname(first.path) == cache
    second = jit.compile_cached("common/kernels/layout.cu", defines, arch, cache=cache)
    assert second.cache_hit and second.image == first.image and second.path == first.path
    # The cache file name carries the arch; different arch or defines -> different entry.
    assert f".{arch}." in first.path


@needs_nvcc
def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPEP_PORTABLE_CACHE_DIR", str(tmp_path))
    assert jit.cache_dir() == str(tmp_path)
    image = jit.compile("common/kernels/layout.cu", LAYOUT_VARIANTS[0], "sm_90")
    files = [f for f in os.listdir(tmp_path) if f.endswith(".cubin")]
    assert len(files) == 1 and image[:4] == ELF_MAGIC
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # no leftovers


@needs_nvcc
def test_fatbin_with_ptx_for_forced_arch(cache):
    res = jit.compile_cached("common/kernels/layout.cu", LAYOUT_VARIANTS[1], "sm_80", ptx=True, cache=cache)
    assert res.image[:4] == FATBIN_MAGIC and res.path.endswith(".fatbin")


@needs_nvcc
def test_cache_key_covers_defines_and_headers(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(jit.kernel_root(), root, ignore=shutil.ignore_patterns("*.so"))
    src = str(root / "common/kernels/layout.cu")
    ver = jit.nvcc_version()
    key = lambda defs: jit._cache_key(src, str(root), jit._normalize_defines(defs), ["-cubin"], ver)  # noqa: E731
    k0 = key(LAYOUT_VARIANTS[1])
    assert k0 == key(dict(reversed(list(LAYOUT_VARIANTS[1].items()))))  # order-independent
    assert k0 != key(LAYOUT_VARIANTS[0])
    with open(root / "common/kernels/common.cuh", "a") as f:   # a header layout.cu includes
        f.write("\n// touched\n")
    k1 = key(LAYOUT_VARIANTS[1])
    assert k1 != k0
    # files it does not read leave its key (and cached builds) alone: another family's source, a new header
    with open(root / "common/kernels/intranode/combine.cu", "a") as f:
        f.write("\n// touched\n")
    (root / "backends" / "nvshmem").mkdir(parents=True, exist_ok=True)
    (root / "backends" / "nvshmem" / "new.cuh").write_text("// new backend header\n")
    assert key(LAYOUT_VARIANTS[1]) == k1


def test_cache_key_follows_includes_and_pre_included_headers(tmp_path):
    root = tmp_path / "csrc"
    (root / "common" / "kernels").mkdir(parents=True)
    (root / "backends" / "x").mkdir(parents=True)
    (root / "k.cu").write_text('#include <cstdint>\n  #  include "common/kernels/a.cuh"\n')
    (root / "common" / "kernels" / "a.cuh").write_text('#include "b.cuh"   // next to a.cuh\n')
    (root / "common" / "kernels" / "b.cuh").write_text("// b\n")
    (root / "backends" / "x" / "device.cuh").write_text("// the backend\n")
    (root / "common" / "kernels" / "unrelated.cuh").write_text("// nobody includes it\n")
    src, flags = str(root / "k.cu"), ["-include", "backends/x/device.cuh"]
    deps = jit_key.dependencies(src, str(root), flags)
    assert [os.path.relpath(p, root) for p in deps] == ["backends/x/device.cuh", "common/kernels/a.cuh",
                                                        "common/kernels/b.cuh"]
    key = lambda: jit_key.cache_key(src, str(root), [], flags, "v")  # noqa: E731
    k0 = key()
    (root / "common" / "kernels" / "b.cuh").write_text("// b, changed\n")   # two includes deep
    k1 = key()
    (root / "backends" / "x" / "device.cuh").write_text("// the backend, changed\n")   # pre-included
    k2 = key()
    (root / "common" / "kernels" / "unrelated.cuh").write_text("// changed\n")
    assert len({k0, k1, k2}) == 3 and key() == k2
    # an include only the preprocessor can resolve: the whole tree goes into the key
    (root / "k.cu").write_text('#include HEADER_FROM_A_DEFINE\n')
    assert jit_key.dependencies(src, str(root), flags) is None
    k3 = key()
    (root / "common" / "kernels" / "unrelated.cuh").write_text("// changed again\n")
    assert key() != k3


@needs_nvcc
def test_broken_source_raises_with_log(tmp_path):
    (tmp_path / "common" / "kernels").mkdir(parents=True)
    (tmp_path / "broken.cu").write_text(
        'extern "C" __global__ void k(int x) { this_is_not_declared(x); }\n')
    with pytest.raises(jit.JitCompileError) as info:
        jit.compile("broken.cu", {"FOO": 1}, "sm_90", root=str(tmp_path), cache=str(tmp_path / "cache"))
    err = info.value
    assert "nvcc" in err.command[0] and "-DFOO=1" in err.command and "-arch=sm_90" in err.command
    assert "this_is_not_declared" in err.log and "this_is_not_declared" in str(err)
    assert "command:" in str(err)
    assert not os.listdir(tmp_path / "cache") or all(f.endswith(".lock") for f in os.listdir(tmp_path / "cache"))


@needs_nvcc
def test_missing_define_names_it(tmp_path):
    with pytest.raises(jit.JitCompileError, match="NUM_TOPK"):
        jit.compile("common/kernels/intranode/combine.cu", dict(NUM_RANKS=8, HIDDEN=7168), "sm_90",
                    cache=str(tmp_path))


def test_bad_arch_and_define_names():
    with pytest.raises(ValueError):
        jit._target_flags("hopper", False)
    with pytest.raises(ValueError):
        jit._normalize_defines({"1BAD": 1})
    assert jit._target_flags("sm_80", True) == ["-fatbin", "-gencode=arch=compute_80,code=[sm_80,compute_80]"]
    assert jit._target_flags("sm_90a", False) == ["-cubin", "-arch=sm_90a"]


def _ptx_param_sizes(tmp_path, source: str, defines: dict) -> dict:
    """{kernel: [byte size of each parameter]} from the PTX of one kernel source (no GPU)."""
    out = tmp_path / "kernels.ptx"
    cmd = [NVCC, "-ptx", "-arch=sm_90", *jit.BASE_FLAGS, f"-I{jit.kernel_root()}",
           *(f"-D{k}={v}" for k, v in defines.items()), os.path.join(jit.kernel_root(), source), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    sizes: dict = {}
    for kernel, index, size in re.findall(r"\.param\s+\.align\s+\d+\s+\.b8\s+(\w+)_param_(\d+)\[(\d+)\]",
                                          out.read_text()):
        sizes.setdefault(kernel, []).append((int(index), int(size)))
    return {k: [size for _, size in sorted(v)] for k, v in sizes.items()}


@needs_nvcc
def test_param_structs_match_ptx(tmp_path):
    """Each ctypes mirror has the byte size of its kernel's one parameter (checked in PTX, no GPU):
    the layout kernel and the benchmark ceilings' copy kernels."""
    from deepep_portable.engines import dispatch_layout
    from deepep_portable.tools import kernels

    layout = _ptx_param_sizes(tmp_path, dispatch_layout.LAYOUT_SOURCE, LAYOUT_VARIANTS[1])
    assert layout == {dispatch_layout.LAYOUT_KERNEL: [ctypes.sizeof(dispatch_layout.LayoutParams)]}
    copy = _ptx_param_sizes(tmp_path, kernels.COPY_SOURCE, {})
    assert copy == {kernels.COPY_INT4: [ctypes.sizeof(kernels.CopyParams)],
                    kernels.COPY_SEGMENTS: [ctypes.sizeof(kernels.CopySegmentsParams)],
                    kernels.START_LINE: [ctypes.sizeof(kernels.StartLineParams)]}


def test_kernel_symbol_mangling():
    """Itanium mangling of ns::...::name(GlobalClass) (nvcc's output is checked in the PTX tests)."""
    assert jit.kernel_symbol("deepep_portable::low_latency::dispatch", "LLDispatchParams") == \
        "_ZN15deepep_portable11low_latency8dispatchE16LLDispatchParams"
    with pytest.raises(ValueError):
        jit.kernel_symbol("dispatch", "P")


@needs_nvcc
def test_precompile_every_family(cache):
    from deepep_portable.tools.precompile import load_families

    assert {"layout", "intranode_dispatch", "intranode_combine", "copy", "low_latency_dispatch",
            "low_latency_combine"} <= set(load_families())
    results = jit.precompile(archs=("sm_80", "sm_90"), cache=cache)
    expected = sum(len(f.variants) * len([a for a in ("sm_80", "sm_90") if f.archs is None or a in f.archs])
                   for f in jit.families().values())
    assert len(results) == expected
    for name, arch, seconds, hit in results:
        assert arch in ("sm_80", "sm_90") and seconds >= 0 and isinstance(hit, bool)
    again = jit.precompile(archs=("sm_80", "sm_90"), cache=cache)
    assert all(hit for _, _, _, hit in again)


def test_kernel_root_has_sources():
    root = jit.kernel_root()
    assert os.path.isfile(os.path.join(root, "common", "kernels", "layout.cu"))
