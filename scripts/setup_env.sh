#!/usr/bin/env bash
# Set up everything deepep_portable needs on a fresh Debian/Ubuntu machine; quick when done already.
#
#   bash scripts/setup_env.sh      install/check, then print what to source
#   source scripts/setup_env.sh    the same, then export the environment into this shell
#                                  (venv on PATH, CUDA_HOME, NVLS/multicast off)
#
# Steps (each skipped when already satisfied):
#   1. apt packages: openmpi-bin libopenmpi-dev libibverbs-dev rdma-core python3-pyverbs iproute2 (the two-host test)
#      (+ python3-venv / python3-dev / build-essential when those are missing)
#   2. venv at .venv; torch (DEEPEP_TORCH_SPEC, default "torch==2.13.0"; may carry pip options,
#      e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
#   3. a CUDA compiler: $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc; if none
#      (or DEEPEP_IGNORE_SYSTEM_NVCC=1), the CUDA 13 compiler wheels into the venv, with
#      CUDA_HOME=<site-packages>/nvidia/cu13. Checked by compiling a kernel to an sm_90 cubin.
#      The chosen CUDA_HOME is written to .venv/cuda_home.
#   4. pip install -e ".[test]" with that CUDA_HOME (builds deepep_portable._C and any backend's
#      host.cpp module; redone when pyproject.toml, setup.py, csrc/common/runtime, a
#      csrc/backends/*/host.cpp or this script change)
# Knobs: DEEPEP_TORCH_SPEC, DEEPEP_IGNORE_SYSTEM_NVCC=1, DEEPEP_SKIP_APT=1, DEEPEP_PYTHON (python3),
#        DEEPEP_FORCE_SETUP=1 (ignore the "already done" stamp).

_dp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # ---- sourced: run the installer in a child bash (its own `set -e`), then export ----------
    if ! bash "${BASH_SOURCE[0]}"; then
        echo "setup_env.sh: setup failed (see above)" >&2
        return 1
    fi
    export VIRTUAL_ENV="$_dp_root/.venv"
    case ":$PATH:" in *":$VIRTUAL_ENV/bin:"*) ;; *) export PATH="$VIRTUAL_ENV/bin:$PATH" ;; esac
    if [[ -s "$VIRTUAL_ENV/cuda_home" ]]; then
        export CUDA_HOME="$(cat "$VIRTUAL_ENV/cuda_home")"
        # Put this nvcc first unless `nvcc` already resolves into the same CUDA_HOME.
        _dp_nvcc="$(command -v nvcc || true)"
        if [[ -z "$_dp_nvcc" || "${DEEPEP_IGNORE_SYSTEM_NVCC:-0}" == 1 ]]; then
            case ":$PATH:" in *":$CUDA_HOME/bin:"*) ;; *) export PATH="$CUDA_HOME/bin:$PATH" ;; esac
        fi
        unset _dp_nvcc
    fi
    export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    unset _dp_root
    return 0
fi

# ---- executed: install / verify ---------------------------------------------------------------
set -euo pipefail
cd "$_dp_root"
VENV="$_dp_root/.venv"
PY="${DEEPEP_PYTHON:-python3}"
TORCH_SPEC="${DEEPEP_TORCH_SPEC:-torch==2.13.0}"
CUDA_WHEELS=("nvidia-cuda-nvcc>=13,<14" "nvidia-cuda-crt>=13,<14" "nvidia-nvvm>=13,<14"
             "nvidia-cuda-cccl>=13,<14" "nvidia-cuda-runtime>=13,<14")
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 DEBIAN_FRONTEND=noninteractive
log() { echo "[setup_env] $*"; }
t0=$SECONDS

# 1. apt ------------------------------------------------------------------------------------------
apt_missing=()
if [[ "${DEEPEP_SKIP_APT:-0}" != 1 ]] && command -v dpkg-query >/dev/null; then
    want=(openmpi-bin libopenmpi-dev libibverbs-dev rdma-core python3-pyverbs iproute2)
    "$PY" -c "import ensurepip, venv" 2>/dev/null || want+=(python3-venv)
    "$PY" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        2>/dev/null || want+=(python3-dev)
    command -v g++ >/dev/null && command -v gcc >/dev/null && command -v make >/dev/null || want+=(build-essential)
    for p in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || apt_missing+=("$p")
    done
