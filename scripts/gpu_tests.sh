#!/usr/bin/env bash
# GPU test suite + benchmarks, for a machine with CUDA GPUs (the lent H200 or a real node).
# Builds _C in place, runs the single-process GPU tests, then N ranks that share the GPU(s) under
# MPS (no thread-percentage cap: each kernel's grid is the SM budget), then the benchmarks.
# Logs go to $OUT (or .gpu_out); a summary table is printed last.
#   usage: bash scripts/gpu_tests.sh [ranks=4] [steps="build doctor single mpi bench"]
#   other steps: precompile (every kernel family for sm_90, all cores), mpi2 (the MPI suite at 2 ranks), ll (the low-latency GPU tests at N ranks),
#   llnvshmem (the low-latency GPU tests over the nvshmem transport at N PEs), lllegacy (the same over
#   nvlink with a legacy CUDA IPC window: DEEPEP_PORTABLE_LL_VMM=0, the pack-on-receive dispatch), intranodelegacy (the
#   intranode GPU tests over a legacy CUDA IPC buffer: DEEPEP_PORTABLE_INTRANODE_VMM=0),
#   llncclgin2 (the conformance kernel, the low-latency and the normal-mode GPU tests over nccl_gin at 2 ranks sharing the GPU: NCCL_HOME
#   = an NCCL >= 2.30, brought in parts with dev/carry_in_parts.sh), selftest (the transport contract's conformance kernel over every backend, ibgda over the tests' NIC model
#   too, N ranks), llibgda / internodeibgda (those suites over ibgda and the NIC model), llncclgin (the same at one rank; NCCLGIN_TESTS picks files), llginmock (the low-latency GPU tests over
#   nccl_gin's GIN paths on the tests' mock of NCCL's device API, N ranks sharing the GPU), internodeginmock (the
#   internode suite the same way), internode (the
#   internode kernels over logical nodes of N ranks, nvshmem), benchinternode (bench
#   --mode internode, RANKS_PER_NODE=N/2 by default), soak (python -m deepep_portable soak: normal and LL,
#   eager and graph, SOAK_ROUNDS=100000 per case; SOAK_ARGS for more), fuzz (the seeded fuzz
#   over FUZZ_TRANSPORT=nvlink, FUZZ_CASES=200 per mode), profile (bench normal with DEEPEP_PORTABLE_PROFILE=1),
#   mpitests (MPI_TESTS="FILE [-k EXPR]" at N ranks), failures (one rank's failure over nvlink and nvshmem, two Buffers
#   at once, 1000 Buffers, the failure fuzz), buffers (two Buffers at once and many Buffers at N ranks, with -s, the
#   combine's eager path on then off, DEEPEP_PORTABLE_TIMEOUT_S=15 by default: a deadlock of two Buffers' kernels shows
#   as a named timeout within seconds), benchll (bench --mode low_latency), hostcosts (dev/host_costs.py: host cost of the steps before
#   an op's first kernel, N processes under MPS), cache (tar the JIT cache into $OUT, in parts jit_cache.tgz.NN),
#   verify (python -m deepep_portable verify --launcher local at N ranks, report $OUT/verify.md; VERIFY_ARGS for more), sweepv2 (bench --api v2 over 4-32 SMs,
#   beside DeepEP V1's best over 8, 16 and 24 SMs when DEEPEP_DIR names a DeepEP checkout, built first if it is not).
#   NUM_SMS=16 (normal mode), LL_NUM_SMS (low-latency mode; default: Buffer's); BENCH_REFERENCE=0 skips the (slow) reference-transport benchmark; every step is killed after STEP_TIMEOUT seconds (default 420);
#   BENCH_ARGS: extra arguments for every bench step (e.g. "--start-line host").
#   backends: every backend's GPU steps as the registry lists them (its rows' gpu_steps: python -W ignore::RuntimeWarning
#   -m deepep_portable.transports.registry --steps gpu), expanded in place before the steps run.
set -uo pipefail
RANKS=${1:-4}
STEPS=${2:-"build doctor single mpi bench"}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
if [[ " $STEPS " == *" backends "* ]]; then   # the backends' own GPU steps, from the registry's rows
    BACKEND_STEPS=$($PY -W ignore::RuntimeWarning -m deepep_portable.transports.registry --steps gpu | tr '\n' ' ')
    STEPS=$(for s in $STEPS; do [[ $s == backends ]] && echo "$BACKEND_STEPS" || echo "$s"; done | tr '\n' ' ')
