#!/usr/bin/env bash
# Side by side: DeepEP V1 and deepep_portable in the same bench processes (`bench --compare deep_ep`:
# same inputs, same timing, our rows then DeepEP's, then DeepEP's time over ours per op), at several SM budgets,
# several runs, ranks sharing the GPU under MPS. Nothing is fetched: give it a DeepEP V1 checkout (tested with
# commit 567632d); it is built in place first if it holds no built module (about 100 s with 16 jobs, against
# the pip NVSHMEM; never commit the build).
#   usage: bash scripts/compare_deepep.sh DEEPEP_DIR [ranks=8] [sms="8 16 24"] [runs=2]
#   TOKENS (4096; several allowed), BENCH_ARGS (more bench options); logs in $OUT (or .gpu_out); the ratios are
#   printed last; exits 1 if any bench run failed.
set -uo pipefail
DEEPEP=$(cd "${1:?usage: bash scripts/compare_deepep.sh DEEPEP_DIR [ranks] [sms] [runs]}" && pwd) || exit 2
RANKS=${2:-8}
SMS=${3:-"8 16 24"}
RUNS=${4:-2}
cd "$(dirname "${BASH_SOURCE[0]}")/.."   # gpu_env.sh takes PYTHONPATH, OUT and the JIT cache from here
source scripts/gpu_env.sh

build_deepep "$DEEPEP" || exit 1

export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started" || echo "WARNING: MPS did not start: the ranks time-slice the GPU"
trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null || true; rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"' EXIT
fail=0

for run in $(seq "$RUNS"); do
    for sms in $SMS; do
        log="$OUT/compare_${sms}sms_run$run.log"
        echo "=== run $run, $sms SMs per rank"
        PYTHONPATH=$PYTHONPATH:$DEEPEP timeout -k 10 "${STEP_TIMEOUT:-300}" $PY -m deepep_portable bench --no-progress \
            --ranks "$RANKS" --num-sms "$sms" --mode normal --tokens ${TOKENS:-4096} --compare deep_ep \
            ${BENCH_ARGS:-} >"$log" 2>&1 || { echo "run $run at $sms SMs: exit code $? (log: $log)"; fail=1; }
        tail -16 "$log"
    done
done

echo
echo "=== DeepEP time / ours (> 1: deepep_portable is faster), $RANKS ranks, ${TOKENS:-4096} tokens"
for run in $(seq "$RUNS"); do
    for sms in $SMS; do
        grep -aE ' us = [0-9.]+$' "$OUT/compare_${sms}sms_run$run.log" | sed "s/^/run $run, $sms SMs: /"
    done
done
exit $fail
