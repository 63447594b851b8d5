# Sourced by the GPU scripts (gpu_tests.sh, multi_gpu.sh): the environment every GPU run shares.
# Sets OUT (logs), PY, CUDA_HOME, the JIT cache and PYTHONPATH; installs carried wheels (.whl/).
OUT=${OUT:-$PWD/.gpu_out}
mkdir -p "$OUT"
# Never use NVLink multicast (on a shared host it can take the GPUs out of service for everyone).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export DEEPEP_PORTABLE_CACHE_DIR=${DEEPEP_PORTABLE_CACHE_DIR:-$PWD/.jit_cache}
# A JIT cache brought from an earlier machine (gpu_tests.sh step "cache" wrote it): saves the precompile.
# It comes whole (.jitc/jit_cache.tgz) or in parts (.jitc/jit_cache.tgz.NN, joined in name order).
if ls .jitc/jit_cache.tgz* >/dev/null 2>&1 && [ ! -d "$DEEPEP_PORTABLE_CACHE_DIR" ]; then
    mkdir -p "$DEEPEP_PORTABLE_CACHE_DIR" && cat .jitc/jit_cache.tgz* | tar xzf - -C "$DEEPEP_PORTABLE_CACHE_DIR"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
# build_deepep DIR: build a DeepEP V1 checkout in place unless it holds a built module (about 100 s with 16 jobs,
# against the pip NVSHMEM; never commit the build); log in $OUT/deepep_build.log, its tail and status 1 on failure
build_deepep() {
    ls "$1"/deep_ep_cpp*.so >/dev/null 2>&1 && return 0
    echo "=== building DeepEP in $1"
    (cd "$1" && CPLUS_INCLUDE_PATH=$CUDA_HOME/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH} \
        MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0 $PY setup.py build_ext --inplace) >"$OUT/deepep_build.log" 2>&1 \
        || { tail -30 "$OUT/deepep_build.log"; echo "DeepEP build failed (log: $OUT/deepep_build.log)"; return 1; }
}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then      # wheels the machine lacks (pytest-mpi)
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