fi
export DEEPEP_TEST_LL_TRANSPORT=${DEEPEP_TEST_LL_TRANSPORT:-nvlink}

declare -a SUMMARY
step() {   # step NAME CMD... : run, log to $OUT/NAME.log, remember the outcome
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout -k 10 "${STEP_TIMEOUT:-420}" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    SUMMARY+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -a -E 'passed|failed|error' "$OUT/$name.log" | tail -1 | cut -c1-80)")")
    return 0
}

start_mps() {
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    nvidia-cuda-mps-control -d && echo "MPS started"
}
stop_mps() { echo quit | nvidia-cuda-mps-control 2>/dev/null || true; }

MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x PYTHONPATH -x CUDA_HOME -x DEEPEP_PORTABLE_CACHE_DIR
        -x NCCL_NVLS_ENABLE -x NVSHMEM_DISABLE_NVLS -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x PYTHONUNBUFFERED
        -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x DEEPEP_TEST_DEVICE=cuda -x DEEPEP_TEST_LL_TRANSPORT"

# What the nccl_gin steps run (NCCLGIN_TESTS: a subset): the conformance kernel, the low-latency suite, and the
# normal-mode suite through a nccl_gin Buffer (its ops are the intranode kernels over CUDA IPC whatever the backend)
NCCLGIN_ALL="tests/mpi/test_transport_selftest_gpu_mpi.py tests/mpi/test_low_latency_gpu_mpi.py tests/mpi/test_intranode_gpu_mpi.py"

