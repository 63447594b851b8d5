"""What `python -m deepep_portable verify` (verify.py) makes of its steps: each step's outcome, read from what the step
left (pytest's junit files of every rank, else its summary line; bench's table), and the one report: the plan, the
versions and topology (doctor's own functions), every step's command, outcome, duration and log, the benchmark
side by side (ours, its ceiling, NCCL all_to_all_single, DeepEP), and a verdict where every failure says what to do.
"""
from __future__ import annotations

import glob
import io
import os
import platform
import re
import shlex
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

NCCL_ROW = "nccl a2a"       # bench's transport column for the all_to_all_single baseline
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected|xfailed|xpassed)\b")
SEED = re.compile(r"base seed (\d+)")
DOCTOR_SECTIONS = ("CUDA driver and GPUs", "RDMA devices", "Transports")
LIMIT_SKIP = "--time-limit"   # how the reason of a step skipped for want of time begins (verify.execute)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # where the steps run


@dataclass
class Outcome:
    step: str
    status: str                       # passed, failed, timed out, cut (by the run's --time-limit), skipped
    rc: Optional[int] = None
    seconds: float = 0.0
    log: str = ""
    why: str = ""                     # skipped: the reason; failed: what went wrong, in short
    counts: Dict[str, int] = field(default_factory=dict)   # passed / failed / skipped tests, ranks reporting
    failed_tests: List[str] = field(default_factory=list)
    skip_reasons: List[str] = field(default_factory=list)
    seed: Optional[str] = None
    rows: List[Dict[str, str]] = field(default_factory=list)   # bench: its table's rows, by column name
    notes: List[str] = field(default_factory=list)             # bench: its remarks (baseline skipped, ...)
    verdict: str = ""                 # preflight: doctor --cluster's verdict line


@dataclass
class Verdict:
    passed: bool
    line: str
    todo: List[str]
    incomplete: bool = False          # nothing failed, but the time limit cut or dropped steps


@dataclass
class Result:
    command: str
    started: str
    seconds: float
    plan: object
    outcomes: List[Outcome]
    context: Dict
    logs: str


# ---- reading what a step left ------------------------------------------------------------------------------------
def junit_counts(prefix: str) -> Tuple[Dict[str, int], List[str], List[str]]:
    """({passed, failed, skipped, ranks}, failed test ids, skip reasons) over every rank's junit file
    (`prefix`.rank<N>.xml): a test fails when it fails on any rank and is skipped when every rank skipped it."""
    per_test: Dict[str, List[str]] = {}
    reasons: Dict[str, None] = {}
    files = sorted(glob.glob(prefix + ".rank*.xml"))
    for path in files:
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            continue
        for case in root.iter("testcase"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                state = "failed"
            elif case.find("skipped") is not None:
                state = "skipped"
                reasons[(case.find("skipped").get("message") or "").strip()[:200]] = None
            else:
                state = "passed"
            per_test.setdefault(test, []).append(state)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "ranks": len(files)}
    failed = []
    for test, states in per_test.items():
        state = "failed" if "failed" in states else "skipped" if all(s == "skipped" for s in states) else "passed"
        counts[state] += 1
        if state == "failed":
            failed.append(test)
    return counts, failed, [r for r in reasons if r]


def summary_counts(text: str) -> Dict[str, int]:
    """pytest's last summary line ("3 passed, 1 skipped in 2.1s") as counts; {} when there is none."""
    lines = [ln for ln in text.splitlines() if SUMMARY.search(ln) and re.search(r"\bin [\d.]+s", ln)]
    if not lines:
        return {}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for n, what in SUMMARY.findall(lines[-1]):
        key = "failed" if what in ("error", "errors") else what
        if key in counts:
            counts[key] += int(n)
    return counts


def bench_table(text: str) -> Tuple[List[Dict[str, str]], List[str]]:
    """bench's result table (every block that starts with its header line) as rows by column name, and its remarks.
    The last column (transport) may hold a space ("nccl a2a"): a line splits into as many cells as the header."""
    rows: List[Dict[str, str]] = []
    notes: List[str] = []
    header: Optional[List[str]] = None
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["op"] and "time_us" in words:
            header = words
            continue
        if header is not None:
            cells = line.split(None, len(header) - 1)
            if len(cells) == len(header):
                rows.append(dict(zip(header, cells)))
                continue
            header = None
        stripped = line.strip()
        if stripped.startswith(("baseline skipped", "(internode mode", "(low_latency mode")) or \
                re.match(r"\S+ time / ours", stripped):
            if stripped not in notes:
                notes.append(stripped)
    return rows, notes


def _tail(path: str, n: int = 2) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[:300]


