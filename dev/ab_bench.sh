#!/usr/bin/env bash
# Same-run A/B of `python -m deepep_portable bench` between two source trees (e.g. a refactor against
# the commit before it), on one GPU machine, ranks sharing the GPU(s) under MPS:
#   bash dev/ab_bench.sh TREE_A TREE_B [ranks=8] [rounds=2]
# Builds _C in place in each tree, then for each round runs every bench of BENCHES in tree A, then in
# tree B (A B A B ...: drift of the machine hits both alike), each with its own JIT cache, and prints
# every table, then one line per (bench, op): the op's time in each run of A and of B and B/A of the
# medians. A tree is a checkout of this project (`git archive <commit> | tar -x -C dir` will do).
# BENCHES: ';'-separated bench argument lists (default: FP8 and BF16 normal mode at 4096 tokens, LL
# at 128 tokens over nvlink and nvshmem). Logs in $OUT (or .gpu_out). AB_PYTHONPATH: extra import paths for
# both trees' runs (e.g. a DeepEP build, with BENCHES="--mode normal --tokens 4096 --compare deep_ep").
# AB_ENV_A / AB_ENV_B: space-separated VAR=value for A's / B's runs only: one tree against itself with a switch,
#   e.g. AB_ENV_B=DEEPEP_PORTABLE_LL_VMM=0 BENCHES="--mode low_latency --tokens 128" bash dev/ab_bench.sh . . 8 2
set -uo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd)
RANKS=${3:-8}; ROUNDS=${4:-2}
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/gpu_env.sh"
BENCHES=${BENCHES:-"--mode normal --num-sms 16 --tokens 4096;--mode normal --num-sms 16 --tokens 4096 --no-fp8;--mode low_latency --transport nvlink --tokens 128;--mode low_latency --transport nvshmem --tokens 128"}

for t in $(printf '%s\n' "$A" "$B" | sort -u); do
    (cd "$t" && $PY setup.py build_ext --inplace >"$OUT/build_$(basename "$t").log" 2>&1) \
        || { echo "build failed in $t"; tail -20 "$OUT/build_$(basename "$t").log"; exit 1; }
done
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
IFS=';' read -ra LIST <<<"$BENCHES"
for round in $(seq 1 "$ROUNDS"); do
    for i in "${!LIST[@]}"; do
        for side in A B; do
            tree=$A; envs=${AB_ENV_A:-}; [ $side = B ] && tree=$B envs=${AB_ENV_B:-}
            log="$OUT/ab_${side}_${i}_${round}.log"
            echo "=== round $round, bench $i (${LIST[$i]}), tree $side${envs:+ ($envs)}"
            # shellcheck disable=SC2086
            (cd "$tree" && env $envs PYTHONPATH="$tree${AB_PYTHONPATH:+:$AB_PYTHONPATH}" DEEPEP_PORTABLE_CACHE_DIR="$tree/.jit_cache" \
                timeout -k 10 "${STEP_TIMEOUT:-300}" $PY -m deepep_portable bench --no-progress --ranks "$RANKS" \
                ${LIST[$i]}) >"$log" 2>&1
            grep -a -A12 "ranks on" "$log" | grep -a -v "^$" || tail -5 "$log"
        done
    done
done
echo quit | nvidia-cuda-mps-control 2>/dev/null || true
echo; echo "=== A/B (time_us per run; B/A of the medians): A=$A B=$B"
$PY - "$OUT" "${#LIST[@]}" "$ROUNDS" <<'PY'
import re, statistics, sys
out, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    times = {}
    for side in "AB":
        for r in range(1, rounds + 1):
            try:
                text = open(f"{out}/ab_{side}_{i}_{r}.log", errors="replace").read()
            except OSError:
                continue
            for line in text.splitlines():
                cells = line.split()
                if len(cells) >= 12 and re.fullmatch(r"[\d.]+", cells[6] or "") and not cells[0].startswith("a2a"):
                    key = (cells[0], cells[1], cells[5], cells[11])   # op, tokens, precision, transport / library
                    times.setdefault(key, {"A": [], "B": []})[side].append(float(cells[6]))
    for (op, tokens, prec, lib), t in times.items():
        if t["A"] and t["B"]:
            ratio = statistics.median(t["B"]) / statistics.median(t["A"])
            print(f"bench {i} {op:18s} {tokens:>6s} {prec:5s} {lib:9s} A {t['A']}  B {t['B']}  B/A {ratio:.3f}")
PY
