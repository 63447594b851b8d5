"""`python -m deepep_portable verify`: the plan (which steps, commands and variables for which transports, launchers
and node shapes) on made-up machines, the readers of what steps leave (junit files, pytest's summary, bench's
table), a step that fails and one that hangs, and the whole command end to end on this machine over the reference
transport under mpirun, checked through its report."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from deepep_portable.tools import verify, verify_report
from deepep_portable.transports import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [b.name for b in registry.BACKENDS]


def _args(*words: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    verify.add_arguments(p)
    args = p.parse_args(list(words))
    args.launcher_args = args.launcher_args.split()
    args.logs = "/logs"
    return args


def _h200(**over) -> verify.Facts:
    """One GPU, nvlink / nvshmem / nccl_gin / reference usable, no NIC (ibgda unusable), as on the lent H200."""
    usable = {n: (n != "ibgda", "ok" if n != "ibgda" else "no RDMA device") for n in NAMES}
    facts = verify.Facts(names=NAMES, usable=usable, kernel=[n for n in NAMES if n != "reference"],
                         spans_nodes=[b.name for b in registry.BACKENDS if b.spans_nodes],
                         by_name_only=[b.name for b in registry.BACKENDS if not b.in_auto],
                         stand_ins=verify.stand_ins_from_registry(registry.BACKENDS), gpus=1, on_gpu=True,
                         mpi="openmpi", deep_ep=None, mps=True, root=True, python="/py")
    for k, v in over.items():
        setattr(facts, k, v)
    return facts


def _cpu() -> verify.Facts:
    usable = {n: (n == "reference", "no CUDA GPU" if n != "reference" else "ok") for n in NAMES}
    return _h200(usable=usable, gpus=0, on_gpu=False, mps=False)


def _steps(plan) -> dict:
    return {s.name: s for s in plan.steps}


# ---- the plan ------------------------------------------------------------------------------------------------------
def test_stand_ins_come_from_the_registry_rows():
    stand = verify.stand_ins_from_registry(registry.BACKENDS)
    assert stand == {"nccl_gin": {"DEEPEP_TEST_NCCL_GIN_MOCK": "1"}, "ibgda": {"DEEPEP_TEST_IBGDA_MODEL": "1"}}


def test_logical_nodes_on_one_gpu_with_stand_ins():
    plan = verify.build_plan(_args("--ranks", "8", "--ranks-per-node", "4", "--stand-ins", "--suite", "quick"),
                             _h200(), {})
    assert plan.transports == [("nvshmem", "real"), ("nvlink", "real"), ("nccl_gin", "stand-in"),
                               ("ibgda", "stand-in"), ("reference", "real")]
    assert plan.single_machine and plan.mps   # 8 ranks on one GPU: MPS around each step
    steps = _steps(plan)
    assert [s.name for s in plan.steps] == [
        "preflight", "suites_nvshmem_low_latency", "suites_nvshmem_internode", "bench_nvshmem_internode",
        "bench_nvshmem_low_latency", "suites_nvlink_low_latency", "suites_nvlink_intranode", "bench_nvlink_normal",
        "bench_nvlink_low_latency", "suites_nccl_gin_low_latency", "suites_nccl_gin_internode",
        "bench_nccl_gin_internode", "bench_nccl_gin_low_latency", "suites_ibgda_low_latency", "suites_ibgda_internode",
        "bench_ibgda_internode", "bench_ibgda_low_latency", "suites_reference", "bench_reference_internode"]
    pre = steps["preflight"].argv
    assert pre[:2] == ["mpirun", "-n"] and pre[2] == "8" and "--allow-run-as-root" in pre
    assert pre[-6:] == ["doctor", "--cluster", "--timeout", "30", "--ranks-per-node", "4"]

    ll, internode = steps["suites_nvshmem_low_latency"], steps["suites_nvshmem_internode"]
    assert ll.env == {"DEEPEP_TEST_LL_TRANSPORT": "nvshmem"}
    assert internode.env == {"DEEPEP_TEST_INTERNODE_TRANSPORT": "nvshmem", "DEEPEP_TEST_RANKS_PER_NODE": "4"}
    assert [w for w in ll.argv if w.startswith("tests/mpi/")] == ["tests/mpi/test_transport_selftest_gpu_mpi.py",
                                                                  "tests/mpi/test_low_latency_gpu_mpi.py"]
    assert [w for w in internode.argv if w.startswith("tests/mpi/")] == ["tests/mpi/test_internode_gpu_mpi.py"]
    k = ll.argv[ll.argv.index("-k") + 1]
    assert k.startswith("(test_transport_selftest_gpu_mpi and nvshmem) or (test_low_latency_gpu_mpi and (")
    assert internode.argv[internode.argv.index("-k") + 1].startswith("(test_internode_gpu_mpi and (")
    assert ll.argv[:3] == ["mpirun", "-n", "8"] and "/py" in ll.argv
    for step in (ll, internode):   # every variable the step sets travels to the ranks
        for name in step.env:
            assert step.argv[step.argv.index(name) - 1] == "-x"

    nvlink = steps["suites_nvlink_intranode"]
    assert nvlink.env == {"DEEPEP_TEST_NORMAL_TRANSPORT": "nvlink"} and "suites_nvlink_internode" not in steps
    assert "tests/mpi/test_intranode_gpu_mpi.py" in nvlink.argv

    for part in ("low_latency", "internode"):
        assert steps[f"suites_ibgda_{part}"].env["DEEPEP_TEST_IBGDA_MODEL"] == "1"
        assert steps[f"suites_nccl_gin_{part}"].env["DEEPEP_TEST_NCCL_GIN_MOCK"] == "1"
        assert steps[f"suites_ibgda_{part}"].note and not steps[f"suites_ibgda_{part}"].skip
    assert steps["bench_ibgda_internode"].skip and steps["bench_nccl_gin_low_latency"].skip

    bench = steps["bench_nvshmem_internode"].argv
    assert bench[:5] == ["/py", "-m", "deepep_portable", "bench", "--ranks"] and bench[5] == "8"   # spawned ranks
    assert bench[bench.index("--mode") + 1] == "internode" and bench[bench.index("--ranks-per-node") + 1] == "4"
    assert "--baseline" in bench and "--compare" not in bench and bench[bench.index("--tokens") + 1] == "4096"
    nvl = steps["bench_nvlink_normal"]
    assert nvl.ranks == 8 and nvl.argv[nvl.argv.index("--mode") + 1] == "normal"   # one machine: every rank
    ll = steps["bench_nvshmem_low_latency"].argv
    assert ll[ll.index("--tokens") + 1] == "128"
    ref = steps["bench_reference_internode"].argv
    assert ref[ref.index("--tokens") + 1] == "512" and "--iters" in ref
    assert not any(s.kind == "bench" and s.mode == "low_latency" and s.transport == "reference" for s in plan.steps)
    assert steps["suites_reference"].argv.count("tests/mpi/test_reference_mpi.py") == 1


def test_a_backend_asked_for_by_name_only_waits_to_be_named():
    plan = verify.build_plan(_args("--ranks", "8"), _h200(), {})
    assert ("nccl_gin", "usable, but asked for by name only (the registry): --transports nccl_gin") in plan.not_run
    assert any(n == "ibgda" and "--stand-ins" in why for n, why in plan.not_run)
    plan = verify.build_plan(_args("--ranks", "8", "--transports", "nccl_gin", "nvlink"), _h200(), {})
    assert plan.transports == [("nccl_gin", "real"), ("nvlink", "real")]
    with pytest.raises(ValueError, match="unknown transport"):
        verify.build_plan(_args("--transports", "nvlinkk"), _h200(), {})


def test_full_suite_runs_whole_files():
    plan = verify.build_plan(_args("--ranks", "4", "--transports", "nvlink", "reference"), _h200(), {})
    steps = _steps(plan)
    ll = steps["suites_nvlink_low_latency"].argv
    assert ll[ll.index("-k") + 1] == "(test_transport_selftest_gpu_mpi and nvlink) or (test_low_latency_gpu_mpi)"
    assert "-k" not in steps["suites_nvlink_intranode"].argv
    assert "tests/mpi/test_two_buffers_mpi.py" in steps["suites_nvlink_common"].argv
    assert steps["suites_nvlink_common"].env == {"DEEPEP_TEST_TRANSPORT": "nvlink"}
    ref = steps["suites_reference"].argv
    assert "-k" not in ref and "tests/mpi/test_buffer_agreement_mpi.py" in ref
    assert "--tokens" not in steps["bench_nvlink_normal"].argv   # bench's own sweep


def test_mpirun_with_a_hostfile_spans_machines():
    args = _args("--launcher", "mpirun", "--launcher-args", "--hostfile hosts --map-by ppr:4:node", "--ranks", "8",
                 "--ranks-per-node", "4", "--transports", "nvlink", "nvshmem")
    plan = verify.build_plan(args, _h200(), {"NCCL_IB_HCA": "mlx5_0", "HOME": "/root"})
    assert not plan.single_machine and not plan.mps
    steps = _steps(plan)
    s = steps["suites_nvshmem_internode"].argv
    assert s[:7] == ["mpirun", "-n", "8", "--hostfile", "hosts", "--map-by", "ppr:4:node"]
    assert "NCCL_IB_HCA" in s and "HOME" not in s and "--allow-run-as-root" not in s   # the user's words only
    # nvlink serves one node: over machines its bench runs on one node's ranks
    nvl = steps["bench_nvlink_normal"]
    assert nvl.ranks == 4 and nvl.argv[:3] == ["mpirun", "-n", "4"] and "--ranks" not in nvl.argv
    assert steps["bench_nvshmem_internode"].argv[:3] == ["mpirun", "-n", "8"]


def test_mpich_forwards_with_genvlist():
    plan = verify.build_plan(_args("--launcher", "mpirun", "--ranks", "2", "--transports", "nvlink"),
                             _h200(mpi="mpich"), {})
    argv = _steps(plan)["suites_nvlink_low_latency"].argv
    names = argv[argv.index("-genvlist") + 1].split(",")
    assert "DEEPEP_TEST_LL_TRANSPORT" in names and "-x" not in argv


def test_srun_and_torchrun():
    plan = verify.build_plan(_args("--launcher", "srun", "--launcher-args", "--nodes 2 --mpi=pmix", "--ranks", "16",
                                   "--ranks-per-node", "8", "--transports", "nvshmem"), _h200(), {})
    s = _steps(plan)
    assert s["suites_nvshmem_internode"].argv[:6] == ["srun", "-n", "16", "--kill-on-bad-exit=1", "--nodes", "2"]
    assert not plan.single_machine

    plan = verify.build_plan(_args("--launcher", "torchrun", "--launcher-args", "--nnodes 2 --nproc-per-node 8",
                                   "--ranks", "16", "--ranks-per-node", "8", "--transports", "nvshmem"), _h200(), {})
    s = _steps(plan)
    assert "mpirun or srun" in s["suites_nvshmem_low_latency"].skip
    b = s["bench_nvshmem_internode"].argv
    assert b[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"] and b[5:8] == ["-m", "deepep_portable", "bench"]
    assert s["preflight"].argv[0] == "torchrun" and not s["preflight"].skip


def test_deepep_beside_ours_where_bench_runs_it():
    plan = verify.build_plan(_args("--ranks", "8", "--ranks-per-node", "4", "--transports", "nvlink", "nvshmem"),
                             _h200(deep_ep="/site/deep_ep/__init__.py"), {})
    s = _steps(plan)
    assert s["bench_nvlink_normal"].argv[-2:] == ["--compare", "deep_ep"]
    assert "--compare" in s["bench_nvshmem_low_latency"].argv
    assert "--compare" not in s["bench_nvshmem_internode"].argv   # bench drives no peer in internode mode
    plan = verify.build_plan(_args("--ranks", "8", "--transports", "nvlink", "--compare", ""),
                             _h200(deep_ep="/site/deep_ep/__init__.py"), {})
    assert "--compare" not in _steps(plan)["bench_nvlink_normal"].argv


def test_cpu_machine_and_bad_shapes():
    plan = verify.build_plan(_args("--ranks", "2", "--suite", "quick"), _cpu(), {})
    assert plan.transports == [("reference", "real")] and not plan.mps
    s = _steps(plan)
    assert s["suites_reference"].env == {"DEEPEP_TEST_TRANSPORT": "reference"}
    b = s["bench_reference_normal"].argv
    assert b[b.index("--tokens") + 1] == "64" and b[b.index("--ranks") + 1] == "2"
    for bad in (["--ranks", "8", "--ranks-per-node", "3"], ["--ranks", "4", "--ranks-per-node", "4"]):
        with pytest.raises(ValueError, match="--ranks-per-node"):
            verify.build_plan(_args(*bad), _cpu(), {})
    no_mpi = _cpu()
    no_mpi.mpi = None
    plan = verify.build_plan(_args("--ranks", "2"), no_mpi, {})
    assert "need mpirun" in _steps(plan)["suites_reference"].skip and "mpirun" in _steps(plan)["preflight"].skip
    no_plugin = _cpu()
    no_plugin.mpi_ready = "pytest-mpi is missing"
    plan = verify.build_plan(_args("--ranks", "2"), no_plugin, {})
    assert "pytest-mpi" in _steps(plan)["suites_reference"].skip


def test_the_quick_selections_still_select_tests():
    """Every file's quick -k part collects tests (a renamed test would otherwise leave a suite empty)."""
    suites = [verify.LOW_LATENCY, verify.INTRANODE, verify.INTERNODE, verify.WITHOUT_KERNELS]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *[s.path for s in suites], "-k", verify.selection("nvlink", suites, quick=True)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-1000:]
    for suite in suites:
        assert sum(line.startswith(suite.path + "::") for line in done.stdout.splitlines()) >= 2, suite.path


