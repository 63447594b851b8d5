"""`bench --api v2` and the `--num-sms` sweep: the arguments, the choice of the best SM budget and of the fewest
SMs within 10 % of it, the model's inputs read from a sweep, the sweep's table from made-up timings, and one real
V2 run on the reference transport (the CPU: no SMs, so the sweep runs as one row per op)."""
import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from deepep_portable import Buffer
from deepep_portable.buffers.elastic import ElasticBuffer
from deepep_portable.tools import bench
from deepep_portable.tools.timing import best_budget, measured_model_inputs, pick_budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*args):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    cfg = p.parse_args(list(args))
    return cfg, bench.sweep_settings(cfg)


# ---- arguments ------------------------------------------------------------------------------------------
def test_one_budget_keeps_the_v1_run():
    cfg, problem = parse("--num-sms", "16")
    assert problem is None and cfg.num_sms == 16 and cfg.sms_sweep is None and cfg.api == "v1"
    cfg, problem = parse()
    assert problem is None and cfg.num_sms is None and cfg.sms_sweep is None


def test_several_budgets_or_v2_make_a_sweep():
    cfg, problem = parse("--api", "v2", "--num-sms", "4", "6", "8", "16", "24", "32", "--compare", "deep_ep")
    assert problem is None and cfg.api == "v2" and cfg.num_sms is None
    assert cfg.sms_sweep == [4, 6, 8, 16, 24, 32] and cfg.compare_sms == [8, 16, 24]   # the peer's own sweep
    cfg, problem = parse("--num-sms", "8", "8", "4", "--compare-num-sms", "16", "24")
    assert problem is None and cfg.api == "v1" and cfg.sms_sweep == [8, 4] and cfg.compare_sms == [16, 24]
    cfg, problem = parse("--api", "v2", "--num-sms", "6")
    assert problem is None and cfg.sms_sweep == [6]
    cfg, problem = parse("--api", "v2")   # V2's num_sms=0: V1's budget
    assert problem is None and cfg.sms_sweep == [Buffer.num_sms]


@pytest.mark.parametrize("args,words", [
    (("--api", "v2", "--mode", "low_latency"), "normal mode only"),
    (("--num-sms", "4", "6", "--mode", "internode"), "normal mode only"),
    (("--num-sms", "4", "5"), "even and positive"),
    (("--api", "v2", "--compare", "deep_ep", "--compare-num-sms", "7"), "even and positive"),
    (("--num-sms", "4", "6", "--plot", "x.png"), "--plot"),
    (("--api", "v2", "--baseline"), "--baseline"),
])
def test_sweep_arguments_refused_with_a_reason(args, words):
    assert words in parse(*args)[1]


# ---- choosing -------------------------------------------------------------------------------------------
def test_best_and_the_fewest_sms_within_ten_percent():
    times = {4: 1.12, 6: 1.04, 8: 0.99, 16: 0.95, 24: 0.95, 32: 0.97}
    assert best_budget(times) == 16          # a tie goes to the fewer SMs
    assert pick_budget(times) == 6           # 1.04 <= 1.1 x 0.95; 1.12 is not
    assert pick_budget(times, tolerance=0.0) == 16
    assert pick_budget({8: 2.0, 16: 1.0}) == 16
    with pytest.raises(ValueError):
        best_budget({})


def _row(op, budget, blocks, time_us, nbytes, ceiling_us, transport="nvlink", api="v2"):
    return bench.Row(op, 4096, 7168, 8, 256, "fp8", time_us, nbytes / time_us / 1e3, ceiling_us,
                     nbytes / ceiling_us / 1e3, transport, blocks, budget, api)


def test_measured_inputs_fit_the_per_sm_rate_without_the_fixed_part():
    nbytes, fixed_us, rate = 150e6, 200.0, 30.0   # t = fixed + B / (blocks x rate)
    t = {b: fixed_us + nbytes / (b * rate * 1e3) for b in (4, 6, 8, 16)}
    rows = [_row("dispatch", b, b, t[b], nbytes, 300.0 + b) for b in (4, 6, 8, 16)]
    rows.append(_row("dispatch", 24, 16, t[16] + 1, nbytes, 320.0))   # 24 SMs capped to 16 blocks
    link, per_sm, how = measured_model_inputs(rows)
    assert per_sm == pytest.approx(rate) and "4 and 6 blocks" in how
    assert link == pytest.approx(nbytes / 304.0 / 1e3)                # the fastest ceiling
    flat = [_row("combine", 4, 4, 500.0, nbytes, 300.0), _row("combine", 6, 6, 510.0, nbytes, 300.0)]
    assert measured_model_inputs(flat)[1] == math.inf                  # not SM-bound: no finite rate
    one = measured_model_inputs([_row("combine", 8, 8, 500.0, nbytes, 300.0)])
    assert one[1] == pytest.approx(nbytes / 500.0 / 1e3 / 8) and "lower bound" in one[2]
    assert measured_model_inputs([_row("combine", None, None, 500.0, nbytes, 300.0)]) is None   # the CPU


def _model():
    model = ElasticBuffer.__new__(ElasticBuffer)   # the model reads only these attributes
    model.num_ranks, model.num_nvlink_ranks, model.prefer_overlap_with_compute = 8, 8, True
    model._num_sms_estimates = {}
    return model


