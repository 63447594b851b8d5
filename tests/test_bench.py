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


@pytest.mark.parametrize("mode,ops", [("normal", ("layout", "dispatch", "combine")),
                                      ("low_latency", ("ll_dispatch", "ll_combine")),
                                      ("internode", ("dispatch", "combine", "dispatch:net", "dispatch:nvl",
                                                     "combine:net", "combine:nvl"))])
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


@pytest.mark.parametrize("forward", [True, False])
def test_pattern_ceiling_segments_tile_every_window(forward):
    """The pattern ceiling moves exactly the op's bytes: each rank's segments go to the right ranks,
    and all ranks' segments tile each destination window in source order, without overlap."""
    import random

    from deepep_portable.tools.ceilings import pattern_segments

    rng = random.Random(7)
    world, row_bytes = 5, 7392 + 4   # a row that is not a multiple of 16 rounds up
    row = (row_bytes + 15) // 16 * 16
    matrix = [[rng.randrange(0, 40) for _ in range(world)] for _ in range(world)]
    matrix[2] = [0] * world          # a rank that sends nothing
    plans = [pattern_segments(matrix, r, forward, row_bytes) for r in range(world)]
    assert len({p[0] for p in plans}) == 1                       # every rank allocates the same window
    window = plans[0][0]
    for d in range(world):
        spans = sorted((plans[s][1][d], plans[s][2][d], s) for s in range(world))
        end = 0
        for off, nbytes, s in spans:
            rows = matrix[s][d] if forward else matrix[d][s]
            assert nbytes == rows * row and off % 16 == 0 and nbytes % 16 == 0
            assert off == end or nbytes == 0                         # contiguous, no overlap
            end = max(end, off + nbytes)
        assert end <= window
        assert [s for off, n, s in spans if n] == sorted(s for off, n, s in spans if n)   # source order


def test_segment_copy_rejects_bad_plans():
    """A bad copy plan is refused before anything is allocated or launched (no GPU needed)."""
    import torch

    from deepep_portable.tools.kernels import SegmentCopy

    src = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError):
        SegmentCopy(src, [0], [8])            # not a multiple of 16
    with pytest.raises(ValueError):
        SegmentCopy(src, [0, 0], [64, 16])    # more than the source holds
    with pytest.raises(ValueError):
        SegmentCopy(src, [0], [16, 16])       # one destination per segment


def test_bench_compare_drives_a_peer_module():
    """--compare MODULE: the module's Buffer (DeepEP's API) on the same inputs, rows beside ours and a ratio
    per op (here the peer is this package itself, the only DeepEP-API module CI has)."""
    r = run("bench", "--ranks", "2", "--tokens", "8", "--hidden", "256", "--topk", "2", "--experts", "8",
            "--warmup", "0", "--iters", "1", "--no-progress", "--compare", "deepep_portable")
    assert r.returncode == 0, r.stdout + r.stderr
    peer_rows = [line.split() for line in r.stdout.splitlines() if line.split()[-1:] == ["deepep_portable"]]
    assert sorted(row[0] for row in peer_rows) == ["combine", "dispatch", "layout"]
    assert "deepep_portable time / ours" in r.stdout
    ratios = [line for line in r.stdout.splitlines() if "tokens" in line and line.strip().endswith(tuple("0123456789"))
              and " = " in line]
    assert len(ratios) == 3


def test_bench_compare_drives_a_peer_module_in_low_latency_mode():
    """--compare in LL mode (run where every rank has a GPU of its own, and on the CPU): the peer's
    low_latency_dispatch / low_latency_combine on the same inputs, rows beside ours and a ratio per op."""
    r = run("bench", "--mode", "low_latency", "--ranks", "2", "--tokens", "8", "--hidden", "256", "--topk", "2",
            "--experts", "8", "--warmup", "0", "--iters", "1", "--no-progress", "--compare", "deepep_portable")
    assert r.returncode == 0, r.stdout + r.stderr
    peer_rows = [line.split() for line in r.stdout.splitlines() if line.split()[-1:] == ["deepep_portable"]]
    assert sorted(row[0] for row in peer_rows) == ["ll_combine", "ll_dispatch"]
    ratios = [line for line in r.stdout.splitlines() if " us = " in line]
    assert [line.split()[0] for line in ratios] == ["ll_dispatch", "ll_combine"]
    assert "not run here" not in r.stdout


def test_comparison_puts_the_zero_copy_ops_beside_the_peers_ops(capsys):
    from collections import namedtuple
    from deepep_portable.tools.compare import print_comparison
    Row = namedtuple("Row", "op tokens precision time_us transport")
    rows = [Row("dispatch", 64, "fp8", 150.0, "nvlink"), Row("dispatch_zc", 64, "fp8", 120.0, "nvlink"),
            Row("combine", 64, "bf16", 200.0, "nvlink"), Row("combine_zc", 64, "bf16", 100.0, "nvlink"),
            Row("dispatch", 64, "fp8", 180.0, "deep_ep"), Row("combine", 64, "bf16", 300.0, "deep_ep")]
    print_comparison(rows, "deep_ep")
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if " = " in line]
    want = [("dispatch", "1.200"), ("combine", "1.500"), ("dispatch_zc", "1.500"), ("combine_zc", "3.000")]
    assert [(line[0], line[-1]) for line in lines] == want


def test_soak_runs_and_passes_on_the_cpu():
    # --slowdown: time per round on a shared 2-core CI machine is noise; the verdict's rule has its own test
    r = run("soak", "--ranks", "2", "--rounds", "20", "--check-every", "5", "--modes", "normal", "low_latency",
            "--slowdown", "1000")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "soak: PASS" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["normal"], ["low_latency"])]
    assert len(rows) == 8 and all(row[3] == "0" for row in rows)   # 4 windows per mode, nothing changed


def test_soak_verdict_catches_growth_and_slowdown():
    import argparse

    from deepep_portable.tools.soak import _verdict

    def row(i, **kw):
        return dict(dict(case="normal", rounds=10 * i, ms=1.0, changed=0, torch_mb=100, gpu_mb=1000, rss_mb=500,
                         fds=30), **kw)
    cfg = argparse.Namespace(slowdown=1.5)
    assert _verdict([row(1, torch_mb=50), row(2), row(3), row(4)], cfg) == []   # warm-up growth is not a leak
    assert any("fds grew" in p for p in _verdict([row(1), row(2), row(3), row(4, fds=31)], cfg))
    assert any("rss_mb grew" in p for p in _verdict([row(1), row(2), row(3), row(4, rss_mb=600)], cfg))
    assert any("last window" in p for p in _verdict([row(1), row(2), row(3), row(4, ms=2.0)], cfg))


def test_ceiling_blocks_follow_the_engine_of_the_mode_benched():
    # An LL-only Buffer has no normal engine: its rows and ceilings must take the LL engine's cap (16 blocks
    # for 8 ranks on a 132-SM GPU), not the caller's uncapped budget.
    from types import SimpleNamespace

    from deepep_portable import Buffer
    from deepep_portable.tools import bench

    class Engine:
        def grid(self, num_sms):
            return min(num_sms, 16)

    engines = {"normal": None, "low_latency": Engine()}
    buf = SimpleNamespace(backend=SimpleNamespace(engine=engines.get))
    old = Buffer.num_sms
    Buffer.set_num_sms(20)
    try:
        assert bench._blocks(buf, "low_latency") == 16
        assert bench._blocks(buf) == 20   # no normal engine: the budget itself (the reference transport)
    finally:
        Buffer.set_num_sms(old)