# ---- reading what steps leave ----------------------------------------------------------------------------------------
BENCH_OUT = """baseline skipped: all_to_all_single over NCCL needs one GPU per rank and an NCCL group

8 ranks on NVIDIA H200; ceiling = one plain copy of the same bytes on the same device, same run
      op  tokens  hidden  topk  experts   prec  time_us   GB/s  ceil_GB/s  of_ceil  SMs  transport
dispatch    4096    7168     8      256    fp8    500.0  100.0      200.0    50.0%   16     nvlink
 combine    4096    7168     8      256   bf16    800.0  120.0      240.0    50.0%   16     nvlink
a2a_dispatch 4096   7168     8      256    fp8   1000.0   50.0      200.0    25.0%    -   nccl a2a
dispatch    4096    7168     8      256    fp8    600.0   83.3      200.0    41.7%   16    deep_ep

deep_ep time / ours (same processes, inputs and timing; > 1: deepep_portable is faster)
"""


def test_bench_table_and_the_side_by_side_rows():
    rows, notes = verify_report.bench_table(BENCH_OUT)
    assert [r["transport"] for r in rows] == ["nvlink", "nvlink", "nccl a2a", "deep_ep"]
    assert rows[0]["time_us"] == "500.0" and rows[2]["op"] == "a2a_dispatch"
    assert notes[0].startswith("baseline skipped") and notes[1].startswith("deep_ep time / ours")
    step = verify.Step("bench_nvlink_normal", "bench", "nvlink", ["x"], ranks=8, mode="normal")
    plan = verify.Plan([step], [("nvlink", "real")], [], True, True, 8, None, "local", "quick")
    out = verify_report.Outcome(step.name, "passed", 0, 3.0, "/l", rows=rows, notes=notes)
    lines = verify_report._bench_lines(verify_report.Result("c", "t", 1.0, plan, [out], {}, "/logs"))
    assert lines[2] == "| nvlink | normal | 8 | dispatch | 4096 | 500.0 | 100.0 | 200.0 | 50.0% | 1000.0 | 600.0 | 1.20 |"
    assert lines[3].endswith("| 800.0 | 120.0 | 240.0 | 50.0% | - | - | - |") and len(lines) == 4


