#!/usr/bin/env bash
# CPU test suite: sets the machine up (scripts/setup_env.sh), then
#   1. python -m pytest -q tests --ignore=tests/mpi --ignore=tests/gpu
#   2. mpirun -n 4 python -m pytest --with-mpi -q tests/mpi      (reference transport over gloo)
# Fails when any step fails, including "no tests collected" (pytest exit code 5). Prints a final
# "N passed, M failed" line aggregated over both steps (an MPI test counts once; it fails when it
# fails on any rank), after a table of the skipped tests' reasons with their counts. Extra arguments
# go to both pytest runs (e.g. -k name, -x).
# Knobs: DEEPEP_MPI_NP (4), DEEPEP_TEST_TIMEOUT (seconds per step, 2400).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup_env.sh || { echo "run_tests.sh: environment setup failed"; exit 1; }

NP="${DEEPEP_MPI_NP:-4}"
TMO="${DEEPEP_TEST_TIMEOUT:-2400}"
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
# Open MPI as root, in containers (no CMA/ptrace), with more ranks than cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
failed_steps=()
color=(); [[ -t 1 ]] || color=(--color=no)   # mpirun gives ranks a pty: keep CI logs plain

has_tests() { [[ -d "$1" ]] && [[ -n "$(find "$1" -name 'test_*.py' -o -name '*_test.py' | head -n1)" ]]; }

echo "=== [1/2] CPU tests: pytest tests (without tests/mpi, tests/gpu)"
t=$SECONDS
timeout --kill-after=30 "$TMO" python -m pytest -q tests --ignore=tests/mpi --ignore=tests/gpu \
    -p no:cacheprovider "${color[@]}" --junitxml="$out/cpu.xml" "$@"
rc=$?
echo "--- CPU tests: exit code $rc, $((SECONDS - t)) s"
((rc == 0)) || failed_steps+=("cpu(rc=$rc$( ((rc == 5)) && echo ': no tests collected')$( ((rc == 124 || rc == 137)) && echo ": timed out after ${TMO}s"))")

echo "=== [2/2] MPI tests: mpirun -n $NP python -m pytest --with-mpi tests/mpi"
t=$SECONDS
if has_tests tests/mpi; then
    # Rank 0 prints; the other ranks log to files, shown when the step fails.
    timeout --kill-after=30 "$TMO" mpirun --allow-run-as-root --oversubscribe -n "$NP" \
        bash -c 'r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
                 args=(python -m pytest --with-mpi -q tests/mpi -p no:cacheprovider --junitxml="$0/mpi_$r.xml" "$@")
                 if [[ $r == 0 ]]; then exec "${args[@]}"; else exec "${args[@]}" >"$0/mpi_$r.log" 2>&1; fi' \
        "$out" "${color[@]}" "$@"
    rc=$?
    echo "--- MPI tests: exit code $rc, $((SECONDS - t)) s"
    if ((rc != 0)); then
        failed_steps+=("mpi(rc=$rc$( ((rc == 5)) && echo ': no tests collected')$( ((rc == 124 || rc == 137)) && echo ": timed out after ${TMO}s"))")
        for f in "$out"/mpi_*.log; do [[ -f $f ]] && { echo "--- output of ${f##*/}:"; tail -n 60 "$f"; }; done
    fi
else
    echo "--- no test files under tests/mpi"
    failed_steps+=("mpi(no test files)")
fi

python - "$out" <<'PY'
import glob, os, sys
import xml.etree.ElementTree as ET

def cases(path, reasons):
    """test -> passed / failed / skipped; `reasons` gets test -> why it was skipped."""
    res = {}
    try:
        root = ET.parse(path).getroot()
    except Exception:
        return res
    for tc in root.iter("testcase"):
        key = f"{tc.get('classname')}::{tc.get('name')}"
        tags = {c.tag for c in tc}
        res[key] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        if res[key] == "skipped":
            why = next(c for c in tc if c.tag == "skipped").get("message") or "no reason given"
            reasons.setdefault(key, " ".join(why.replace("Skipped: ", "", 1).split()))
    return res

def count(results):
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for v in results.values():
        c[v] += 1
    return c

out = sys.argv[1]
cpu_why, mpi_why = {}, {}
cpu = cases(os.path.join(out, "cpu.xml"), cpu_why)
mpi = {}
for f in sorted(glob.glob(os.path.join(out, "mpi_*.xml"))):
    for k, v in cases(f, mpi_why).items():   # a test fails if it fails on any rank
        order = {"failed": 2, "passed": 1, "skipped": 0}
        if order[v] > order.get(mpi.get(k), -1):
            mpi[k] = v
c1, c2 = count(cpu), count(mpi)
# Why tests were skipped: one row per (step, reason), most frequent first.
skips = {}
for step, results, why in (("CPU", cpu, cpu_why), ("MPI", mpi, mpi_why)):
    for k, v in results.items():
        if v == "skipped":
            skips[(step, why.get(k, "no reason given"))] = skips.get((step, why.get(k, "no reason given")), 0) + 1
if skips:
    print("skipped tests, by reason:")
    width = len(str(max(skips.values())))
    for (step, why), n in sorted(skips.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {n:>{width}}  {step}  {why if len(why) <= 150 else why[:147] + '...'}")
print(f"summary: CPU {c1['passed']} passed, {c1['failed']} failed, {c1['skipped']} skipped; "
      f"MPI {c2['passed']} passed, {c2['failed']} failed, {c2['skipped']} skipped")
print(f"{c1['passed'] + c2['passed']} passed, {c1['failed'] + c2['failed']} failed")
PY
if ((${#failed_steps[@]})); then
    echo "FAILED steps: ${failed_steps[*]}"
    exit 1
fi
echo "all test steps passed"
