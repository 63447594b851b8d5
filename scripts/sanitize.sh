#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over every kernel family on small shapes, on a GPU
# machine. Single-process tests run under each tool; the multi-rank suites run at 2 ranks
# without MPS (the sanitizer does not attach to MPS clients), each rank under the tool, on their smallest
# cases. Prints one line per (suite, tool) with the sanitizer's ERROR SUMMARY lines; logs in $OUT.
#   usage: bash scripts/sanitize.sh [tools="memcheck racecheck synccheck"]
set -uo pipefail
TOOLS=${1:-"memcheck racecheck synccheck"}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
SAN=${COMPUTE_SANITIZER:-$CUDA_HOME/bin/compute-sanitizer}
[ -x "$SAN" ] || { echo "compute-sanitizer not found at $SAN"; exit 2; }
export DEEPEP_PORTABLE_TIMEOUT_S=${DEEPEP_PORTABLE_TIMEOUT_S:-60}   # everything runs much slower under the tool
export DEEPEP_TEST_LL_TRANSPORT=${DEEPEP_TEST_LL_TRANSPORT:-nvlink}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x PYTHONPATH -x CUDA_HOME -x DEEPEP_PORTABLE_CACHE_DIR
        -x DEEPEP_PORTABLE_TIMEOUT_S -x PYTHONUNBUFFERED -x DEEPEP_TEST_DEVICE=cuda -x DEEPEP_TEST_LL_TRANSPORT)
# name | ranks | test file | -k expression | environment: the layout and copy kernels (not the killed-rank tests: their
# SIGKILL under the tool tests the tool); the layout kernel alone (a quick subset of the first); intranode dispatch/combine (small
# cases: top-3); low-latency dispatch/combine/clean (small, LogFMT, shrink); the transport conformance kernel;
# the internode kernels (2 logical nodes of 1 rank, nvshmem). Then each backend's own suites, as its registry row
# lists them (python -m deepep_portable.transports.registry --steps sanitize), in the same format.
LL_SMALL="small or logfmt or shrink"
INTER_SMALL="odd_shapes and (dense or no-topk)"
SUITES=("gpu|1|tests/gpu|not killed|"
        "layout|1|tests/gpu/test_layout_gpu.py|not sm80 and not forced|"
        "intranode|2|tests/mpi/test_intranode_gpu_mpi.py|top3|"
        "low_latency|2|tests/mpi/test_low_latency_gpu_mpi.py|$LL_SMALL|"
        "selftest|2|tests/mpi/test_transport_selftest_gpu_mpi.py||"
        "internode|2|tests/mpi/test_internode_gpu_mpi.py|$INTER_SMALL|")
BACKEND_SUITES=$($PY -W ignore::RuntimeWarning -m deepep_portable.transports.registry --steps sanitize) \
    || { echo "sanitize.sh: cannot read the backends' suites from the registry"; exit 2; }
while IFS= read -r entry; do [ -n "$entry" ] && SUITES+=("$entry"); done <<<"$BACKEND_SUITES"
declare -a SUMMARY
ONLY=${SANITIZE_SUITES:-}   # a subset of the suites by name, e.g. "gpu low_latency"
for tool in $TOOLS; do
    flags=(--tool "$tool" --print-limit 20 --error-exitcode 99)
    # Failing CUDA API calls are expected here (a parameter-info probe past the last parameter, the tests that
    # force an architecture the GPU cannot run): the tool's report of them is not what we look for.
    flags+=(--report-api-errors no)
    [ "$tool" = memcheck ] && flags+=(--leak-check no)
    for entry in "${SUITES[@]}"; do
        IFS='|' read -r name ranks file expr envs <<<"$entry"
        [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && continue
        log="$OUT/sanitize_${name}_$tool.log"
        cmd=("$SAN" "${flags[@]}" $PY -m pytest -q -rs -p no:cacheprovider "$file")
        [ -n "$expr" ] && cmd+=(-k "$expr")
        exports=()   # the suite's environment, for this command and (by name) for every rank mpirun starts
        for kv in $envs; do exports+=(-x "${kv%%=*}"); done
        if [[ $file != tests/mpi/* ]]; then
            env $envs timeout -k 10 "${STEP_TIMEOUT:-900}" "${cmd[@]}" >"$log" 2>&1
        else   # the MPI suites, also at one rank (their tests need --with-mpi)
            env $envs timeout -k 10 "${STEP_TIMEOUT:-900}" "${MPIRUN[@]}" "${exports[@]}" -n "$ranks" "${cmd[@]}" \
                --with-mpi >"$log" 2>&1
        fi
        rc=$?
        SUMMARY+=("$(printf '%-16s %-10s rc=%-3s %s' "$name" "$tool" "$rc" \
            "$(grep -a -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c | tr -s ' ' | head -3 | tr '\n' ';')")")
    done
done
echo; echo "=== compute-sanitizer (logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
