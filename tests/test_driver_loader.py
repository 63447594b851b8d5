"""One loader of the CUDA driver for the whole library: transports/system.py's open_libcuda() (ctypes) opens it,
deepep_portable._C takes the address of every entry point it needs from there when it is imported
(system.driver_entry_points), and the ibgda glue takes its own the same way. No GPU needed: a fake driver built
here stands in for libcuda where the driver's answers matter."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from typing import Iterator, List, Tuple

import pytest

from deepep_portable import _C
from deepep_portable.transports import system

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOADER = os.path.join("deepep_portable", "transports", "system.py")
C_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")


# ---- the source scan: who opens libcuda --------------------------------------------------------------------------

def _strip_c_comments(text: str) -> str:
    """C/C++ source without its comments (string and character literals kept, so "a//b" stays)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            out.append(" ")
            i = n if j < 0 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def c_libcuda_loads(text: str) -> List[str]:
    """Why this C/C++ source opens the CUDA driver itself ([] when it does not): a dlopen in a file whose code (not
    its comments) names libcuda or DEEPEP_PORTABLE_LIBCUDA, a dlopen whose argument mentions cuda, or a dlsym of a
    driver entry point (cu<Upper>...) by name."""
    code = _strip_c_comments(text)
    found = []
    opens = list(re.finditer(r"\bdlm?open\s*\(([^;]*)", code))
    if opens and re.search(r"libcuda|DEEPEP_PORTABLE_LIBCUDA", code):
        found.append("dlopen in code that names libcuda or DEEPEP_PORTABLE_LIBCUDA")
    found += [f"dlopen({m.group(1).strip()}" for m in opens if "cuda" in m.group(1).lower()]
    found += [f"dlsym of {m.group(1)}" for m in re.finditer(r'\bdlv?sym\s*\([^;]*?"(cu[A-Z]\w*)"', code)]
    return found


_OPENERS = {"CDLL", "PyDLL", "LoadLibrary", "dlopen"}   # ctypes.CDLL, ctypes.cdll.LoadLibrary, _ctypes.dlopen, ...
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _called_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a module or function, less those of the functions defined in it (each is a scope of its own)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _FUNCTIONS):
            todo.extend(ast.iter_child_nodes(node))


def _names_the_driver(scope: ast.AST) -> bool:
    """Whether a scope's code (not its docstrings) names the driver library: libcuda_path(), LIBCUDA_ENV, a
    "libcuda..." literal, a function called *libcuda*."""
    words = [getattr(scope, "name", "")]
    docstrings = {id(n.value) for n in _own_nodes(scope)
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
    return any("libcuda" in w.lower() for w in words)


def py_libcuda_loads(text: str) -> List[str]:
    """Why this Python source opens the CUDA driver itself ([] when it does not): a ctypes load whose argument mentions
    cuda (a "libcuda..." literal, libcuda_path(), find_library("cuda"), ...) or that sits in a function (or module
    body) naming the driver library, a `ctypes.cdll.libcuda`-style attribute load, or a read of
    DEEPEP_PORTABLE_LIBCUDA from the environment. Docstrings and comments do not count."""
    found = set()
    tree = ast.parse(text)
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, _FUNCTIONS))]:
        near_driver = _names_the_driver(scope)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Call):
                name = _called_name(node.func)
                args = " ".join(ast.dump(a) for a in [*node.args, *(k.value for k in node.keywords)])
                if name in _OPENERS and (near_driver or "cuda" in args.lower()):
                    found.add(f"line {node.lineno}: {name}(...) of the driver")
                if name in {"getenv", "get", "__getitem__"} and "'DEEPEP_PORTABLE_LIBCUDA'" in args:
                    found.add(f"line {node.lineno}: reads DEEPEP_PORTABLE_LIBCUDA")
            elif isinstance(node, ast.Subscript) and "'DEEPEP_PORTABLE_LIBCUDA'" in ast.dump(node.slice):
                found.add(f"line {node.lineno}: reads DEEPEP_PORTABLE_LIBCUDA")
            elif (isinstance(node, ast.Attribute) and "cuda" in node.attr.lower()
                  and _called_name(node.value) in {"cdll", "pydll"}):
                found.add(f"line {node.lineno}: ctypes.{_called_name(node.value)}.{node.attr}")
    return sorted(found)


