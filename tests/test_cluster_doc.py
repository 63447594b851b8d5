"""docs/CLUSTER.md's "Network options" table and the code agree: every option the table names exists, with the
environment variable the table gives and (ibgda) the default it gives, and every option that `ibgda_options`,
`nvshmem_options` and `nccl_options` accept is in the table."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
from typing import Dict, List, Set, Tuple

import pytest

import deepep_portable as deep_ep
from deepep_portable.transports.ibgda import roce
from deepep_portable.transports.nccl_gin.options import nccl_environment
from deepep_portable.transports.nvshmem.runtime import nvshmem_environment

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "CLUSTER.md")
OPTION = re.compile(r'^`(ibgda|nvshmem|nccl)_options\["(\w+)"\]`$')
DICT_OF = {"ibgda": "ibgda", "nvshmem": "nvshmem", "nccl": "nccl_gin"}
ALWAYS = {"NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE"}   # set by the code whatever the options


def _rows() -> List[Dict[str, str]]:
    text = open(DOC, encoding="utf-8").read()
    assert "## Launching" in text, "the Launching section must stay"
    section = text[text.index("## Network options"):]
    section = section[:section.index("\n## ", 4)] if "\n## " in section[4:] else section
    lines = [ln.strip() for ln in section.splitlines() if ln.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["need", "transport", "Buffer option", "environment", "default", "remark"], header
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(header), ln
        rows.append(dict(zip(header, cells)))
    return rows


def _documented() -> Dict[Tuple[str, str], Dict[str, str]]:
    """(option dictionary, key) -> its row, for every row that names a dictionary option."""
    out = {}
    for row in _rows():
        m = OPTION.match(row["Buffer option"])
        if m:
            key = (m.group(1), m.group(2))
            assert key not in out, f"{key} is in the table twice"
            assert row["transport"] == DICT_OF[m.group(1)], row
            out[key] = row
    return out


def _known(validate) -> Set[str]:
    """The option names a validator accepts, from its own "known: [...]" answer to an unknown name."""
    with pytest.raises(ValueError) as e:
        validate({"no_such_option": 1})
    return set(ast.literal_eval(str(e.value).split("known: ", 1)[1]))


def _env_of(validate, key: str) -> Set[str]:
    """The variables the code sets for option `key` (a valid value of its kind)."""
    for value in (0, "mlx5_0", True):
        try:
            return set(validate({key: value})) - ALWAYS
        except ValueError:
            continue
    raise AssertionError(f"no valid value found for {key}")


def _env_cell(row: Dict[str, str]) -> Set[str]:
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", row["environment"]))


def test_every_option_of_the_code_is_in_the_table_and_nothing_else():
    code = {("ibgda", k) for k in _known(roce.ibgda_options)}
    code |= {("nvshmem", k) for k in _known(nvshmem_environment)}
    code |= {("nccl", k) for k in _known(nccl_environment)}
    assert {f.name for f in dataclasses.fields(roce.IbgdaOptions)} == {k for d, k in code if d == "ibgda"}
    documented = set(_documented())
    assert code - documented == set(), "options missing from docs/CLUSTER.md's Network options table"
    assert documented - code == set(), "the table names options the code does not have"


def test_ibgda_rows_give_the_code_variable_and_default():
    defaults = {f.name: f.default for f in dataclasses.fields(roce.IbgdaOptions)}
    for (d, key), row in _documented().items():
        if d != "ibgda":
            continue
        assert _env_cell(row) == {roce.ENV_PREFIX + key.upper()}, row
        default = defaults[key]
        if default is None:
            assert "`" not in row["default"], f"{key}: default None is chosen at run time, not a literal: {row}"
        else:
            literal = str(default).lower() if isinstance(default, bool) else str(default)
            assert row["default"] == f"`{literal}`", row


@pytest.mark.parametrize("d, validate", [("nvshmem", nvshmem_environment), ("nccl", nccl_environment)])
def test_library_rows_give_the_variable_the_code_sets(d, validate):
    for (dd, key), row in _documented().items():
        if dd == d:
            assert _env_cell(row) == _env_of(validate, key), row


def test_other_names_in_the_option_column_exist():
    params = inspect.signature(deep_ep.Buffer.__init__).parameters
    for row in _rows():
        cell = row["Buffer option"]
        if OPTION.match(cell) or cell == "-":
            continue
        m = re.fullmatch(r"`Buffer\((\w+)=\)`", cell)
        assert m and m.group(1) in params, f"not an option of the code: {cell}"
        assert row["default"] == f"`{params[m.group(1)].default}`", row


def test_every_need_is_answered_for_each_network_transport():
    """The needs a cluster asks about each have a row per RDMA transport (an option, or a dash saying who decides)."""
    from deepep_portable.transports import registry

    rdma = {r.name for r in registry.BACKENDS if r.rdma}
    needs = {"GID index", "traffic class / DSCP", "service level", "UDP source port spread", "NIC and port list",
             "rails (dual-port, several NICs)", "who rings doorbells"}
    have: Dict[str, Set[str]] = {}
    for row in _rows():
        for t in row["transport"].split(", "):
            have.setdefault(row["need"], set()).add(t)
    for need in needs:
        assert have.get(need, set()) >= rdma, f"{need}: rows for {sorted(have.get(need, set()))}, need {sorted(rdma)}"