for s in $STEPS; do
    case $s in
    build)  step build $PY setup.py build_ext --inplace ;;
    precompile) step precompile $PY -m deepep_portable precompile --arch sm_90 --nvshmem ;;
    doctor) step doctor $PY -m deepep_portable doctor ;;
    single) step single $PY -m pytest -q -p no:cacheprovider tests/test_jit.py tests/test_validation.py tests/gpu ;;
    mpi)    start_mps; step mpi $MPIRUN -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi; stop_mps ;;
    mpi2)   start_mps; step mpi2 $MPIRUN -n 2 $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi; stop_mps ;;
    ll)     start_mps; step ll $MPIRUN -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_low_latency_gpu_mpi.py; stop_mps ;;
    intranodelegacy) start_mps; DEEPEP_PORTABLE_INTRANODE_VMM=0 step intranodelegacy $MPIRUN -x DEEPEP_PORTABLE_INTRANODE_VMM \
                -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_intranode_gpu_mpi.py; stop_mps ;;
    lllegacy) start_mps; DEEPEP_PORTABLE_LL_VMM=0 step lllegacy $MPIRUN -x DEEPEP_PORTABLE_LL_VMM -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_low_latency_gpu_mpi.py; stop_mps ;;
    llnvshmem) start_mps; DEEPEP_TEST_LL_TRANSPORT=nvshmem step llnvshmem $MPIRUN -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_low_latency_gpu_mpi.py; stop_mps ;;
    internode) start_mps   # the internode kernels over logical nodes (nvshmem), every node shape of N ranks
            step internode $MPIRUN -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_internode_gpu_mpi.py
            stop_mps ;;
    benchinternode) start_mps   # the internode headline: FP8 dispatch / BF16 combine over logical nodes (nvshmem)
            step bench_internode $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --transport nvshmem --mode internode --ranks-per-node "${RANKS_PER_NODE:-$((RANKS / 2))}" --num-sms "${NUM_SMS:-16}" --tokens 4096 ${BENCH_ARGS:-}
            stop_mps ;;
    soak)   start_mps   # SOAK_ROUNDS (100000) rounds per case, checked every 1000, memory / fds / time flat
            step soak $PY -m deepep_portable soak --ranks "$RANKS" --transport "${SOAK_TRANSPORT:-nvlink}" --rounds "${SOAK_ROUNDS:-100000}" ${SOAK_ARGS:-}
            stop_mps ;;
    llncclgin) DEEPEP_TEST_LL_TRANSPORT=nccl_gin DEEPEP_TEST_NORMAL_TRANSPORT=nccl_gin step llncclgin $MPIRUN \
                -x DEEPEP_TEST_NORMAL_TRANSPORT -n 1 $PY -m pytest -q -rs -p no:cacheprovider --with-mpi \
                ${NCCLGIN_TESTS:-$NCCLGIN_ALL} ;;   # one rank: NCCL refuses ranks sharing a GPU before 2.30
    llncclgin2) # 2 ranks sharing the GPU over a real NCCL >= 2.30 (NCCL_HOME: its lib/ and include/),
            # NCCL_MULTI_RANK_GPU_ENABLE=1; the ranks preload that libnccl, so torch binds to it too (a dependency
            # named libnccl.so.2 binds to the first library of that soname in the process: ours and torch's must be one)
            if [ -z "${NCCL_HOME:-}" ]; then echo "llncclgin2: set NCCL_HOME to an NCCL >= 2.30"; continue; fi
            start_mps
            NCCL_MULTI_RANK_GPU_ENABLE=1 DEEPEP_TEST_LL_TRANSPORT=nccl_gin DEEPEP_TEST_NORMAL_TRANSPORT=nccl_gin \
                step llncclgin2 $MPIRUN -x NCCL_HOME -x NCCL_MULTI_RANK_GPU_ENABLE -x DEEPEP_TEST_NORMAL_TRANSPORT \
                -x LD_PRELOAD="$NCCL_HOME/lib/libnccl.so.2" -n 2 \
                $PY -m pytest -q -rs -p no:cacheprovider --with-mpi ${NCCLGIN_TESTS:-$NCCLGIN_ALL}
            stop_mps ;;
    llginmock) start_mps   # the low-latency GPU tests over nccl_gin's device code on the tests' mock of NCCL (GIN paths)
            DEEPEP_TEST_NCCL_GIN_MOCK=1 DEEPEP_TEST_LL_TRANSPORT=nccl_gin step llginmock $MPIRUN -x DEEPEP_TEST_NCCL_GIN_MOCK \
                -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_low_latency_gpu_mpi.py
            stop_mps ;;
    internodeginmock) start_mps   # the internode kernels over nccl_gin on the tests' mock of NCCL (GIN between nodes)
            DEEPEP_TEST_NCCL_GIN_MOCK=1 DEEPEP_TEST_INTERNODE_TRANSPORT=nccl_gin step internodeginmock $MPIRUN \
                -x DEEPEP_TEST_NCCL_GIN_MOCK -x DEEPEP_TEST_INTERNODE_TRANSPORT -n "$RANKS" $PY -m pytest -q \
                -p no:cacheprovider --with-mpi tests/mpi/test_internode_gpu_mpi.py
            stop_mps ;;
    selftest) start_mps; step selftest $MPIRUN -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_transport_selftest_gpu_mpi.py; stop_mps ;;
    llibgda|internodeibgda) start_mps   # the ibgda backend's device code against the tests' NIC model
            file=tests/mpi/test_low_latency_gpu_mpi.py; [ "$s" = internodeibgda ] && file=tests/mpi/test_internode_gpu_mpi.py
            DEEPEP_TEST_IBGDA_MODEL=1 DEEPEP_TEST_LL_TRANSPORT=ibgda DEEPEP_TEST_INTERNODE_TRANSPORT=ibgda step "$s" $MPIRUN \
                -x DEEPEP_TEST_IBGDA_MODEL -x DEEPEP_TEST_INTERNODE_TRANSPORT -n "$RANKS" $PY -m pytest -q -p no:cacheprovider \
                --with-mpi "$file"
            stop_mps ;;
    fuzz)   start_mps   # the seeded fuzz (tests/mpi/test_fuzz_mpi.py) over FUZZ_TRANSPORT (default nvlink), FUZZ_CASES per mode
            DEEPEP_FUZZ_TRANSPORT=${FUZZ_TRANSPORT:-nvlink} DEEPEP_FUZZ_CASES=${FUZZ_CASES:-200} step fuzz $MPIRUN \
                -x DEEPEP_FUZZ_TRANSPORT -x DEEPEP_FUZZ_CASES ${DEEPEP_FUZZ_SEED:+-x DEEPEP_FUZZ_SEED} ${DEEPEP_FUZZ_PALETTE:+-x DEEPEP_FUZZ_PALETTE} -n "$RANKS" \
                $PY -m pytest -q -s -p no:cacheprovider --with-mpi tests/mpi/test_fuzz_mpi.py   # -s: seeds, counts, times
            stop_mps ;;
    profile) start_mps
            DEEPEP_PORTABLE_PROFILE=1 step profile $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --num-sms "${NUM_SMS:-16}" --mode normal --tokens 4096 16384 ${BENCH_ARGS:-}
            stop_mps ;;
    benchll) start_mps
            step bench_ll $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --transport nvlink --mode low_latency --tokens 128 ${LL_NUM_SMS:+--num-sms $LL_NUM_SMS} ${BENCH_ARGS:-}
            step bench_ll_nvshmem $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --transport nvshmem --mode low_latency --tokens 128 ${LL_NUM_SMS:+--num-sms $LL_NUM_SMS} ${BENCH_ARGS:-}
            stop_mps ;;
    mpitests) start_mps   # any MPI tests at N ranks: MPI_TESTS="FILE [-k EXPR]"
            step mpitests $MPIRUN ${DEEPEP_TEST_MANY_BUFFERS:+-x DEEPEP_TEST_MANY_BUFFERS} -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi ${MPI_TESTS:?set MPI_TESTS}
            stop_mps ;;
    buffers) start_mps
            for eager in 1 0; do
                DEEPEP_PORTABLE_EAGER_COMBINE=$eager DEEPEP_PORTABLE_TIMEOUT_S=${DEEPEP_PORTABLE_TIMEOUT_S:-15} \
                    step "buffers_eager$eager" $MPIRUN -x DEEPEP_PORTABLE_EAGER_COMBINE -x DEEPEP_PORTABLE_TIMEOUT_S \
                    -n "$RANKS" $PY -m pytest -q -s -p no:cacheprovider --with-mpi tests/mpi/test_two_buffers_mpi.py \
                    tests/mpi/test_many_buffers_gpu_mpi.py
            done
            stop_mps ;;
    failures) start_mps   # one rank's failure reaches every rank (tests/mpi/test_failures_mpi.py) over FAILURE_TRANSPORTS
            # (nvlink nvshmem), two Buffers at once, many Buffers (DEEPEP_TEST_MANY_BUFFERS, default 1000), the failure
            # fuzz (FUZZ_FAILURE_CASES, default 200, over nvlink); FAILURE_PARTS picks among "tests buffers fuzz"
            parts=" ${FAILURE_PARTS:-tests buffers fuzz} "
            export DEEPEP_TEST_FAILURE_TIMEOUT_S=${DEEPEP_TEST_FAILURE_TIMEOUT_S:-3} DEEPEP_FUZZ_FAILURE_TIMEOUT_S=${DEEPEP_FUZZ_FAILURE_TIMEOUT_S:-1.5}
            if [[ $parts == *" tests "* ]]; then
                for t in ${FAILURE_TRANSPORTS:-nvlink nvshmem}; do
                    DEEPEP_TEST_TRANSPORT=$t step "failures_$t" $MPIRUN -x DEEPEP_TEST_TRANSPORT -x DEEPEP_TEST_FAILURE_TIMEOUT_S \
                        ${DEEPEP_TEST_FAILURE_SIZE:+-x DEEPEP_TEST_FAILURE_SIZE} \
                        -n "$RANKS" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_failures_mpi.py
                done
            fi
            if [[ $parts == *" buffers "* ]]; then
                DEEPEP_TEST_MANY_BUFFERS=${DEEPEP_TEST_MANY_BUFFERS:-1000} step buffers $MPIRUN -x DEEPEP_TEST_MANY_BUFFERS \
                    -n "$RANKS" $PY -m pytest -q -s -p no:cacheprovider --with-mpi tests/mpi/test_two_buffers_mpi.py \
                    tests/mpi/test_many_buffers_gpu_mpi.py
            fi
            if [[ $parts == *" fuzz "* ]]; then
                DEEPEP_FUZZ_TRANSPORT=${FUZZ_TRANSPORT:-nvlink} DEEPEP_FUZZ_FAILURE_CASES=${FUZZ_FAILURE_CASES:-200} \
                    step fuzz_failures $MPIRUN -x DEEPEP_FUZZ_TRANSPORT -x DEEPEP_FUZZ_FAILURE_CASES \
                    -x DEEPEP_FUZZ_FAILURE_TIMEOUT_S ${DEEPEP_FUZZ_SEED:+-x DEEPEP_FUZZ_SEED} -n "$RANKS" $PY -m pytest -q -s \
                    -p no:cacheprovider --with-mpi tests/mpi/test_fuzz_mpi.py -k test_fuzz_failures
            fi
            stop_mps ;;
    hostcosts) start_mps; step hostcosts $PY dev/host_costs.py --procs "$RANKS"; stop_mps ;;
    cache)  # in parts of 15 MiB (files back from the lent machine are at most 16 MiB each)
            tar czf - -C "$DEEPEP_PORTABLE_CACHE_DIR" . | split -b 15m -d - "$OUT/jit_cache.tgz." ;;
    sweepv2) # ElasticBuffer's SM sweep (FP8 dispatch / BF16 combine, 4096 tokens) with the model's picks, and DeepEP V1's
            # best over 8, 16 and 24 SMs beside it when DEEPEP_DIR names a DeepEP checkout (built here first if need be)
            if [ -n "${DEEPEP_DIR:-}" ]; then DEEPEP_DIR=$(cd "$DEEPEP_DIR" && pwd) && build_deepep "$DEEPEP_DIR" || DEEPEP_DIR=; fi
            start_mps
            step sweep_v2 env PYTHONPATH="$PYTHONPATH${DEEPEP_DIR:+:$DEEPEP_DIR}" $PY -m deepep_portable bench --no-progress \
                --api v2 --ranks "$RANKS" --tokens 4096 --num-sms 4 6 8 16 24 32 ${DEEPEP_DIR:+--compare deep_ep} ${BENCH_ARGS:-}
            stop_mps ;;
    bench)  start_mps
            step bench_normal $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --num-sms "${NUM_SMS:-16}" --mode normal --tokens 512 4096 16384 ${BENCH_ARGS:-}
            step bench_normal_bf16 $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --num-sms "${NUM_SMS:-16}" --mode normal --no-fp8 --tokens 4096 ${BENCH_ARGS:-}
            [ "${BENCH_REFERENCE:-1}" = 1 ] && step bench_reference $PY -m deepep_portable bench --no-progress --ranks "$RANKS" --transport reference --mode normal --tokens 4096 --warmup 1 --iters 3
            stop_mps ;;
    verify) # python -m deepep_portable verify on this machine at N ranks (it starts MPS around its own steps);
            # VERIFY_ARGS adds options ("--ranks-per-node 4 --suite quick --stand-ins --time-limit 380")
            step verify $PY -m deepep_portable verify --launcher local --ranks "$RANKS" --report "$OUT/verify.md" \
                --json "$OUT/verify.json" ${VERIFY_ARGS:-} ;;
    *) echo "unknown step $s" ;;
    esac
done
echo; echo "=== summary ($RANKS ranks; logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