def _tracked(suffixes: Tuple[str, ...], under: str = "") -> Iterator[str]:
    """Repository-relative paths of the tracked files with these suffixes (a walk of the tree without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", under or "."], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [os.path.relpath(os.path.join(d, f), ROOT)
                 for top in ([under] if under else ["deepep_portable", "csrc", "scripts", "setup.py"])
                 for d, _, files in os.walk(os.path.join(ROOT, top)) for f in files]
    for p in paths:
        if p.endswith(suffixes) and os.path.isfile(os.path.join(ROOT, p)):
            yield p


def test_the_scanners_find_a_loader_and_nothing_else():
    """The scan below is only as good as these two functions: each flags the ways of opening the driver and none of
    the library's other uses of dlopen / ctypes or of the word libcuda in text."""
    assert c_libcuda_loads('const char* env = getenv("DEEPEP_PORTABLE_LIBCUDA");\n'
                           'void* lib = dlopen(env ? env : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);')
    assert c_libcuda_loads('void* h = dlopen(kCudaPath, RTLD_NOW);')
    assert c_libcuda_loads('auto f = dlsym(handle, "cuInit");')
    assert not c_libcuda_loads('// dlopen("libcuda.so.1") is the loader\'s job\n/* dlsym(h, "cuInit") */\n'
                               'const char* doc = "whether libcuda.so.1 loads"; int url = 1; // "x//y"')
    assert not c_libcuda_loads('void* h = dlopen("libibverbs.so.1", RTLD_NOW); auto f = dlsym(h, "ibv_open");')
    for loader in ('ctypes.CDLL("libcuda.so.1")', "ctypes.cdll.LoadLibrary(system.libcuda_path())",
                   'CDLL(ctypes.util.find_library("cuda"))', "lib = ctypes.cdll.libcuda",
                   'os.environ.get("DEEPEP_PORTABLE_LIBCUDA")', 'os.getenv("DEEPEP_PORTABLE_LIBCUDA")',
                   'os.environ["DEEPEP_PORTABLE_LIBCUDA"]',
                   "def f():\n    path = system.libcuda_path()\n    return ctypes.CDLL(path)",
                   "def _open_libcuda(path):\n    return ctypes.CDLL(path)"):
        assert py_libcuda_loads(loader), loader
    for other in ('"""Opens libcuda.so.1 through system.py (DEEPEP_PORTABLE_LIBCUDA)."""',
                  "lib = ctypes.CDLL(path or build())", 'ctypes.CDLL("libnccl.so.2")',
                  'msg = f"dlopen({system.libcuda_path()}) failed"',
                  "def f():\n    why = system.libcuda_path()\n    def g(p):\n        return ctypes.CDLL(p)\n"
                  "    return g"):
        assert not py_libcuda_loads(other), other
    # And the one loader there is, is found: the scan would see a second one.
    with open(os.path.join(ROOT, LOADER)) as f:
        assert py_libcuda_loads(f.read())


def test_only_system_py_opens_the_driver():
    c_files = list(_tracked(C_SUFFIXES, "csrc"))
    py_files = [p for p in _tracked((".py",)) if p != LOADER and not p.startswith("tests" + os.sep)]
    assert c_files and any(p.endswith("driver.cpp") for p in c_files) and "setup.py" in py_files
    offenders = {}
    for path in c_files:
        with open(os.path.join(ROOT, path), errors="replace") as f:
            offenders[path] = c_libcuda_loads(f.read())
    for path in py_files:
        with open(os.path.join(ROOT, path), errors="replace") as f:
            offenders[path] = py_libcuda_loads(f.read())
    offenders = {p: why for p, why in offenders.items() if why}
    assert not offenders, f"only {LOADER} opens the CUDA driver; these open it too: {offenders}"