def judge(step, rc: Optional[int], seconds: float, timed_out: bool, log: str, cut: bool = False) -> Outcome:
    """The outcome of a step that ran: passed when it exited 0 (a suite whose every test skipped says so).
    `cut`: it was stopped because the whole run's --time-limit came, not its own --step-timeout; that says
    nothing against the step (what it printed until then is kept), so the run is incomplete, not failed."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    status = ("cut" if cut else "timed out") if timed_out else "passed" if rc == 0 else "failed"
    out = Outcome(step.name, status, rc, seconds, log)
    if step.kind == "suites":
        prefix = os.path.splitext(log)[0]
        counts, failed, reasons = junit_counts(prefix)
        if not counts["ranks"]:
            counts = {**summary_counts(text), "ranks": 0}
        out.counts, out.failed_tests, out.skip_reasons = counts, failed, reasons
        m = SEED.search(text)
        out.seed = m.group(1) if m else None
        if out.status == "passed" and counts.get("skipped") and not counts.get("passed"):
            out.why = "every test skipped: " + (reasons[0] if reasons else "see the log")
    elif step.kind == "bench":
        out.rows, out.notes = bench_table(text)
        if out.status == "passed" and not out.rows:
            out.status, out.why = "failed", "no result table in the output"
    elif step.kind == "preflight":
        verdicts = [ln.strip() for ln in text.splitlines() if re.search(r"\bReady\b|Not ready", ln)]
        out.verdict = verdicts[-1] if verdicts else ""
    if out.status == "cut":
        out.why = f"stopped when the run's --time-limit came, after {seconds:.0f} s; its output until then is kept"
    elif out.status != "passed" and not out.why:
        out.why = f"stopped at its time limit, after {seconds:.0f} s" if timed_out else (_tail(log) or f"exit code {rc}")
    return out


def one_line(o: Outcome) -> str:
    c = o.counts
    counts = f" ({c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped)" if c else ""
    rows = f" ({len(o.rows)} rows)" if o.rows else ""
    took = f", {o.seconds:.0f} s" if o.status != "skipped" else ""
    return f"{o.status}{counts}{rows}{took}" + (f": {o.why}" if o.why and o.status != "passed" else "")


# ---- what the report says about the machine ----------------------------------------------------------------------
def _command_line(argv: List[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        text = (done.stdout or done.stderr).strip().splitlines()
        return text[0] if text else "?"
    except (OSError, subprocess.SubprocessError) as e:
        return f"not found ({type(e).__name__})"


def doctor_sections(text: str, titles=DOCTOR_SECTIONS) -> Dict[str, str]:
    """Sections of doctor's printed report, by title (its "== Title ====" lines)."""
    out: Dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^== (.+?) =+$", line)
        if m:
            current = m.group(1) if m.group(1) in titles else None
            if current:
                out[current] = ""
            continue
        if current:
            out[current] += line + "\n"
    return {k: v.strip("\n") for k, v in out.items()}


def context(facts, logs: str) -> Dict:
    """Versions (doctor --cluster's list, plus the launchers and the test plugins) and topology (doctor's sections:
    GPUs and links, RDMA devices, transports); doctor's whole report is kept as logs/doctor.txt."""
    from .doctor import run_doctor
    from .doctor_cluster import read_machine, versions

    try:
        found = versions(read_machine())
    except Exception as e:   # noqa: BLE001 - the report says why instead
        found = {"versions": f"could not be read: {type(e).__name__}: {e}"}
    for name in ("mpi4py", "pytest", "pytest_mpi"):
        try:
            from importlib import metadata

            found[name] = metadata.version(name.replace("_", "-"))
        except Exception:   # noqa: BLE001
            found[name] = "not installed"
    found["mpirun"] = _command_line(["mpirun", "--version"]) if facts.mpi else "not found"
    found["DeepEP (deep_ep)"] = facts.deep_ep or "not importable (or only our alias)"
    found["host"] = f"{platform.node()}, {platform.platform()}"
    buf = io.StringIO()
    try:
        run_doctor(buf)
    except Exception as e:   # noqa: BLE001
        buf.write(f"doctor failed: {type(e).__name__}: {e}\n")
    with open(os.path.join(logs, "doctor.txt"), "w") as f:
        f.write(buf.getvalue())
    return {"versions": found, "topology": doctor_sections(buf.getvalue()),
            "doctor": os.path.join(logs, "doctor.txt"), "gpus": facts.gpus}


