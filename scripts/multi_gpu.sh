#!/usr/bin/env bash
# Issue 5: validation and benchmarks with ONE RANK PER GPU on a several-GPU host.
#   bash scripts/multi_gpu.sh            # uses every visible GPU (EP 2, 4, 8 up to that count)
# Prints the topology, the peer-to-peer copy ceiling, runs the GPU test suite at each EP size and
# the benchmarks (normal: 4096 and 16384 tokens; low-latency: 128 tokens) with the ideal-copy
# ceiling and all_to_all_single over NCCL as the baseline. Logs under $OUT (or .gpu_out).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
echo "=== $GPUS GPUs"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"
$PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
$PY scripts/p2p_bandwidth.py 2>&1 | tee "$OUT/p2p.txt"
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x PYTHONPATH -x CUDA_HOME -x DEEPEP_PORTABLE_CACHE_DIR
        -x NCCL_NVLS_ENABLE -x NVSHMEM_DISABLE_NVLS -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x PYTHONUNBUFFERED
        -x DEEPEP_TEST_LL_TRANSPORT"
export DEEPEP_TEST_LL_TRANSPORT=nvlink
for n in 2 4 8; do
    [ "$n" -le "$GPUS" ] || continue
    echo "=== EP $n: tests (one rank per GPU)"
    $MPIRUN -n "$n" $PY -m pytest -q -p no:cacheprovider --with-mpi tests/mpi 2>&1 | tee "$OUT/tests_ep$n.log" | grep -a -E "passed|failed" | tail -1
    echo "=== EP $n: low-latency tests over NVSHMEM (peer load/store between GPUs)"
    DEEPEP_TEST_LL_TRANSPORT=nvshmem $MPIRUN -n "$n" $PY -m pytest -q -p no:cacheprovider --with-mpi \
        tests/mpi/test_low_latency_gpu_mpi.py 2>&1 | tee "$OUT/tests_ll_nvshmem_ep$n.log" | grep -a -E "passed|failed" | tail -1
    echo "=== EP $n: benchmarks"
    $PY -m deepep_portable bench --no-progress --ranks "$n" --baseline --mode normal --tokens 4096 16384 2>&1 | tee "$OUT/bench_normal_ep$n.log" | tail -12
    for t in nvlink nvshmem; do
        $PY -m deepep_portable bench --no-progress --ranks "$n" --transport $t --mode low_latency --tokens 128 2>&1 |
            tee "$OUT/bench_ll_${t}_ep$n.log" | tail -5
    done
done