def test_the_host_module_has_no_loader_of_its_own():
    """csrc/common/runtime (the sources of _C) never calls dlopen/dlsym, and the built module neither links libcuda
    nor imports dlopen/dlsym."""
    for path in _tracked(C_SUFFIXES, os.path.join("csrc", "common", "runtime")):
        with open(os.path.join(ROOT, path)) as f:
            code = _strip_c_comments(f.read())
        assert not re.search(r"\bdl(m?open|v?sym)\s*\(|<dlfcn\.h>", code), path
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed")
    out = subprocess.run([nm, "-D", _C.__file__], capture_output=True, text=True, check=True).stdout
    undefined = {ln.split()[-1].split("@")[0] for ln in out.splitlines() if ln.split()[:1] == ["U"]}
    assert not undefined & {"dlopen", "dlmopen", "dlsym", "dlvsym"}, sorted(undefined)
    readelf = shutil.which("readelf")
    if readelf:
        dynamic = subprocess.run([readelf, "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
        assert "libcuda" not in dynamic


# ---- what _C reports -----------------------------------------------------------------------------------------------

def _in_fresh_interpreter(code: str, **env: str) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env={**os.environ, **env}, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip()


REPORT = """
    from deepep_portable import _C
    from deepep_portable.transports import system
    ok, reason = _C.driver_status()
    entry = system.driver_entry_points(_C.driver_entry_names())
    try:
        _C.device_count()
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    print(repr((ok, reason, entry[2], system.libcuda()[1], raised)))
"""


def _report(**env: str):
    return ast.literal_eval(_in_fresh_interpreter(REPORT, **env).splitlines()[-1])


def test_probe_reports_the_python_loaders_reason_without_a_driver(tmp_path):
    missing = str(tmp_path / "libcuda-missing.so.1")
    ok, reason, loader_reason, libcuda_reason, raised = _report(DEEPEP_PORTABLE_LIBCUDA=missing)
    assert ok is False and reason == loader_reason == libcuda_reason, (reason, loader_reason, libcuda_reason)
    assert reason.startswith(f"{missing} not found (") and missing in reason[len(missing):], reason
    assert raised == f"CUDA driver unavailable: {reason}"


def test_probe_reports_the_python_loaders_reason_on_this_machine():
    lib, why = system.open_libcuda()
    if lib is not None:
        pytest.skip(f"this machine has a CUDA driver ({system.libcuda_path()}): the GPU tests cover it")
    ok, reason = _C.driver_status()
    path = system.libcuda_path()
    assert (ok, reason) == (False, system.driver_entry_points(_C.driver_entry_names())[2]) == \
           (False, system.libcuda()[1]) == (False, f"{path} not found ({why})")


def test_a_failing_python_loader_is_the_reason():
    out = _in_fresh_interpreter("""
        from deepep_portable.transports import system
        def broken(names):
            raise RuntimeError("no loader today")
        system.driver_entry_points = broken
        from deepep_portable import _C
        print(_C.driver_status())
    """)
    assert out == ("(False, 'the CUDA driver loader (deepep_portable.transports.system) failed: "
                   "RuntimeError: no loader today')"), out


def test_entry_names_are_the_headers_versioned_symbols():
    names = _C.driver_entry_names()
    assert len(names) == len(set(names)) and names[0] == "cuInit"
    # cuda.h's versioning macros pick the symbol: the loader looks up exactly these names.
    for versioned in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetAddressRange_v2", "cuMemHostGetDevicePointer_v2",
                      "cuIpcOpenMemHandle_v2", "cuLaunchKernelEx", "cuStreamWaitEvent"):
        assert versioned in names, versioned
    assert "cuMemAlloc" not in names and not any(n.endswith(("_ptsz", "_ptds")) for n in names)


# ---- a fake driver: _C calls through what the Python loader opened ------------------------------------------------

def _fake_driver(tmp_path, name: str, *, leave_out: str = "", init_result: int = 0) -> str:
    """A shared library exporting every entry point _C names (less `leave_out`): cuInit returns `init_result`, the
    driver version is 12.8, it has 3 devices, everything else returns CUDA_SUCCESS."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler for the fake driver")
    special = {
        "cuInit": f"int cuInit(unsigned flags) {{ return flags == 0 ? {init_result} : 1; }}",
        "cuDriverGetVersion": "int cuDriverGetVersion(int* v) { *v = 12080; return 0; }",
        "cuDeviceGetCount": "int cuDeviceGetCount(int* n) { *n = 3; return 0; }",
        "cuGetErrorName": 'int cuGetErrorName(int r, const char** s) { *s = r == 100 ? "CUDA_ERROR_NO_DEVICE" : 0; '
                          "return 0; }",
        "cuGetErrorString": 'int cuGetErrorString(int r, const char** s) { *s = r == 100 ? "no device here" : 0; '
                            "return 0; }",
    }
    body = [special.get(n, f"int {n}(void) {{ return 0; }}") for n in _C.driver_entry_names() if n != leave_out]
    src, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text("\n".join(body) + "\n")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return str(lib)


def test_host_module_calls_the_driver_the_python_loader_opened(tmp_path):
    fake = _fake_driver(tmp_path, "libcuda-fake")
    out = _in_fresh_interpreter("""
        from deepep_portable import _C
        from deepep_portable.transports import system
        print(repr((_C.driver_status(), _C.device_count(), _C.driver_version(), system.open_libcuda()[0]._name)))
    """, DEEPEP_PORTABLE_LIBCUDA=fake)
    assert ast.literal_eval(out) == ((True, f"CUDA driver 12.8 ({fake})"), 3, 12080, fake)


def test_host_module_names_a_symbol_the_driver_lacks(tmp_path):
    fake = _fake_driver(tmp_path, "libcuda-old", leave_out="cuMemAlloc_v2")
    ok, reason, *_ = _report(DEEPEP_PORTABLE_LIBCUDA=fake)
    assert (ok, reason) == (False, f"symbol cuMemAlloc_v2 missing in {fake} (driver too old?)")
    # An optional entry point may be missing (cuFuncGetParamInfo: drivers before 12.4).
    optional = _fake_driver(tmp_path, "libcuda-12.3", leave_out="cuFuncGetParamInfo")
    assert _report(DEEPEP_PORTABLE_LIBCUDA=optional)[:2] == (True, f"CUDA driver 12.8 ({optional})")


def test_host_module_reports_cuinit_failing(tmp_path):
    fake = _fake_driver(tmp_path, "libcuda-nodev", init_result=100)
    ok, reason, *_ = _report(DEEPEP_PORTABLE_LIBCUDA=fake)
    assert (ok, reason) == (False, "cuInit failed: CUDA_ERROR_NO_DEVICE (no device here)")


def test_the_first_hand_over_is_kept(tmp_path):
    """_C takes the driver once, as it is imported: pointing the loader elsewhere later changes nothing."""
    fake = _fake_driver(tmp_path, "libcuda-fake")
    out = _in_fresh_interpreter(f"""
        import os
        from deepep_portable import _C
        from deepep_portable.transports import system
        os.environ["DEEPEP_PORTABLE_LIBCUDA"] = {str(tmp_path / "elsewhere.so")!r}
        system.clear_cache()
        print(repr(_C.driver_status()))
    """, DEEPEP_PORTABLE_LIBCUDA=fake)
    assert ast.literal_eval(out) == (True, f"CUDA driver 12.8 ({fake})")