def test_junit_files_of_every_rank(tmp_path):
    def write(rank, cases):
        body = "".join(f'<testcase classname="m" name="{n}">{inner}</testcase>' for n, inner in cases)
        (tmp_path / f"s.rank{rank}.xml").write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    write(0, [("a", ""), ("b", ""), ("c", '<skipped message="no GPU"/>')])
    write(1, [("a", ""), ("b", '<failure message="x"/>'), ("c", '<skipped message="no GPU"/>')])
    counts, failed, reasons = verify_report.junit_counts(str(tmp_path / "s"))
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "ranks": 2}
    assert failed == ["m::b"] and reasons == ["no GPU"]
    assert verify_report.summary_counts("x\n3 passed, 1 failed, 2 skipped, 4 deselected in 1.2s\n") == \
        {"passed": 3, "failed": 1, "skipped": 2}
    assert verify_report.summary_counts("no summary") == {}


def _result(tmp_path, steps):
    plan = verify.Plan(steps, [("reference", "real")], [], True, False, 2, None, "local", "quick")
    outcomes = [verify_report.judge(s, *verify.run_step(s, dict(os.environ), str(tmp_path / f"{s.name}.log"), 3),
                                    str(tmp_path / f"{s.name}.log")) for s in steps]
    return verify_report.Result("verify", "now", 1.0, plan, outcomes, {"versions": {"torch": "x"}}, str(tmp_path))


