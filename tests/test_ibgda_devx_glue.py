"""The ibgda DevX glue (csrc/backends/ibgda/devx.cc through deepep_portable/transports/ibgda/devx_glue.py) on a
machine without an RDMA device or a GPU, as CI has it (Debian 12: rdma-core 44 headers and libraries from
libibverbs-dev): it builds, caches and loads; it exports every function the provider calls; its constants are the
headers' values; the calls that need hardware fail with a message instead of crashing; glue_status() tells why it
cannot work when the compiler, the headers or the libraries are missing, and never raises."""
import ctypes
import errno
import os
import re
import shutil
import stat
import subprocess
import sys
import threading

import pytest

from deepep_portable import jit
from deepep_portable.transports.ibgda import devx_glue

# The ABI the mlx5 provider is written against; devx.cc may export more, never less.
BRIEF = ["dx_last_error", "dx_open", "dx_close", "dx_query_port", "dx_query_gid", "dx_general_cmd", "dx_alloc_pd",
         "dx_dealloc_pd", "dx_query_eqn", "dx_alloc_uar", "dx_free_uar", "dx_umem_reg", "dx_umem_dereg",
         "dx_obj_create", "dx_obj_modify", "dx_obj_destroy", "dx_reg_mr", "dx_dereg_mr", "dx_resolve_rmac",
         "dx_cuda_dmabuf_fd", "dx_cuda_map_io", "dx_cuda_unmap_io", "dx_constant"]


def _has_header(cxx, header):
    res = subprocess.run([cxx, "-x", "c++", "-E", "-"], input=f"#include <{header}>\n", capture_output=True,
                         text=True)
    return res.returncode == 0


@pytest.fixture(scope="module")
def cxx():
    path, why = devx_glue.find_compiler()
    if path is None:
        pytest.skip(f"no C++ compiler ({why})")
    if not _has_header(path, devx_glue.HEADER):
        pytest.skip(f"{devx_glue.HEADER} is absent (apt install libibverbs-dev)")
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory, cxx):
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("devx_cache")
        mp.setenv("DEEPEP_PORTABLE_CACHE_DIR", str(d))
        yield d


@pytest.fixture(scope="module")
def glue(cache):
    return devx_glue.load()


def test_builds_caches_and_loads(glue, cache):
    assert os.path.dirname(glue.path) == os.path.join(str(cache), "ibgda")
    stamp = os.stat(glue.path).st_mtime_ns
    assert devx_glue.build() == glue.path and os.stat(glue.path).st_mtime_ns == stamp   # a cache hit
    assert devx_glue.load() is glue
    readelf = shutil.which("readelf")
    if readelf:   # libcuda is never linked (the host hands its entry points over): it loads without a driver
        needed = subprocess.run([readelf, "-d", glue.path], capture_output=True, text=True).stdout
        assert "libibverbs" in needed and "libmlx5" in needed and "libcuda" not in needed