# ---- the report ---------------------------------------------------------------------------------------------------
def _todo(step, o: Outcome, plan) -> str:
    """What to do about a step that did not pass."""
    rerun = shlex.join(step.argv)
    env = " ".join(f"{k}={v}" for k, v in sorted(step.env.items()))
    doctor = "python -m deepep_portable doctor" + ("" if plan.launcher == "local" else
                                                   f", and `doctor --cluster` under {plan.launcher} like the job")
    where = f"read {o.log}"
    if step.kind == "suites":
        where += f" (rank 0; the other ranks: {os.path.splitext(o.log)[0]}.rank<N>.log)"
        if o.failed_tests:
            where += f"; failed: {', '.join(o.failed_tests[:5])}" + (" ..." if len(o.failed_tests) > 5 else "")
        if o.seed:
            where += f"; replay the inputs with DEEPEP_TEST_SEED={o.seed}"
    if o.status == "timed out":
        where += ("; the step was stopped at its time limit: its log ends where it stood (raise --step-timeout if it "
                  "was still making progress; NVSHMEM_DEBUG=INFO / NCCL_DEBUG=INFO show a start-up that waits)")
    return (f"{where}; rerun it alone: `cd {shlex.quote(CHECKOUT)} && {(env + ' ') if env else ''}{rerun}`; check the "
            f"machine: `{doctor}`")


def verdict(result: Result) -> Verdict:
    steps = {s.name: s for s in result.plan.steps}
    bad = [o for o in result.outcomes if o.status in ("failed", "timed out") and steps[o.step].kind != "preflight"]
    ran = [o for o in result.outcomes if o.status != "skipped"]
    todo = [f"{o.step}: {o.status} ({o.why}). What to do: {_todo(steps[o.step], o, result.plan)}" for o in bad]
    pre = [o for o in result.outcomes if steps[o.step].kind == "preflight" and o.status != "skipped"]
    if pre and (pre[0].status != "passed" or "Not ready" in pre[0].verdict):
        todo.append(f"preflight (doctor --cluster): {pre[0].verdict or pre[0].status}; its findings say what to do: "
                    f"{pre[0].log}")
    skipped = len(result.outcomes) - len(ran)
    # Steps the run's --time-limit stopped or never started: not failures, but not verified either.
    left = [o for o in result.outcomes if o.status == "cut" or (o.status == "skipped" and o.why.startswith(LIMIT_SKIP))]
    if left:
        todo.append(f"the run reached its --time-limit after {result.seconds:.0f} s with {len(left)} step(s) cut or not "
                    f"started ({', '.join(o.step for o in left)}): raise --time-limit, or rerun with --transports "
                    f"naming what is left")
    passed = sum(o.status == "passed" for o in ran)
    if bad:
        line = f"FAIL: {len(bad)} of {len(ran)} steps failed ({skipped} skipped)"
    elif not ran:
        line = f"NOTHING RAN: all {skipped} steps skipped"
    elif left:
        cut = sum(o.status == "cut" for o in left)
        line = (f"INCOMPLETE: {passed} steps passed, {cut} cut and {len(left) - cut} not started at the "
                f"--time-limit ({skipped} skipped in all)")
    else:
        line = f"PASS: {passed} steps passed ({skipped} skipped)"
    return Verdict(bool(ran) and not bad and not left, line, todo, incomplete=bool(ran) and not bad and bool(left))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _bench_lines(result: Result) -> List[str]:
    """One row per op of ours: its time, bandwidth, the ceiling, NCCL all_to_all_single on the same rows, DeepEP."""
    steps = {s.name: s for s in result.plan.steps}
    out = ["| transport | mode | ranks | op | tokens | ours (us) | GB/s | ceiling GB/s | of ceiling | "
           "NCCL a2a (us) | DeepEP (us) | DeepEP / ours |", "|" + "---|" * 12]
    for o in result.outcomes:
        if steps[o.step].kind != "bench" or not o.rows:
            continue
        step = steps[o.step]
        peers = {(r["op"], r["tokens"]): r for r in o.rows if r.get("transport") not in (step.transport, NCCL_ROW)}
        nccl = {(r["op"], r["tokens"]): r for r in o.rows if r.get("transport") == NCCL_ROW}
        for r in o.rows:
            if r.get("transport") != step.transport:
                continue
            base = r["op"][3:] if r["op"].startswith("ll_") else r["op"]
            a2a = nccl.get((f"a2a_{base}", r["tokens"])) if base in ("dispatch", "combine") else None
            peer = peers.get((r["op"], r["tokens"]))
            ratio = f"{float(peer['time_us']) / float(r['time_us']):.2f}" if peer and float(r["time_us"]) else "-"
            out.append("| " + " | ".join(_cell(c) for c in (
                step.transport, step.mode, step.ranks, r["op"], r["tokens"], r["time_us"], r.get("GB/s", "-"),
                r.get("ceil_GB/s", "-"), r.get("of_ceil", "-"), a2a["time_us"] if a2a else "-",
                peer["time_us"] if peer else "-", ratio)) + " |")
    return out