def test_a_failed_step_says_what_to_do_and_a_hung_one_is_stopped(tmp_path):
    fails = verify.Step("suites_reference", "suites", "reference",
                        [sys.executable, "-c", "print('[tests/mpi] base seed 77'); print('1 passed, 1 failed in 0.1s');"
                                           "raise SystemExit(1)"], env={"DEEPEP_TEST_TRANSPORT": "reference"})
    hangs = verify.Step("bench_reference_normal", "bench", "reference",
                        ["bash", "-c", "sleep 60 & sleep 60; wait"], mode="normal")
    result = _result(tmp_path, [fails, hangs])
    a, b = result.outcomes
    assert a.status == "failed" and a.counts["failed"] == 1 and a.seed == "77"
    assert b.status == "timed out" and b.seconds < 30
    v = verify_report.verdict(result)
    assert not v.passed and not v.incomplete and v.line.startswith("FAIL: 2 of 2")
    assert "DEEPEP_TEST_SEED=77" in v.todo[0] and "DEEPEP_TEST_TRANSPORT=reference" in v.todo[0]
    assert "doctor" in v.todo[0] and str(tmp_path) in v.todo[0] and "--step-timeout" in v.todo[1]
    text = verify_report.markdown(result)
    assert "## Verdict" in text and "timed out" in text and "| torch | x |" in text