def test_model_lines_print_both_picks_with_their_inputs():
    nbytes = 150e6
    rows = [_row("dispatch", b, b, 200.0 + nbytes / (b * 30.0 * 1e3), nbytes, 400.0) for b in (4, 6)]
    nominal, measured = bench.model_lines(_model(), 256, 8, rows)
    assert nominal.startswith(f"get_theoretical_num_sms(256, 8) = {_model().get_theoretical_num_sms(256, 8)} ")
    assert "NVLink 450 GB/s" in nominal and "SM read 200 GB/s" in nominal and "SM write 50 GB/s" in nominal
    assert "5.29 ranks per token" in nominal
    link = nbytes / 400.0 / 1e3
    want = _model().get_theoretical_num_sms(256, 8, nvlink_gbs=link, sm_write_gbs=30.0)
    assert f"nvlink_gbs={link:.1f}, sm_write_gbs=30.0) = {want} " in measured and "fit between 4 and 6" in measured
    assert bench.model_lines(_model(), 256, 8, [_row("dispatch", None, None, 9.0, 1e6, 8.0)]) == [nominal]


# ---- the table -------------------------------------------------------------------------------------------
def _sweep_rows():
    nbytes = 150e6
    ours = {4: 1000.0, 6: 900.0, 8: 870.0, 16: 850.0, 24: 851.0, 32: 852.0}
    rows = []
    for sms, t in ours.items():
        rows.append(_row("dispatch", sms, min(sms, 16), t, nbytes, 700.0))
        rows.append(_row("combine", sms, min(sms, 16), 2 * t, 2 * nbytes, 1400.0))
    for sms, t in {8: 1300.0, 16: 1200.0, 24: 1250.0}.items():
        rows.append(_row("dispatch", sms, sms, t, nbytes, 700.0, "deep_ep", "v1"))
        rows.append(_row("layout+dispatch", sms, sms, t + 100, nbytes, 700.0, "deep_ep", "v1"))
        rows.append(_row("combine", sms, sms, 2 * t, 2 * nbytes, 1400.0, "deep_ep", "v1"))
    return rows


def test_sweep_table_has_a_row_per_budget_and_the_choices_per_op(capsys):
    models = {("dispatch", 4096): ["get_theoretical_num_sms(256, 8) = 12 with its nominal inputs: ..."]}
    bench.print_sweep(_sweep_rows(), 8, models, "deep_ep", [4, 6, 8, 16, 24, 32])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["op"]).split()
    assert header == ["op", "tokens", "api", "transport", "SMs", "blocks", "time_us", "GB/s", "ceil_GB/s", "of_ceil",
                      "deep_ep_best/time"]
    table = [line.split() for line in lines if len(line.split()) == len(header) and line.split()[0] != "op"]
    ours = [row for row in table if row[3] == "nvlink"]
    assert [(row[0], row[4], row[5]) for row in ours if row[0] == "dispatch"] == [
        ("dispatch", "4", "4"), ("dispatch", "6", "6"), ("dispatch", "8", "8"), ("dispatch", "16", "16"),
        ("dispatch", "24", "16"), ("dispatch", "32", "16")]   # the budget asked for and the blocks run
    assert {row[0] for row in table if row[3] == "deep_ep"} == {"dispatch", "layout+dispatch", "combine"}
    six = next(row for row in ours if row[0] == "dispatch" and row[4] == "6")
    assert six[-1] == f"{1200.0 / 900.0:.3f}" and six[-2] == f"{100 * 700 / 900:.1f}%"
    text = "\n".join(lines)
    dispatch = text[text.index("dispatch, 4096 tokens, v2 (nvlink):"):text.index("combine, 4096 tokens")]
    assert "measured best: 16 SMs, 850.0 us" in dispatch
    assert "pick (fewest SMs within 10 % of the best): 6 SMs, 900.0 us (+5.9 %)" in dispatch
    assert "get_theoretical_num_sms(256, 8) = 12" in dispatch
    assert "deep_ep dispatch: best over 8 16 24 SMs: 16 SMs, 1200.0 us; its time / ours at the pick = 1.333" in dispatch
    assert "deep_ep layout+dispatch: best over 8 16 24 SMs: 16 SMs, 1300.0 us" in dispatch
    combine = text[text.index("combine, 4096 tokens, v2 (nvlink):"):]
    assert "pick (fewest SMs within 10 % of the best): 6 SMs" in combine and "get_theoretical" not in combine


def test_sweep_table_off_sms_has_no_sm_columns(capsys):
    rows = [_row(op, None, None, 10.0, 1e6, 5.0, "reference") for op in ("dispatch", "combine")]
    bench.print_sweep(rows, 2, {}, None, [4, 6])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["op"]).split()
    assert "SMs" not in header and "blocks" not in header and "the row's blocks" not in out
    assert "(the CPU has no SMs: --num-sms 4 6 ran as one row per op)" in out
    assert "measured best" not in out and "pick" not in out


# ---- a real run -----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's one-row sweep (a GPU sweeps every budget)")
def test_v2_sweep_runs_on_the_reference_transport_checked_against_the_oracle():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "deepep_portable", "bench", "--api", "v2", "--ranks", "2",
                        "--tokens", "8", "--hidden", "256", "--topk", "2", "--experts", "8", "--warmup", "0",
                        "--iters", "1", "--no-progress", "--num-sms", "4", "6", "--compare", "deepep_portable"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "(the CPU has no SMs: --num-sms 4 6 ran as one row per op)" in out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["op"]).split()
    assert "SMs" not in header and "ceil_GB/s" in header
    rows = [line.split() for line in out.splitlines() if len(line.split()) == len(header) and line.split()[0] != "op"]
    assert sorted((row[0], row[2]) for row in rows) == [("combine", "v1"), ("combine", "v2"), ("dispatch", "v1"),
                                                        ("dispatch", "v2"), ("layout+dispatch", "v1")]
    assert out.count("get_theoretical_num_sms(8, 2) = ") == 2   # dispatch and combine, with the inputs used
    assert "SM write 50 GB/s" in out and "deepep_portable dispatch: " in out