def markdown(result: Result) -> str:
    plan = result.plan
    steps = {s.name: s for s in plan.steps}
    v = verdict(result)
    w: List[str] = ["# deepep_portable verify", "",
                    f"`{result.command}`", "",
                    f"Started {result.started}, {result.seconds:.0f} s. **{v.line}**. Logs: `{result.logs}`.", "",
                    "## Plan", "",
                    f"- {plan.ranks} ranks, launcher `{plan.launcher}`"
                    + (f", nodes of {plan.ranks_per_node} ranks ({plan.ranks // plan.ranks_per_node} nodes"
                       + (", logical nodes on this machine)" if plan.single_machine else ")")
                       if plan.ranks_per_node else ", one node")
                    + (", CUDA MPS started around each step" if plan.mps else "") + f"; suite `{plan.suite}`",
                    "- transports verified: " + (", ".join(f"`{n}`" + (" (on the tests' stand-in)" if how != "real"
                                                                         else "") for n, how in plan.transports)
                                                  or "none")]
    w += [f"- not verified: `{n}`: {why}" for n, why in plan.not_run]
    w += ["", "## Versions", "", "| component | version |", "|---|---|"]
    w += [f"| {_cell(k)} | {_cell(val)} |" for k, val in result.context.get("versions", {}).items()]
    w += ["", "## Topology", "", f"From `python -m deepep_portable doctor` (whole report: `{result.context.get('doctor')}`)."]
    for title, text in result.context.get("topology", {}).items():
        w += ["", f"### {title}", "", "```", text or "(nothing)", "```"]
    w += ["", "## Steps", "", "| # | step | outcome | tests passed / failed / skipped | time (s) | log |",
          "|---|---|---|---|---|---|"]
    for i, o in enumerate(result.outcomes, 1):
        c = o.counts
        tests = f"{c.get('passed', 0)} / {c.get('failed', 0)} / {c.get('skipped', 0)}" if c else "-"
        what = o.status + (f": {o.why}" if o.why and o.status != "passed" else "")
        if o.verdict:
            what += f" ({o.verdict})"
        w.append(f"| {i} | {o.step} | {_cell(what)} | {tests} | "
                 f"{'-' if o.status == 'skipped' else f'{o.seconds:.0f}'} | {('`' + o.log + '`') if o.log else '-'} |")
    w += ["", "Commands (each ran from the source checkout with the variables shown):", ""]
    for o in result.outcomes:
        step = steps[o.step]
        env = " ".join(f"{k}={v}" for k, v in sorted(step.env.items()))
        w += [f"- {o.step}" + (f" ({step.note})" if step.note else "") + ":", "", "  ```",
              "  " + (env + " " if env else "") + shlex.join(step.argv), "  ```"]
        if o.skip_reasons and o.status != "skipped":
            w.append("  skipped tests: " + "; ".join(_cell(r) for r in o.skip_reasons[:4]))
    w += ["", "## Benchmark", "",
          "Logical bandwidth per rank (bytes a rank sends or receives over the op's time, the slowest rank's median); "
          "the ceiling is bench's, measured in the same run; NCCL a2a is `all_to_all_single` moving the same rows; "
          "DeepEP is `--compare deep_ep` on the same inputs. `-`: not measured in that mode or setting (notes below).",
          ""]
    lines = _bench_lines(result)
    w += lines if len(lines) > 2 else ["No benchmark ran."]
    notes = [(o.step, n) for o in result.outcomes for n in o.notes]
    if notes:
        w += ["", "Notes from the benchmark:", ""] + [f"- {s}: {_cell(n)}" for s, n in notes]
    w += ["", "## Verdict", "", f"**{v.line}**", ""]
    w += [f"- {_cell(t)}" for t in v.todo] or ["Every step that ran passed."]
    return "\n".join(w) + "\n"


def as_json(result: Result) -> Dict:
    return {"command": result.command, "started": result.started, "seconds": result.seconds,
            "plan": asdict(result.plan), "outcomes": [asdict(o) for o in result.outcomes],
            "context": result.context, "verdict": asdict(verdict(result))}


def plan_text(plan) -> str:
    """The plan as `--dry-run` prints it."""
    lines = [f"{plan.ranks} ranks, launcher {plan.launcher}, suite {plan.suite}"
             + (f", nodes of {plan.ranks_per_node}" if plan.ranks_per_node else "")
             + (", CUDA MPS around each step" if plan.mps else "")]
    lines += [f"transport {n}: {how}" for n, how in plan.transports]
    lines += [f"not verified {n}: {why}" for n, why in plan.not_run]
    for s in plan.steps:
        env = " ".join(f"{k}={v}" for k, v in sorted(s.env.items()))
        lines.append(f"{s.name}: " + (f"SKIP ({s.skip})" if s.skip else (env + " " if env else "") + shlex.join(s.argv)))
    return "\n".join(lines)
