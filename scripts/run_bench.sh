#!/usr/bin/env bash
# Main job: set the machine up (scripts/setup_env.sh), then run the benchmark.
#   bash scripts/run_bench.sh [bench options]   ==  python -m deepep_portable bench [bench options]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup_env.sh || { echo "run_bench.sh: environment setup failed"; exit 1; }
exec python -m deepep_portable bench "$@"
