"""The shell scripts the GPU machine runs (scripts/*.sh, dev/*.sh) never run in CI: check that each parses, that
the lab harness stays out of scripts/, and that dev/pack_out.sh (the last step of a device call, which may send
back at most 8 files) packs what it should."""
from __future__ import annotations

import glob
import os
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
DEV = os.path.join(ROOT, "dev")
SHELL = sorted(glob.glob(os.path.join(SCRIPTS, "*.sh")) + glob.glob(os.path.join(DEV, "*.sh")))


@pytest.mark.parametrize("script", SHELL, ids=lambda p: os.path.relpath(p, ROOT))
def test_script_parses(script):
    subprocess.run(["bash", "-n", script], check=True)


def test_scripts_holds_what_users_and_ci_run():
    """scripts/ is the product's (the two commands, the GPU suites, the comparisons); harness for one lent
    machine lives in dev/, each file named in dev/README.md."""
    for name in ("run_bench.sh", "run_tests.sh", "setup_env.sh", "gpu_tests.sh", "gpu_env.sh"):
        assert os.path.isfile(os.path.join(SCRIPTS, name)), name
    lab = ("carry_in_parts.sh", "pack_out.sh", "ab_bench.sh", "host_costs.py", "ipc_read_probe.py")
    for name in lab:
        assert not os.path.exists(os.path.join(SCRIPTS, name)), f"{name} belongs in dev/"
        assert os.path.isfile(os.path.join(DEV, name)), name
    readme = open(os.path.join(DEV, "README.md"), encoding="utf-8").read()
    for name in sorted(os.listdir(DEV)):
        if name != "README.md":
            assert f"`{name}`" in readme, f"dev/README.md does not say what {name} is for"


def test_pack_out_leaves_the_cache_parts_and_packs_the_rest(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "step.log").write_text("x")
    (tmp_path / "a" / "b" / "deep.log").write_text("y")
    (tmp_path / "jit_cache.tgz.00").write_bytes(b"z")
    (tmp_path / "table.txt").write_text("k")
    env = dict(os.environ, OUT=str(tmp_path), KEEP="table.txt")
    subprocess.run(["bash", os.path.join(DEV, "pack_out.sh")], check=True, env=env, capture_output=True)
    assert sorted(os.listdir(tmp_path)) == ["jit_cache.tgz.00", "logs.tgz", "table.txt"]
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        assert sorted(tar.getnames()) == ["./a/b/deep.log", "./step.log"]
        assert tar.extractfile("./a/b/deep.log").read() == b"y"
