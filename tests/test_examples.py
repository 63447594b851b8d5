"""The examples run as written (each spawns its own 2 local ranks: CPU and gloo here, the reference
transport), and the README's quick start is examples/quickstart.py, so the two cannot drift apart."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Launcher variables of an outer torchrun / mpirun / srun would make the example join that job instead of
# spawning its own ranks.
_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "TORCHELASTIC_")


@pytest.mark.parametrize("name, success", [("quickstart.py", "quickstart OK: 2 ranks"),
                                           ("low_latency.py", "low_latency OK: 2 ranks"),
                                           ("elastic_quickstart.py", "elastic quickstart OK: 2 ranks")])
def test_example_runs(name, success):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert success in proc.stdout, output[-4000:]


def test_readme_quick_start_is_examples_quickstart():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## Quick start", 1)
    assert len(section) == 2, "README.md has no '## Quick start' section"
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert block, "README.md's quick start has no python code block"
    example = open(os.path.join(ROOT, "examples", "quickstart.py"), encoding="utf-8").read()
    assert block.group(1) == example, "README.md's quick start differs from examples/quickstart.py"


def test_readme_v2_example_lines_are_in_examples_elastic_quickstart():
    """The README's V2 block is an excerpt of examples/elastic_quickstart.py (which runs above): every line of it
    appears there, so the excerpt cannot drift from code that runs."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## DeepEP V2 compatibility", 1)
    assert len(section) == 2, "README.md has no '## DeepEP V2 compatibility' section"
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert block, "README.md's V2 section has no python code block"
    example = [line.strip() for line in open(os.path.join(ROOT, "examples", "elastic_quickstart.py"),
                                             encoding="utf-8")]
    missing = [line for line in block.group(1).splitlines() if line.strip() and line.strip() not in example]
    assert missing == [], f"README's V2 lines not in examples/elastic_quickstart.py: {missing}"
