#!/usr/bin/env bash
# Last thing in a device call: the lent machine sends back at most 8 files from $OUT, so pack every log
# under $OUT (or .gpu_out) into $OUT/logs.tgz, leaving beside it only the JIT cache parts (jit_cache.tgz.NN,
# written by gpu_tests.sh's `cache` step) and any file named in KEEP (space-separated names under $OUT).
#   usage: bash dev/pack_out.sh        then here: tar xzf <files_at>/logs.tgz -C somewhere
set -euo pipefail
OUT=${OUT:-$PWD/.gpu_out}
cd "$OUT"
keep=(-name 'jit_cache.tgz.*' -o -name logs.tgz)
for k in ${KEEP:-}; do keep+=(-o -path "./$k"); done
list=$(find . -type f ! \( "${keep[@]}" \) | sort)
[ -n "$list" ] || { echo "pack_out: nothing to pack in $OUT"; exit 0; }
# shellcheck disable=SC2086
tar czf logs.tgz $list && rm -f $list && find . -mindepth 1 -type d -empty -delete
echo "pack_out: $(echo "$list" | wc -l) files in $OUT/logs.tgz; left: $(ls "$OUT" | tr '\n' ' ')"