fi
if ((${#apt_missing[@]})); then
    SUDO=""
    if [[ $(id -u) != 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
            echo "[setup_env] missing apt packages ${apt_missing[*]} and no root/sudo: install them" \
                 "yourself (or DEEPEP_SKIP_APT=1 to go on without them)" >&2
            exit 1
        fi
    fi
    log "apt-get install ${apt_missing[*]}"
    $SUDO apt-get update -q >/dev/null
    $SUDO apt-get install -y -q --no-install-recommends "${apt_missing[@]}" >/dev/null
fi

# 2. venv, torch -----------------------------------------------------------------------
stamp_of() {
    { cat pyproject.toml scripts/setup_env.sh; if [[ -f setup.py ]]; then cat setup.py; fi
      if [[ -d csrc/common/runtime ]]; then find csrc/common/runtime -type f | LC_ALL=C sort | xargs -r cat; fi
      find csrc/backends -name host.cpp 2>/dev/null | LC_ALL=C sort | xargs -r cat
      echo "$TORCH_SPEC|${DEEPEP_IGNORE_SYSTEM_NVCC:-0}|$("$VENV/bin/python" -V 2>&1)"; } | sha256sum | cut -c1-16
}
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV with $($PY -V 2>&1)"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
STAMP="$VENV/.deepep_setup_stamp"
if [[ "${DEEPEP_FORCE_SETUP:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" && -s "$VENV/cuda_home" ]] \
   && "$VPY" -c "import torch, pytest, mpi4py, deepep_portable" 2>/dev/null \
   && [[ -x "$(cat "$VENV/cuda_home")/bin/nvcc" ]]; then
    log "already set up ($VENV, CUDA_HOME=$(cat "$VENV/cuda_home")); $((SECONDS - t0)) s"
    exit 0
fi
rm -f "$STAMP"
if ! "$VPY" -c "import torch" 2>/dev/null; then
    log "pip install $TORCH_SPEC"
    # shellcheck disable=SC2086  # the spec may carry pip options on purpose
    "$VPY" -m pip install -q $TORCH_SPEC
fi
# 3. CUDA compiler -------------------------------------------------------------------------------
cuda_home_of() {  # CUDA_HOME behind an nvcc binary or wrapper script (asks nvcc itself)
    local top
    top="$("$1" -dryrun -c -x cu -o /dev/null /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)"
    if [[ -n "$top" && -d "$top" ]]; then (cd "$top" && pwd -P); return; fi
    local d; d="$(cd "$(dirname "$(readlink -f "$1")")/.." && pwd -P)"
    if [[ -f "$d/include/cuda.h" || -f "$d/include/cuda_runtime.h" ]]; then echo "$d"; return; fi
    [[ -d /usr/local/cuda ]] && (cd /usr/local/cuda && pwd -P)
}
nvcc=""
if [[ "${DEEPEP_IGNORE_SYSTEM_NVCC:-0}" != 1 ]]; then
    for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
        if [[ -n "$c" && -x "$c" ]]; then nvcc="$c"; break; fi
    done
fi
if [[ -n "$nvcc" ]]; then
    if [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then cuda_home="$CUDA_HOME"
    else cuda_home="$(cuda_home_of "$nvcc")"; fi
    log "using system nvcc $nvcc (CUDA_HOME=$cuda_home)"
else
    log "no usable system nvcc: pip install the CUDA 13 compiler wheels into the venv"
    "$VPY" -m pip install -q "${CUDA_WHEELS[@]}"
    purelib="$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    cuda_home="$purelib/nvidia/cu13"
    [[ -x "$cuda_home/bin/nvcc" ]] || { echo "[setup_env] $cuda_home/bin/nvcc missing after pip install" >&2; exit 1; }
    [[ -e "$cuda_home/lib64" ]] || ln -s lib "$cuda_home/lib64"
    [[ -e "$cuda_home/lib/libcudart.so" ]] || ln -s libcudart.so.13 "$cuda_home/lib/libcudart.so"
fi
[[ -n "$cuda_home" && -x "$cuda_home/bin/nvcc" ]] || { echo "[setup_env] cannot determine CUDA_HOME (nvcc $nvcc)" >&2; exit 1; }

# Real check: compile a kernel using the runtime, bf16 and libcu++ headers to an sm_90 cubin.
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/check.cu" <<'EOF'
#include <cuda_bf16.h>
#include <cuda/atomic>
extern "C" __global__ void deepep_setup_check(__nv_bfloat16* x, unsigned long long* flag) {
    x[threadIdx.x] = __float2bfloat16(__bfloat162float(x[threadIdx.x]) + 1.0f);
    cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> f(*flag);
    f.store(1, cuda::memory_order_release);
}
EOF
if ! out="$("$cuda_home/bin/nvcc" -cubin -arch=sm_90 -O2 -std=c++17 -o "$tmp/check.cubin" "$tmp/check.cu" 2>&1)"; then
    echo "[setup_env] $cuda_home/bin/nvcc cannot compile an sm_90 cubin:" >&2; echo "$out" >&2; exit 1
fi
# 4. the package (its setup.py builds deepep_portable._C against $CUDA_HOME/include/cuda.h) ----
log "pip install -e .[test]"
CUDA_HOME="$cuda_home" "$VPY" -m pip install -q -e ".[test]"

echo "$cuda_home" >"$VENV/cuda_home"
stamp_of >"$STAMP"
log "ready: $($VPY -c 'import torch; print("torch", torch.__version__)'), CUDA_HOME=$cuda_home" \
    "($("$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p')); $((SECONDS - t0)) s"
log "use it with: source scripts/setup_env.sh"
