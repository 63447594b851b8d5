#!/usr/bin/env bash
# Run DeepEP V1's own test files against deepep_portable (the drop-in promise), on one GPU machine with
# every rank sharing the GPU under MPS. Nothing is fetched: give it a DeepEP V1 checkout (tested with
# commit 567632d; tests/test_intranode.py, test_low_latency.py, test_internode.py and utils.py are used).
#   usage: bash scripts/deepep_tests.sh DEEPEP_DIR [ranks=8] [runs="intranode ll ll-shrink ll-logfmt"]
#   run "internode": test_internode.py over INTERNODE_NODES (2) logical nodes of INTERNODE_PER_NODE (8) ranks,
#   launched once per node as on separate hosts, at its own sizes (num_rdma_bytes 1e9, num_nvl_bytes 2e9:
#   16 ranks on one GPU outgrow an H100's 80 GB, 5.1 GB per rank when it ran out: use an H200).
#   The file asserts 8 ranks per node (DeepEP's NVLink domain is 8 GPUs); with INTERNODE_PER_NODE other than 8
#   that assert, and only it, is relaxed in the copy, so shapes such as 4 x 4 run its cases unchanged.
# The only change is the launch (tests/utils.py): a gloo group instead of NCCL (NCCL refuses two ranks on
# one GPU), every rank on device 0, and dist.all_gather_into_tensor handed gloo's output shape. `import deep_ep` finds a one-line package that re-exports
# deepep_portable. The shrink run sets DEEPEP_PORTABLE_TIMEOUT_S (default here 10 s; DeepEP's own
# timeout is 100 s, or 10 s in its fast-debug build): each simulated failure costs one timeout.
# Logs go to $OUT (or .gpu_out); a summary is printed last.
set -uo pipefail
DEEPEP=$(cd "$1" && pwd)
RANKS=${2:-8}
RUNS=${3:-"intranode ll ll-shrink ll-logfmt"}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

WORK=$(mktemp -d)
for f in test_intranode.py test_low_latency.py test_internode.py utils.py; do
    [ -f "$DEEPEP/tests/$f" ] || { echo "no $DEEPEP/tests/$f"; exit 2; }
    cp "$DEEPEP/tests/$f" "$WORK/"
done
# The launch change, and nothing else (each edit must apply exactly once).
$PY - "$WORK/utils.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
edits = [("'backend': 'nccl'", "'backend': 'gloo'"),
         ("if 'device_id' in sig.parameters:", "if False:  # every rank shares device 0 (deepep_portable launch)"),
         ("torch.cuda.set_device(local_rank)", "torch.cuda.set_device(0)")]
for old, new in edits:
    if text.count(old) != 1:
        sys.exit(f"{path}: expected one '{old}'")
    text = text.replace(old, new)
# gloo's all_gather_into_tensor takes the output as the inputs concatenated along dim 0 ([R*N, ...]);
# NCCL also takes them stacked ([R, N, ...]), which the tests pass: give gloo the same memory, flattened.
text += """

_all_gather_into_tensor = dist.all_gather_into_tensor


def _gloo_all_gather_into_tensor(output, input, group=None, async_op=False):
    if output.dim() == input.dim() + 1:
        output = output.view(-1, *input.shape[1:])
    return _all_gather_into_tensor(output, input, group=group, async_op=async_op)


dist.all_gather_into_tensor = _gloo_all_gather_into_tensor
"""
open(path, "w").write(text)
PY
# DEEPEP_REAL=1: the same tests, same launch, against DeepEP itself (built in DEEPEP_DIR), for a same-run
# comparison of what they print (e.g. the layout time); otherwise deep_ep is deepep_portable.
if [ "${DEEPEP_REAL:-0}" = 1 ]; then
    MODULE_PATH=$DEEPEP
else
    mkdir -p "$WORK/deep_ep"
    echo "from deepep_portable import *  # noqa: F401,F403  (the drop-in: DeepEP's tests import deep_ep)" \
        > "$WORK/deep_ep/__init__.py"
    MODULE_PATH=$ROOT
