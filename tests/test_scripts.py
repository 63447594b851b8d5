"""The shell scripts the GPU machine runs (scripts/*.sh) never run in CI: check that each parses, and that
pack_out.sh (the last step of a device call, which may send back at most 8 files) packs what it should."""
from __future__ import annotations

import glob
import os
import subprocess
import tarfile

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(SCRIPTS, "*.sh"))), ids=os.path.basename)
def test_script_parses(script):
    subprocess.run(["bash", "-n", script], check=True)


def test_pack_out_leaves_the_cache_parts_and_packs_the_rest(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "step.log").write_text("x")
    (tmp_path / "a" / "b" / "deep.log").write_text("y")
    (tmp_path / "jit_cache.tgz.00").write_bytes(b"z")
    (tmp_path / "table.txt").write_text("k")
    env = dict(os.environ, OUT=str(tmp_path), KEEP="table.txt")
    subprocess.run(["bash", os.path.join(SCRIPTS, "pack_out.sh")], check=True, env=env, capture_output=True)
    assert sorted(os.listdir(tmp_path)) == ["jit_cache.tgz.00", "logs.tgz", "table.txt"]
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        assert sorted(tar.getnames()) == ["./a/b/deep.log", "./step.log"]
        assert tar.extractfile("./a/b/deep.log").read() == b"y"
