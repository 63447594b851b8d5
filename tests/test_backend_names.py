"""A backend is its folders plus one registry row: no module outside a backend's own folder
(deepep_portable/transports/<name>/, or transports/reference.py for the reference transport) names a backend,
by its name as a string (or a command-line flag made of it, "--<name>"), or by its module path, apart from the
allow-list below, each entry with its reason.

Prose is not naming: a docstring or comment may speak of a backend. What counts is code that would have to
change when a backend is added or removed: a string equal to a backend's name, a module path into a backend's
folder (as a string or an import)."""
from __future__ import annotations

import ast
import os
import re
from typing import List

import pytest

import deepep_portable
from deepep_portable.transports import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(deepep_portable.__file__)))
NAMES = tuple(registry.TRANSPORT_NAMES)
MODULE_PATH = re.compile(r"transports[./](%s)\b|^\.(%s)(\.|:|$)" % ("|".join(NAMES), "|".join(NAMES)))

# path (from the repository root) -> why it may name backends.
ALLOWED = {
    "deepep_portable/transports/registry.py": "the table itself",
    "deepep_portable/transports/__init__.py": "transport='auto''s policy: nvlink first on one machine, reference "
                                              "as the last resort for normal mode over several nodes",
    "deepep_portable/transports/kernel.py": "KernelTransport falls back to the reference transport (the oracle) "
                                            "for what a backend's kernels do not run",
}


def _own_folder(rel: str) -> bool:
    parts = rel.split("/")
    return (len(parts) > 3 and parts[1] == "transports" and parts[2] in NAMES) or \
        rel == "deepep_portable/transports/reference.py"