fi

export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
declare -a SUMMARY
summarize() {   # summarize NAME RC T0 LOG: the log's last lines, and the run's line in the summary
    tail -4 "$4"
    SUMMARY+=("$(printf '%-14s rc=%-3s %4ss  %s' "$1" "$2" "$((SECONDS - $3))" "$(grep -a -c -E 'Error|Traceback' "$4") error lines")")
}
run() {   # run NAME ARGS...: one DeepEP test file
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name: $*"
    (cd "$WORK" && PYTHONPATH="$WORK:$MODULE_PATH" timeout -k 10 "${STEP_TIMEOUT:-500}" $PY "$@") \
        >"$OUT/deepep_${DEEPEP_REAL:+real_}$name.log" 2>&1
    local rc=$?
    local log="$OUT/deepep_${DEEPEP_REAL:+real_}$name.log"
    summarize "$name" "$rc" "$t0" "$log"
}
run_nodes() {   # run_nodes NAME NODES PER_NODE FILE ARGS...: one DeepEP test file launched once per logical node
    local name=$1 nodes=$2 per_node=$3; shift 3
    local t0=$SECONDS log="$OUT/deepep_${DEEPEP_REAL:+real_}$name.log" rc=0 pids=()
    echo "=== $name: $nodes nodes x $per_node: $*"
    for ((n = 0; n < nodes; n++)); do
        (cd "$WORK" && WORLD_SIZE=$nodes RANK=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-8361} \
            DEEPEP_PORTABLE_RANKS_PER_NODE=$per_node PYTHONPATH="$WORK:$MODULE_PATH" timeout -k 10 "${STEP_TIMEOUT:-500}" $PY "$@") \
            >"${log%.log}.node$n" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    cat "${log%.log}".node* >"$log" && rm -f "${log%.log}".node*
    summarize "$name" "$rc" "$t0" "$log"
}
for r in $RUNS; do
    case $r in
    intranode) run intranode test_intranode.py --num-processes "$RANKS" ;;
    ll)        run ll test_low_latency.py --num-processes "$RANKS" ;;
    ll-shrink) DEEPEP_PORTABLE_TIMEOUT_S=${SHRINK_TIMEOUT_S:-10} run ll-shrink test_low_latency.py --num-processes "$RANKS" --shrink-test ;;
    ll-logfmt) run ll-logfmt test_low_latency.py --num-processes "$RANKS" --use-logfmt ;;
    internode) per_node=${INTERNODE_PER_NODE:-8} file=test_internode.py
               if [ "$per_node" != 8 ]; then   # a copy with the 8-per-node asserts relaxed (lines "... num_local_ranks == 8 ...")
                   file=test_internode_relaxed.py
                   $PY - "$WORK/test_internode.py" "$WORK/$file" <<'PY' || { SUMMARY+=("internode      not run: the 8-per-node assert moved"); continue; }
import sys
path, out = sys.argv[1], sys.argv[2]
text = open(path).read()
edits = [("assert num_experts % num_ranks == 0 and num_local_ranks == 8", "assert num_experts % num_ranks == 0"),
         ("assert num_local_ranks == 8 and num_ranks > 8", "assert num_ranks > num_local_ranks")]
for old, new in edits:
    if text.count(old) != 1:
        sys.exit(f"{path}: expected one '{old}'")
    text = text.replace(old, new)
open(out, "w").write(text)
PY
               fi
               run_nodes "internode_${INTERNODE_NODES:-2}x$per_node" "${INTERNODE_NODES:-2}" "$per_node" \
                   "$file" --num-processes "$per_node" ;;
    *) echo "unknown run $r" ;;
    esac
done
echo quit | nvidia-cuda-mps-control 2>/dev/null || true
echo; echo "=== DeepEP V1 tests against deepep_portable ($RANKS ranks; logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
