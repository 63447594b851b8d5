"""docs/CONFIGURATION.md and the code agree on the DEEPEP_PORTABLE_* environment variables: every variable the
package, its kernels, its build and its scripts name is documented there, every variable the document names is
still read somewhere, and every row of its table is configuration of a known kind."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, Set

from deepep_portable.transports.ibgda.roce import ENV_PREFIX, IbgdaOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "CONFIGURATION.md")
# Where the variables are read: the package, the kernels' and host module's sources, the build, the scripts.
CODE = ("deepep_portable", "csrc", "scripts", "setup.py")
TEXT_SUFFIXES = (".py", ".sh", ".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp")
NAME = re.compile(r"DEEPEP_PORTABLE_[A-Z0-9_]+")
KINDS = {"setting", "fallback", "diagnostics", "build"}
IB_FIELDS = {f.name for f in dataclasses.fields(IbgdaOptions)}


def _code_names() -> Dict[str, Set[str]]:
    """Every DEEPEP_PORTABLE_* name in the code -> the files (relative paths) that name it."""
    names: Dict[str, Set[str]] = {}
    for top in CODE:
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, f) for d, _, fs in os.walk(path) if "__pycache__" not in d for f in fs
            if f.endswith(TEXT_SUFFIXES) or top == "scripts"]
        for f in files:
            try:
                with open(f, encoding="utf-8") as fh:
                    text = fh.read()
            except UnicodeDecodeError:
                continue
            for name in NAME.findall(text):
                names.setdefault(name, set()).add(os.path.relpath(f, ROOT))
    return names


def _doc() -> str:
    with open(DOC, encoding="utf-8") as fh:
        return fh.read()


def _ib_option(name: str) -> bool:
    """DEEPEP_PORTABLE_IB_<NAME> of a known ibgda option (documented by the ibgda_options table)."""
    return name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):].lower() in IB_FIELDS


def _env_rows(doc: str) -> Dict[str, str]:
    """The environment table's rows: variable -> kind."""
    section = doc[doc.index("## Environment variables"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`DEEPEP_PORTABLE_"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def test_the_code_names_variables():
    names = _code_names()
    for expected in ("DEEPEP_PORTABLE_TIMEOUT_S", "DEEPEP_PORTABLE_CACHE_DIR", "DEEPEP_PORTABLE_LIBCUDA", ENV_PREFIX):
        assert expected in names, f"{expected} not found in {CODE}: the scan is broken"


def test_every_variable_in_the_code_is_documented():
    documented = set(NAME.findall(_doc()))
    missing = {name: sorted(files) for name, files in _code_names().items()
               if name not in documented and not (_ib_option(name) and ENV_PREFIX in documented)}
    assert not missing, ("variables read by the code but not in docs/CONFIGURATION.md (document them, or remove "
                         f"the variable with its path): {missing}")


def test_every_documented_variable_is_still_read():
    names = _code_names()
    stale = sorted(name for name in set(NAME.findall(_doc()))
                   if name not in names and not (_ib_option(name) and ENV_PREFIX in names))
    assert not stale, f"docs/CONFIGURATION.md names variables the code no longer reads: {stale}"


def test_every_row_is_configuration_of_a_known_kind():
    rows = _env_rows(_doc())
    assert "DEEPEP_PORTABLE_TIMEOUT_S" in rows, "the environment table was not found"
    wrong = {name: kind for name, kind in rows.items() if kind not in KINDS}
    assert not wrong, f"rows whose kind is not one of {sorted(KINDS)}: {wrong}"
    # Each variable has its row (the IB_* family shares one, through the ibgda_options table).
    names = {n for n in _code_names() if not n.endswith("_") and not _ib_option(n)}
    without_row = sorted(names - set(rows))
    assert not without_row, f"variables named in the text but without a row in the environment table: {without_row}"


def test_the_ibgda_table_lists_every_option_and_its_variable():
    doc = _doc()
    section = doc[doc.index("### `ibgda_options`"):doc.index("### `nccl_options`")]
    pairs = re.findall(r"^\| `(\w+)` / `(\w+)` \|", section, re.M)
    assert {key for key, _ in pairs} == IB_FIELDS
    assert all(suffix == key.upper() for key, suffix in pairs), pairs
