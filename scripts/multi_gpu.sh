#!/usr/bin/env bash
# Validation and benchmarks with ONE RANK PER GPU on a several-GPU host.
#   bash scripts/multi_gpu.sh [EP sizes, default "2 4 8" up to the GPU count]
# Prints the topology and the peer-to-peer copy ceiling, then at each EP size runs the GPU test
# suite (one rank per GPU), the low-latency tests over NVSHMEM, and the benchmarks (normal: 4096 and
# 16384 tokens; low-latency: 128 tokens) with, in the same run, the op's ceiling (its traffic pattern
# copied straight into the peers' memory, see tools/ceilings.py) and all_to_all_single over NCCL as the
# baseline. MIXED=1 then runs the suite with two ranks per GPU under MPS (peers on the same GPU and
# across the link in one group). DEEPEP=DIR (a DeepEP V1 checkout, built in place first if it holds no
# build, as scripts/compare_deepep.sh does) adds the side by side with DeepEP at each EP size: `bench --compare
# deep_ep --baseline` (ours, DeepEP and all_to_all_single in the same processes) at COMPARE_SMS SMs per rank
# (default "8 16 24"), and the low-latency ops beside DeepEP's (nvlink, 128 tokens). Every step is killed
# after STEP_TIMEOUT seconds (default 400). Logs under $OUT.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
SIZES=${1:-"2 4 8"}
echo "=== $GPUS GPUs"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"

declare -a SUMMARY
step() {   # step NAME CMD... : run with a timeout, log to $OUT/NAME.log, keep the last result line
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name"
    timeout -k 10 "${STEP_TIMEOUT:-400}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    SUMMARY+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -a -E 'passed|failed|rror' "$OUT/$name.log" | tail -1 | cut -c1-90)")")
    return $rc
}

step build $PY setup.py build_ext --inplace || { tail -20 "$OUT/build.log"; exit 1; }
if [ -n "${DEEPEP:-}" ]; then
    DEEPEP=$(cd "$DEEPEP" && pwd) && build_deepep "$DEEPEP" || { echo "no side by side"; DEEPEP=; }
fi
step precompile $PY -m deepep_portable precompile --arch sm_90 --nvshmem
step p2p $PY scripts/p2p_bandwidth.py
cat "$OUT/p2p.log"
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x PYTHONPATH -x CUDA_HOME -x DEEPEP_PORTABLE_CACHE_DIR
        -x NCCL_NVLS_ENABLE -x NVSHMEM_DISABLE_NVLS -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x PYTHONUNBUFFERED
        -x DEEPEP_TEST_LL_TRANSPORT"
export DEEPEP_TEST_LL_TRANSPORT=nvlink
for n in $SIZES; do
    [ "$n" -le "$GPUS" ] || { echo "=== EP $n skipped: $GPUS GPUs"; continue; }
    step "tests_ep$n" $MPIRUN -n "$n" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
    DEEPEP_TEST_LL_TRANSPORT=nvshmem step "ll_nvshmem_ep$n" $MPIRUN -n "$n" $PY -m pytest -q -p no:cacheprovider \
        --with-mpi tests/mpi/test_low_latency_gpu_mpi.py
    step "bench_normal_ep$n" $PY -m deepep_portable bench --no-progress --ranks "$n" --baseline --mode normal \
        --tokens 4096 16384
    for sms in ${COMPARE_SMS:-8 16 24}; do
        [ -n "${DEEPEP:-}" ] || break
        PYTHONPATH=$PYTHONPATH:$DEEPEP step "bench_compare_ep${n}_${sms}sms" $PY -m deepep_portable bench --no-progress \
            --ranks "$n" --num-sms "$sms" --baseline --mode normal --tokens 4096 --compare deep_ep
    done
    for t in nvlink nvshmem; do
        step "bench_ll_${t}_ep$n" $PY -m deepep_portable bench --no-progress --ranks "$n" --baseline \
            --transport $t --mode low_latency --tokens 128
    done
    # DeepEP's LL beside ours over nvlink (not nvshmem: two NVSHMEM users in one process)
    [ -n "${DEEPEP:-}" ] && PYTHONPATH=$PYTHONPATH:$DEEPEP step "bench_compare_ll_ep$n" $PY -m deepep_portable bench \
        --no-progress --ranks "$n" --transport nvlink --mode low_latency --tokens 128 --compare deep_ep
done
if [ "${MIXED:-0}" = 1 ] && [ "$GPUS" -ge 2 ]; then
    # Two ranks per GPU under MPS: peers on the same GPU and peers across the link in one group.
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    if nvidia-cuda-mps-control -d; then
        step "tests_mixed_$((2 * GPUS))ranks" $MPIRUN -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
            -n $((2 * GPUS)) $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
        echo quit | nvidia-cuda-mps-control
    else
        SUMMARY+=("tests_mixed            not run: the MPS daemon did not start")
    fi
fi
echo; echo "=== benchmark tables"
for f in "$OUT"/bench_*.log; do
    [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -a -A12 "ranks on" "$f" | grep -a -v "^$"; }
done
if [ -n "${DEEPEP:-}" ]; then
    echo; echo "=== DeepEP time / ours (> 1: deepep_portable is faster), one rank per GPU"
    for f in "$OUT"/bench_compare_*.log; do
        [ -f "$f" ] && grep -aE ' us = [0-9.]+$' "$f" | sed "s/^/$(basename "$f" .log): /"
    done
fi
echo; echo "=== summary ($GPUS GPUs; one rank per GPU unless the step says mixed; logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