def _docstrings(tree: ast.AST) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def names_in(source: str) -> List[str]:
    """Where `source` names a backend: (line, what) for strings equal to a name or holding a backend's module path,
    and imports from a backend's folder; docstrings are prose."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if node.value in NAMES or node.value.lstrip("-") in NAMES or MODULE_PATH.search(node.value):
                hits.append(f"{node.lineno}: {node.value[:60]!r}")
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if re.search(r"(^|\.)(%s)(\.|$)" % "|".join(NAMES), module) or any(a.name in NAMES for a in node.names):
                hits.append(f"{node.lineno}: from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            hits += [f"{node.lineno}: import {a.name}" for a in node.names
                     if re.search(r"transports\.(%s)\b" % "|".join(NAMES), a.name)]
    return hits


def test_no_module_outside_a_backend_names_one():
    found = {}
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, "deepep_portable")):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "csrc")]
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
            if _own_folder(rel) or rel in ALLOWED:
                continue
            hits = names_in(open(os.path.join(dirpath, f)).read())
            if hits:
                found[rel] = hits
    assert found == {}, ("modules outside a backend's folders name a backend: move the code into the backend's "
                         "folder and point its registry row at it (docs/ARCHITECTURE.md), or add a reason to "
                         f"ALLOWED: {found}")


def test_the_allow_list_is_current():
    """Every allowed module exists and still names a backend (a module that stopped doing so leaves the list)."""
    stale = [rel for rel in ALLOWED if not os.path.exists(os.path.join(ROOT, rel))
             or not names_in(open(os.path.join(ROOT, rel)).read())]
    assert stale == []


def test_the_checker_sees_a_name():
    assert names_in(f'x = "{NAMES[0]}"\n') and names_in(f"from .transports.{NAMES[0]}.window import W\n")
    assert names_in(f'ref = ".{NAMES[0]}.errors:describe"\n')
    assert not names_in(f'"""Prose about {NAMES[0]}."""\nx = 1  # and {NAMES[0]} here\n')
    assert names_in(f'p.add_argument("--{NAMES[0]}", action="store_true")\n')


def test_every_row_points_at_its_own_folder():
    for b in registry.BACKENDS:
        refs = (b.probe, b.options, b.error_text, b.doctor, b.network_settings, b.cluster_findings, b.precompile)
        for ref in refs + (b.module,):
            if ref:
                assert ref.startswith((f".{b.name}.", f".{b.name}:")) or ref == f".{b.name}", (b.name, ref)
        for ref in refs:
            if ref:
                assert callable(registry.entry(ref)), ref


def test_the_scripts_read_the_steps_from_the_registry():
    assert registry.steps("sanitize") and all(s.count("|") == 4 for s in registry.steps("sanitize"))
    assert "llibgda" in registry.steps("gpu")
    text = open(os.path.join(ROOT, "scripts", "sanitize.sh")).read()
    assert "deepep_portable.transports.registry --steps sanitize" in text
    assert not any(step.split("|")[0] in text for step in registry.steps("sanitize"))
    assert "deepep_portable.transports.registry --steps gpu" in open(os.path.join(ROOT, "scripts", "gpu_tests.sh")).read()


def _fake_row(monkeypatch, alone: bool = False, **hooks):
    """A registry row named "fake" whose hooks are `hooks` (field -> function), from a module made for the test,
    after the real rows (alone: instead of them)."""
    import sys
    import types

    module = types.ModuleType("deepep_portable_fake_backend")
    for field, fn in hooks.items():
        setattr(module, field, fn)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    row = registry.Backend("fake", None, None, f"{module.__name__}:probe", spans_nodes=False,
                           **{field: f"{module.__name__}:{field}" for field in hooks})
    monkeypatch.setattr(registry, "BACKENDS", (() if alone else registry.BACKENDS) + (row,))
    return row


def test_precompile_asks_the_rows(monkeypatch, capsys):
    """`precompile` builds what a row's precompile hook builds, on request (True: every such row; or by name), after
    every kernel family, and names no backend itself."""
    from deepep_portable import jit
    from deepep_portable.tools import precompile

    asked = []

    def build(archs):
        asked.append(archs)
        return [("fake.cu[fake]", a, 1.5, a == "sm_90") for a in archs]

    _fake_row(monkeypatch, alone=True, precompile=build)   # the real rows' builds need nvcc and their libraries
    monkeypatch.setattr(precompile, "load_families", lambda: {})
    monkeypatch.setattr(jit, "precompile", lambda archs: [("family", a, 0.5, False) for a in archs])
    assert precompile.main(["sm_80", "sm_90"]) == 0 and asked == []
    assert precompile.main(["sm_80", "sm_90"], True) == 0 and asked == [("sm_80", "sm_90")]
    assert precompile.main(["sm_90"], ["fake"]) == 0 and asked[-1] == ("sm_90",)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["family"] * 2 + ["family"] * 2 + ["fake.cu[fake]"] * 2 + \
        ["family", "fake.cu[fake]"]
    assert lines[4].split()[1:] == ["sm_80", "1.5", "s"] and lines[5].split()[1:] == ["sm_90", "cached"]
    with pytest.raises(ValueError, match="no such backend"):
        precompile.main(["sm_90"], ["nope"])


def test_hooks_lists_the_rows_that_fill_a_field(monkeypatch):
    real = [b.name for b in registry.BACKENDS if b.precompile]
    assert real and [n for n, _ in registry.hooks("precompile")] == real
    _fake_row(monkeypatch, cluster_findings=lambda part, facts, context: [])
    hooked = [n for n, _ in registry.hooks("cluster_findings")]
    assert hooked == [b.name for b in registry.BACKENDS if b.cluster_findings] and hooked[-1] == "fake"


def test_the_command_line_makes_a_precompile_flag_per_row(monkeypatch):
    """`precompile --<name>` for each row with a precompile hook (made from the table, never written in
    __main__.py), and the scripts' precompile commands still parse."""
    from deepep_portable import __main__ as cli
    from deepep_portable.tools import precompile

    asked = []
    monkeypatch.setattr(precompile, "main", lambda archs, linked=False: asked.append((list(archs), list(linked))) or 0)
    names = registry.filled("precompile")
    assert names == [n for n, _ in registry.hooks("precompile")]
    for name in names:
        assert cli.main(["precompile", "--arch", "sm_90", f"--{name}"]) == 0 and asked[-1] == (["sm_90"], [name])
    assert cli.main(["precompile", "--arch", "sm_80", "sm_90"]) == 0 and asked[-1] == (["sm_80", "sm_90"], [])
    for script in ("gpu_tests.sh", "multi_gpu.sh"):
        lines = [ln for ln in open(os.path.join(ROOT, "scripts", script)) if "deepep_portable precompile" in ln]
        assert lines, script
        for ln in lines:
            argv = ln.split("-m deepep_portable ", 1)[1].split(";;")[0].split()
            assert cli.main(argv) == 0 and asked[-1][1], (script, argv)


def test_one_row_is_the_oracle():
    """The tools ask the registry for the oracle (e.g. a Buffer that only hosts a timing start line) rather than
    naming it: exactly one row, with no kernels of its own to build and every node spanned."""
    rows = [b for b in registry.BACKENDS if b.oracle]
    assert len(rows) == 1 and registry.oracle() == rows[0].name
    assert rows[0].spans_nodes and not rows[0].precompile and not rows[0].gpu_steps


def test_precompile_of_nvshmem_leaves_sm_80_out(monkeypatch):
    """`precompile --nvshmem` builds NVSHMEM's device-linked kernels (its row's hook) for the archs asked, less sm_80."""
    from deepep_portable.transports.nvshmem import transport

    monkeypatch.setattr(transport, "precompile", lambda archs: [("k", a, 0.0, True) for a in archs])
    assert dict(registry.hooks("precompile"))["nvshmem"](("sm_80", "sm_90")) == [("k", "sm_90", 0.0, True)]