def test_concurrent_builds_compile_once(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPEP_PORTABLE_CACHE_DIR", str(tmp_path))
    compiles, real_run = [], devx_glue._run

    def counting_run(cmd):
        if "-o" in cmd:
            compiles.append(cmd)
        return real_run(cmd)
    monkeypatch.setattr(devx_glue, "_run", counting_run)
    paths, errors = [], []

    def one():
        try:
            paths.append(devx_glue.build())
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1 and len(compiles) == 1
    assert [f for f in os.listdir(tmp_path / "ibgda") if not f.endswith(".lock")] == [os.path.basename(paths[0])]
    assert devx_glue.DevxGlue(paths[0]).constant("IBV_ACCESS_LOCAL_WRITE") == 1


def test_every_declared_symbol_exists(glue):
    for name in devx_glue.SIGNATURES:
        assert hasattr(glue.lib, name), name
    assert set(BRIEF) <= set(devx_glue.SIGNATURES)
    # ... and every function devx.cc exports has a declared signature.
    src = open(os.path.join(jit.kernel_root(), devx_glue.SOURCE)).read()
    proxy = open(os.path.join(jit.kernel_root(), devx_glue.PROXY_SOURCE)).read()
    exported = set(re.findall(r"^DX_API [^(]*?\b(dx_\w+)\(", src, re.M))
    exported |= set(re.findall(r"^DX_RELEASE\((dx_\w+),", src, re.M))
    exported |= set(re.findall(r"^DP_API [^(]*?\b(dx_\w+)\(", proxy, re.M))
    assert len(exported) >= len(BRIEF) and exported == set(devx_glue.SIGNATURES)
    nm = shutil.which("nm")
    if nm:
        dyn = subprocess.run([nm, "-D", "--defined-only", glue.path], capture_output=True, text=True).stdout
        assert set(re.findall(r"\bT (dx_\w+)$", dyn, re.M)) == exported


def test_constants_are_the_headers(glue, cxx, tmp_path):
    names = sorted(glue.constants)
    assert {"IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_ATOMIC",
            "IBV_ACCESS_RELAXED_ORDERING", "MLX5DV_UAR_ALLOC_TYPE_BF", "IBV_LINK_LAYER_ETHERNET",
            "IBV_LINK_LAYER_INFINIBAND", "IBV_PORT_ACTIVE"} <= set(names)
    # A C program of its own, compiled against the same headers, prints what each name is.
    prog = tmp_path / "consts.c"
    lines = ["#include <stdio.h>", "#include <infiniband/verbs.h>", "#include <infiniband/mlx5dv.h>",
             "int main(void) {"]
    lines += [f'#ifdef {n}\n    printf("{n}=%lld\\n", (long long)({n}));\n#endif' if n.startswith("MLX5DV_UAR")
              else f'    printf("{n}=%lld\\n", (long long)({n}));' for n in names]
    lines += ["#ifdef MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED", '    printf("has NC\\n");', "#endif", "    return 0;", "}"]
    prog.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "consts"
    build = subprocess.run([cxx, "-x", "c", str(prog), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    header = dict(line.split("=") for line in out if "=" in line)
    assert {k: int(v) for k, v in header.items()} == glue.constants
    assert ("MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED" in glue.constants) == ("NC" in out)
    # The kernel's uABI values, fixed since the verbs interface began (ib_user_verbs / the IB spec's port states).
    assert [glue.constant(n) for n in ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ",
                                       "IBV_ACCESS_REMOTE_ATOMIC", "IBV_PORT_ACTIVE")] == [1, 2, 4, 8, 4]
    assert (glue.constant("IBV_LINK_LAYER_INFINIBAND"), glue.constant("IBV_LINK_LAYER_ETHERNET")) == (1, 2)
    assert glue.lib.dx_constant(b"NO_SUCH_CONSTANT") == -1 and "NO_SUCH_CONSTANT" in glue.last_error()
    with pytest.raises(KeyError, match="NO_SUCH"):
        glue.constant("NO_SUCH")


def test_open_without_a_device_is_an_error(glue):
    names = ["mlx5_no_such_device_7"]
    if not os.path.exists("/sys/class/infiniband/mlx5_0"):
        names.append("mlx5_0")
    for name in names:
        with pytest.raises(devx_glue.DevxError) as info:
            glue.open(name)
        msg = str(info.value)
        assert isinstance(info.value, RuntimeError) and info.value.errno == errno.ENODEV
        assert f"'{name}'" in msg and "not found" in msg and msg.startswith(f"open({name}): dx_open:"), msg
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        assert "no RDMA devices found" in msg


def test_cuda_calls_without_a_gpu_are_errors(glue):
    # Without libcuda (CI) dlopen fails; with a driver but no current context, or a bogus address, CUDA refuses.
    for call, args in [("cuda_dmabuf_fd", (0x1000, 4096)), ("cuda_map_io", (0x1000, 4096)),
                       ("cuda_unmap_io", (0x1000,))]:
        with pytest.raises(devx_glue.DevxError) as info:
            getattr(glue, call)(*args)
        assert info.value.errno != 0 and f"dx_{call}:" in str(info.value), str(info.value)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:   # no driver: the message says the library is missing
        assert "libcuda.so.1 not found" in str(info.value), str(info.value)


def test_null_handles_are_rejected(glue):
    for call in ("close", "dealloc_pd", "free_uar", "umem_dereg", "obj_destroy", "dereg_mr"):
        with pytest.raises(devx_glue.DevxError, match="invalid argument") as info:
            getattr(glue, call)(0)
        assert info.value.errno == errno.EINVAL
    with pytest.raises(devx_glue.DevxError, match="dx_query_port: invalid argument"):
        glue.query_port(0, 1)
    with pytest.raises(devx_glue.DevxError, match="dx_obj_create: invalid argument"):
        glue.obj_create(0, b"\0" * 16, 16)
    with pytest.raises(ValueError):
        glue.resolve_rmac(0, 1, 0, b"\0" * 15)


def _fake_compiler(tmp_path, body):
    path = tmp_path / "fake-c++"
    path.write_text("#!/bin/sh\ncase \" $* \" in *\" --version \"*) echo 'fake c++ 1.0'; exit 0;; esac\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_glue_status(glue, cxx, monkeypatch, tmp_path):
    assert devx_glue.glue_status() == (True, "ok")
    monkeypatch.setenv("DEEPEP_PORTABLE_CACHE_DIR", str(tmp_path / "cache"))
    # No compiler: an explicit one that does not exist, or none on PATH.
    monkeypatch.setenv("DEEPEP_PORTABLE_CXX", str(tmp_path / "no-such-c++"))
    ok, why = devx_glue.glue_status()
    assert not ok and "DEEPEP_PORTABLE_CXX" in why and "compiler" in why, why
    monkeypatch.delenv("DEEPEP_PORTABLE_CXX")
    monkeypatch.delenv("CXX", raising=False)
    path = os.environ.get("PATH", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    ok, why = devx_glue.glue_status()
    assert not ok and "c++" in why and "compiler" in why, why
    monkeypatch.setenv("PATH", path)
    # No rdma-core headers.
    monkeypatch.setenv("DEEPEP_PORTABLE_CXX", _fake_compiler(
        tmp_path, "echo 'devx.cc:47:10: fatal error: infiniband/mlx5dv.h: No such file or directory' >&2; exit 1\n"))
    ok, why = devx_glue.glue_status()
    assert not ok and "mlx5dv.h" in why and "libibverbs-dev" in why, why
    # Headers but no libraries to link: the real compiler answers -M, the "linker" fails.
    monkeypatch.setenv("DEEPEP_PORTABLE_CXX", _fake_compiler(
        tmp_path, f"case \" $* \" in *\" -M \"*) exec {cxx} \"$@\";; esac\n"
                  "echo '/usr/bin/ld: cannot find -lmlx5: No such file or directory' >&2; exit 1\n"))
    ok, why = devx_glue.glue_status()
    assert not ok and "libmlx5" in why and "libibverbs-dev" in why, why
    # Whatever goes wrong inside, it reports instead of raising.
    monkeypatch.setattr(devx_glue, "build", lambda: 1 / 0)
    ok, why = devx_glue.glue_status()
    assert not ok and "division by zero" in why, why


def test_cpu_doorbell_forwards_each_mailbox_to_its_register(glue):
    """doorbell_proxy.cc: a host thread copies every new mailbox value to its queue's register (plain memory stands
    in for the UAR here), the latest one, in order per queue; after stop nothing moves."""
    import threading
    import time

    import numpy as np

    n = 3
    mail, regs = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    addr = lambda a, i: a.ctypes.data + 8 * i   # noqa: E731
    proxy = glue.proxy_start([addr(mail, i) for i in range(n)], [addr(regs, i) for i in range(n)])
    try:
        seen = [[] for _ in range(n)]
        done = threading.Event()

        def watch():   # every value a register shows, in order
            while not done.is_set():
                for i in range(n):
                    v = int(regs[i])
                    if v and (not seen[i] or seen[i][-1] != v):
                        seen[i].append(v)

        w = threading.Thread(target=watch)
        w.start()
        for step in range(1, 200):
            mail[step % n] = (step << 8) | 0x55
            time.sleep(0.0002)
        deadline = time.time() + 5
        while [int(r) for r in regs] != [int(m) for m in mail] and time.time() < deadline:
            time.sleep(0.001)
        done.set()
        w.join()
        assert [int(r) for r in regs] == [int(m) for m in mail]
        for i in range(n):
            assert seen[i] == sorted(seen[i]), f"register {i} went backwards: {seen[i][:8]}"
        assert 0 < glue.proxy_forwarded(proxy) <= 199
    finally:
        glue.proxy_stop(proxy)
    mail[0] = 0xFFFF
    time.sleep(0.01)
    assert int(regs[0]) != 0xFFFF
    with pytest.raises(ValueError):
        glue.proxy_start([1], [])


def test_the_glue_opens_the_driver_library_the_host_module_opens(glue, tmp_path):
    # The one CUDA driver loader (transports/system.py) opens DEEPEP_PORTABLE_LIBCUDA; the glue reports its failure
    # in the words _C's driver_status() uses for it.
    missing = str(tmp_path / "libcuda-missing.so.1")
    code = ("from deepep_portable.transports.ibgda import devx_glue\n"
            "glue = devx_glue.load()\n"
            "try:\n    glue.cuda_map_io(0x1000, 4096)\nexcept devx_glue.DevxError as e:\n    print(e)\n")
    env = dict(os.environ, DEEPEP_PORTABLE_LIBCUDA=missing)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert f"{missing} not found" in out, out
    status = subprocess.run([sys.executable, "-c", "from deepep_portable import _C; print(_C.driver_status()[1])"],
                            capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert status and status in out, (status, out)


FAKE_DRIVER = r"""
#include <stddef.h>
static int initialised;
int cuInit(unsigned flags) { initialised = flags == 0; return 0; }
int cuCtxGetCurrent(void** ctx) { *ctx = initialised ? (void*)0x1 : 0; return 0; }
int cuGetErrorString(int r, const char** s) { *s = "fake text"; return 0; }
int cuGetErrorName(int r, const char** s) { *s = "FAKE_NAME"; return 0; }
int cuMemHostRegister_v2(void* p, size_t n, unsigned flags) { return flags == 7 ? 0 : 1; }
int cuMemHostGetDevicePointer_v2(unsigned long long* d, void* p, unsigned f) {
    *d = (unsigned long long)p + 0x100000; return 0; }
int cuMemHostUnregister(void* p) { return p == (void*)0x2000 ? 0 : 712; }
/* no cuMemGetHandleForAddressRange: a driver too old for dmabuf */
"""


def test_the_glue_calls_the_driver_the_python_loader_opened(cxx, cache, tmp_path):
    """devx.cc never opens the driver: it calls the entry points devx_glue hands over from system.open_libcuda (here
    a fake driver at DEEPEP_PORTABLE_LIBCUDA), names an entry point the driver lacks, keeps the first hand-over, and
    refuses a table of the wrong size."""
    src = open(os.path.join(jit.kernel_root(), devx_glue.SOURCE)).read()
    assert "dlopen" not in src and "dlsym" not in src
    fake = tmp_path / "libcuda-fake.so"
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run([cxx, "-x", "c", "-shared", "-fPIC", str(tmp_path / "fake.c"), "-o", str(fake)], check=True)
    code = """if True:
        import ctypes, errno
        from deepep_portable.transports import system
        from deepep_portable.transports.ibgda import devx_glue
        glue = devx_glue.load()
        assert glue.cuda_map_io(0x1000, 4096) == 0x101000
        glue.cuda_unmap_io(0x2000)
        refusals = [("cuda_unmap_io", (0x1000,), errno.EEXIST, "CUresult 712 FAKE_NAME (fake text)"),
                    ("cuda_dmabuf_fd", (0x1000, 4096), errno.ENOSYS, "cuMemGetHandleForAddressRange")]
        for call, args, code, text in refusals:
            try:
                getattr(glue, call)(*args)
            except devx_glue.DevxError as e:
                assert e.errno == code and text in str(e), str(e)
            else:
                raise AssertionError(call)
        assert glue.lib.dx_use_cuda(None, (ctypes.c_uint64 * 3)(), 3) == errno.EINVAL
        assert "3 entry points, 8 expected" in glue.last_error()
        assert glue.lib.dx_use_cuda(b"later", None, 0) == 0 and glue.cuda_map_io(0x1000, 4096) == 0x101000
        assert system.open_libcuda()[0]._name == %r
        print("ok")
    """ % str(fake)
    env = dict(os.environ, DEEPEP_PORTABLE_LIBCUDA=str(fake), DEEPEP_PORTABLE_CACHE_DIR=str(cache))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
