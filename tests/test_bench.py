"""The main job runs end to end on this machine: `python -m deepep_portable bench` spawns its ranks,
checks the round trip against the oracle and prints a table with the ceiling (tiny shapes, so CI
stays fast); `doctor` prints every section."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_GPU = torch.cuda.is_available()


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
    if not HAS_GPU:   # the CPU has no SMs: no SMs column, and the caption does not point at one
        assert "SMs" not in header.split() and "SMs column" not in r.stdout
        assert all(len(row) == len(header.split()) for row in rows)


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bw.png"
    r = run("bench", "--ranks", "2", "--tokens", "8", "16", "--hidden", "256", "--topk", "2", "--experts", "8",
            "--warmup", "0", "--iters", "1", "--no-progress", "--plot", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(op, tokens, gbps, ceiling_gbps, transport="nvlink", sms=16):
    from deepep_portable.tools.bench import Row

    return Row(op, tokens, 256, 2, 8, "bf16", 10.0, gbps, 5.0, ceiling_gbps, transport, sms)


def test_bench_plot_has_log_axes_and_one_colour_per_op_and_its_ceiling():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from deepep_portable.tools.bench import plot_figure

    rows = [_row(op, t, g * t, 2 * g * t) for op, g in (("layout", 0.01), ("dispatch", 1.0), ("combine", 3.0))
            for t in (512, 4096)]
    rows += [_row("dispatch", t, 0.5 * t, 2.0 * t, transport="deep_ep") for t in (512, 4096)]   # a --compare peer
    fig = plot_figure(rows, 8)
    try:
        ax = fig.axes[0]
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"layout (nvlink)", "layout ceiling", "dispatch (nvlink)", "dispatch (deep_ep)",
                              "dispatch ceiling", "combine (nvlink)", "combine ceiling"}
        colour = {op: lines[f"{op} ceiling"].get_color() for op in ("layout", "dispatch", "combine")}
        assert len(set(map(str, colour.values()))) == 3                     # one colour per op
        for label, line in lines.items():
            assert str(line.get_color()) == str(colour[label.split()[0]])   # its rows and ceiling share it
            assert (line.get_linestyle() == "--") == label.endswith("ceiling")
        assert lines["dispatch (nvlink)"].get_marker() != lines["dispatch (deep_ep)"].get_marker()
        assert list(lines["dispatch ceiling"].get_xdata()) == [512, 4096]  # one ceiling line per op, not per transport
    finally:
        plt.close(fig)


def test_bench_table_drops_the_sms_column_where_no_row_ran_on_sms(capsys):
    from deepep_portable.tools.bench import print_table

    print_table([_row("dispatch", 8, 1.0, 2.0, "reference", None), _row("combine", 8, 1.0, 2.0, "reference", None)], 2)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["op"])
    assert "SMs" not in header.split() and "SMs column" not in out
    print_table([_row("dispatch", 8, 1.0, 2.0, "nvlink", 16), _row("a2a_dispatch", 8, 1.0, 2.0, "nccl a2a", None)], 2)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["op"]).split()
    sms = header.index("SMs")
    assert [line.split()[sms] for line in lines if line.split()[:1] in (["dispatch"], ["a2a_dispatch"])] == ["16", "-"]


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
