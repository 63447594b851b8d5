"""The main job runs end to end on this machine: `python -m deepep_portable bench` spawns its ranks,
checks the round trip against the oracle and prints a table with the ceiling (tiny shapes, so CI
stays fast); `doctor` prints every section."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "deepep_portable", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode,ops", [("normal", ("dispatch", "combine")),
                                      ("low_latency", ("ll_dispatch", "ll_combine"))])
def test_bench_runs_checks_and_prints_the_ceiling(mode, ops):
    r = run("bench", "--mode", mode, "--ranks", "2", "--tokens", "8", "16", "--hidden", "256",
            "--topk", "2", "--experts", "8", "--warmup", "0", "--iters", "1", "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any("ceiling" in line for line in lines)
    header = next(line for line in lines if line.split()[:1] == ["op"])
    assert "ceil_GB/s" in header and "of_ceil" in header
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in ops]
    assert len(rows) == 2 * len(ops)                      # every op at both token counts
    assert {row[1] for row in rows} == {"8", "16"}


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bw.png"
    r = run("bench", "--ranks", "2", "--tokens", "8", "16", "--hidden", "256", "--topk", "2", "--experts", "8",
            "--warmup", "0", "--iters", "1", "--no-progress", "--plot", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_doctor_reports_every_transport():
    r = run("doctor", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("reference", "nvshmem", "nccl_gin", "ibgda", "nvlink"):
        assert name in r.stdout