def test_the_time_limit_makes_a_run_incomplete_not_failed(tmp_path):
    """A step running when the run's --time-limit comes is cut (its output kept), later ones are not started,
    and the verdict says INCOMPLETE, naming them, with a non-zero exit; a step's own --step-timeout still fails."""
    quick = verify.Step("suites_reference", "suites", "reference",
                        [sys.executable, "-c", "print('1 passed in 0.1s')"])
    slow = verify.Step("bench_reference_normal", "bench", "reference", ["bash", "-c", "sleep 60 & sleep 60; wait"],
                       mode="normal")
    late = verify.Step("suites_reference_again", "suites", "reference", [sys.executable, "-c", "pass"])
    plan = verify.Plan([quick, slow, late], [("reference", "real")], [], True, False, 2, None, "local", "quick")
    args = _args("--time-limit", "8")
    args.logs = str(tmp_path)
    outcomes = verify.execute(plan, args, dict(os.environ))
    assert [o.status for o in outcomes] == ["passed", "cut", "skipped"]
    assert outcomes[1].seconds < 30 and "--time-limit" in outcomes[1].why
    assert outcomes[2].why.startswith(verify_report.LIMIT_SKIP)
    result = verify_report.Result("verify", "now", 9.0, plan, outcomes, {"versions": {}}, str(tmp_path))
    v = verify_report.verdict(result)
    assert not v.passed and v.incomplete and v.line.startswith("INCOMPLETE: 1 steps passed, 1 cut and 1 not started")
    assert "bench_reference_normal" in v.todo[-1] and "suites_reference_again" in v.todo[-1]
    # the same step stopped by its own --step-timeout is a failure
    own = verify_report.judge(slow, None, 3.0, True, str(tmp_path / "bench_reference_normal.log"))
    assert own.status == "timed out"

# ---- end to end ------------------------------------------------------------------------------------------------------
def _mpi_ready() -> str:
    if shutil.which("mpirun") is None:
        return "no mpirun"
    for module in ("mpi4py", "pytest_mpi"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} missing"
    return ""


@pytest.mark.skipif(bool(_mpi_ready()), reason=_mpi_ready())
def test_verify_over_the_reference_transport_under_mpirun(tmp_path):
    """The CPU machine's run: the reference suites' quick selection and the reference bench at 2 ranks under
    mpirun, one report with the versions, the topology, each step and the bench table, and a JSON twin."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_rmaps_base_oversubscribe="1")
    report, data = tmp_path / "verify.md", tmp_path / "verify.json"
    done = subprocess.run([sys.executable, "-m", "deepep_portable", "verify", "--transports", "reference", "--ranks",
                           "2", "--launcher", "mpirun", "--suite", "quick", "--no-preflight", "--step-timeout", "150",
                           "--report", str(report), "--json", str(data)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    for part in ("## Plan", "## Versions", "| torch |", "| NCCL |", "## Topology", "### CUDA driver and GPUs",
                 "### Transports", "## Steps", "suites_reference", "bench_reference_normal", "## Benchmark",
                 "| reference | normal | 2 | dispatch | 64 |", "| reference | normal | 2 | combine | 64 |",
                 "baseline skipped", "## Verdict", "PASS: 2 steps passed", "mpirun -n 2"):
        assert part in text, part
    result = json.loads(data.read_text())
    suites, bench = result["outcomes"]
    assert suites["status"] == "passed" and suites["counts"]["passed"] >= 5 and suites["counts"]["failed"] == 0
    assert suites["counts"]["ranks"] == 2 and os.path.exists(suites["log"])
    assert bench["status"] == "passed" and {r["op"] for r in bench["rows"]} >= {"layout", "dispatch", "combine"}
    assert result["verdict"]["passed"] and (tmp_path / "verify_logs" / "doctor.txt").exists()
