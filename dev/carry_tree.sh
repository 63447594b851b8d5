#!/usr/bin/env bash
# Build the tree one lent-GPU call carries: a clean worktree of HEAD (so edits made while a call runs cannot leak
# into it), plus what the lent machine lacks and cannot download: the pytest-mpi wheel (.whl/), the JIT cache of
# this tree's kernels built here (.jitc/jit_cache.tgz, unpacked by scripts/gpu_env.sh), and optionally a DeepEP
# V1 source tree (.deepep/src, for sweepv2 / compare_deepep.sh / deepep_tests.sh; built there, never here).
#   usage: bash dev/carry_tree.sh DIR [DEEPEP_GIT_DIR [COMMIT=567632d]]
#   env:   PRECOMPILE_ARGS (default "--arch sm_90 --nvshmem --ibgda"), CACHE (default /tmp/deepep_carry_cache;
#          kept between runs: only kernels whose sources changed compile again, about 8 minutes on 2 cores the
#          first time), CARRY_LIMIT_MIB (default 64: what one call may carry in all)
# Then pass DIR (relative to the repository root) as the call's `carry`, and start its command with
# `cd DIR || exit 1; export OUT; ...` (a `cd` chained with `&` would run in the background job), ending with
# `bash dev/pack_out.sh` when it writes more than 8 files.
set -euo pipefail
DIR=${1:?usage: bash dev/carry_tree.sh DIR [DEEPEP_GIT_DIR [COMMIT]]}
DEEPEP_GIT=${2:-}
DEEPEP_COMMIT=${3:-567632d}
ROOT=$(git rev-parse --show-toplevel)
CACHE=${CACHE:-/tmp/deepep_carry_cache}
PY=${PYTHON:-python3}
cd "$ROOT"

# A fresh worktree of HEAD (an older one at DIR is replaced).
if git worktree list --porcelain | grep -qx "worktree $ROOT/$DIR"; then
    git worktree remove --force "$DIR"
fi
rm -rf "$DIR"
git worktree add -q --detach "$DIR" HEAD
echo "carry_tree: $DIR is $(git -C "$DIR" log --oneline -1)"

# pytest-mpi (the MPI suites' plugin) as a wheel: gpu_env.sh installs every wheel under .whl/.
mkdir -p "$DIR/.whl"
$PY -m pip download -q --no-deps -d "$DIR/.whl" pytest-mpi

# The JIT cache: every kernel of this tree the GPU steps build, compiled here (the key holds no machine fact,
# only sources, defines, flags and nvcc's version) by this tree's own `precompile`, which names each entry it
# compiled or found; only those are carried (the cache may hold older trees' kernels too).
# shellcheck disable=SC2086
keys=$(cd "$DIR" && DEEPEP_PORTABLE_CACHE_DIR=$CACHE PYTHONPATH=$PWD $PY - precompile \
       ${PRECOMPILE_ARGS:---arch sm_90 --nvshmem --ibgda} <<'PY'
import os, sys
from deepep_portable import __main__ as cli, jit

used = []
def recorded(out_path, build, _cached=jit.cached_artifact):
    used.append(os.path.basename(out_path))
    return _cached(out_path, build)
jit.cached_artifact = recorded     # every build goes through it (jit.compile_cached, nvshmem's link step)
with open(os.devnull, "w") as quiet:
    stdout, sys.stdout = sys.stdout, quiet
    try:
        rc = cli.main(sys.argv[1:])
    finally:
        sys.stdout = stdout
if rc:
    sys.exit(rc)
print("\n".join(sorted(set(used))))
PY
)
mkdir -p "$DIR/.jitc"
echo "$keys" | tar czf "$DIR/.jitc/jit_cache.tgz" -C "$CACHE" -T -
echo "carry_tree: $(echo "$keys" | wc -l) cache entries, $(du -m "$DIR/.jitc/jit_cache.tgz" | cut -f1) MiB"

# DeepEP V1's source at the commit the comparisons use (its tracked files only: no build, no .git).
if [ -n "$DEEPEP_GIT" ]; then
    mkdir -p "$DIR/.deepep/src"
    git -C "$DEEPEP_GIT" archive "$DEEPEP_COMMIT" | tar xf - -C "$DIR/.deepep/src"
    echo "carry_tree: DeepEP $DEEPEP_COMMIT in $DIR/.deepep/src"
fi

total=$(du -sm "$DIR" | cut -f1)
echo "carry_tree: $DIR holds $total MiB (limit ${CARRY_LIMIT_MIB:-64})"
if [ "$total" -gt "${CARRY_LIMIT_MIB:-64}" ]; then
    echo "carry_tree: too large to carry: narrow PRECOMPILE_ARGS (e.g. without --ibgda)" >&2
    exit 1
fi
