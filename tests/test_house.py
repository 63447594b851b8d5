"""The shape of the package, checked so that it stays that way (README "Layout" draws it, "Adding a
transport" says how it is extended):

  * no import circle, counting imports inside functions and the package __init__ files that an import
    runs;
  * no import running upward through the floors below;
  * the kernel core (csrc/common/kernels) includes no backend, and no backend list is written outside
    the registry;
  * no source file over 800 lines.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set

import deepep_portable

PKG = "deepep_portable"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(deepep_portable.__file__)))

# Floors, lowest first: a module imports only modules of its own floor or below. (By the package's
# first level; `transports` holds the registry, the probes and every backend.)
FLOORS = [
    {"comm", "layout", "internode_layout", "handles", "errors", "device", "jit", "jit_key", "profiling", "event",
     "topology", "logfmt", "_C", "agreement", "launch_env", "utils", "elastic_handle", "fp8"},
    {"contract", "config", "_validate", "failures"},
    {"windows"},
    {"engines"},
    {"transports"},
    {"buffer", "tools", "buffers"},
    {"__main__", "", "alias"},          # "" = the package's __init__ (the public face)
]


def _modules() -> Dict[str, str]:
    mods = {}
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, PKG)):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "csrc")]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return mods


def _edges(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    """module -> modules it imports (anywhere in its body), plus the parent packages such an import runs
    (except the importer's own parents, which are running already)."""
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(ast.parse(open(path).read())):
            targets: List[str] = []
            if isinstance(node, ast.ImportFrom):
                base = m.split(".") if is_pkg else m.split(".")[:-1]
                if node.level:
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith(PKG):
                    continue
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                targets += subs
                if any(f"{target}.{a.name}" not in mods and a.name != "_C" for a in node.names):
                    targets.append(target)   # a name defined in `target` itself (its __init__)
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names if a.name.startswith(PKG)]
            for t in targets:
                if t in mods and t != m:
                    edges[m].add(t)
                parts = t.split(".")
                for i in range(1, len(parts)):
                    parent = ".".join(parts[:i])
                    if parent in mods and parent != m and not m.startswith(parent + "."):
                        edges[m].add(parent)
    return edges


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def _floor(module: str) -> int:
    first = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(FLOORS):
        if first in names:
            return i
    raise AssertionError(f"{module}: on no floor (add it to FLOORS in tests/test_house.py)")


def test_no_import_circles():
    edges = _edges(_modules())
    assert sum(map(len, edges.values())) > 50, "the import graph looks empty: is the parser broken?"
    assert _cycles(edges) == []


def test_no_upward_imports():
    up = [f"{m} -> {t}" for m, ts in _edges(_modules()).items() for t in ts if _floor(t) > _floor(m)]
    assert up == []


def test_the_checker_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _csrc_files(sub: str) -> List[str]:
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc", sub)):
        out += [os.path.join(dirpath, f) for f in files if f.endswith((".cu", ".cuh", ".cpp", ".cc", ".hpp", ".h"))]
    return out


def test_kernel_core_names_no_backend():
    """The core includes no backend header and tests no backend macro: the host picks the backend
    (selected_transport.cuh)."""
    for path in _csrc_files(os.path.join("common", "kernels")):
        text = open(path).read()
        assert not re.search(r'#\s*include\s*"backends/', text), path
        assert not re.search(r"DEEPEP_TRANSPORT_[A-Z]", text), path


def test_backend_names_only_in_the_registry():
    """Backend names are written as a list in one place (transports/registry.py): nowhere else is a
    tuple/list/dict of two or more of them."""
    names = ("nvshmem", "nccl_gin", "ibgda", "nvlink", "reference")
    pattern = re.compile(r"[\[({]\s*[\"'](%s)[\"']\s*[,:][^\])}]*[\"'](%s)[\"']" % ("|".join(names), "|".join(names)))
    hits = []
    for m, path in _modules().items():
        if m.endswith("transports.registry"):
            continue
        hits += [f"{m}: {x.group(0)[:60]}" for x in pattern.finditer(open(path).read())]
    assert hits == []


def test_no_file_over_800_lines():
    """Size is a hint, not a rule (one concept per file, however long it is): a file past 800 lines has
    almost always grown a second concept, as the 2,000-line kernels with role switches of other EP libraries
    did. Splitting a cohesive class to pass this is worse than raising the bound with a reason."""
    files = list(_modules().values()) + _csrc_files("")
    long = {os.path.relpath(f, ROOT): n for f in files if (n := sum(1 for _ in open(f))) > 800}
    assert long == {}
