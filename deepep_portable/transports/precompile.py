"""Building a kernel backend's kernels ahead of use (`python -m deepep_portable precompile --<name>`).

jit.precompile builds the registered kernel families, which CI compiles for every arch. A network backend's
kernels are left out of them: CI would spend minutes on kernels that only a cluster (or the GPU suites) runs.
A backend's registry row points its `precompile` hook at a function that hands `build_variants` its own way
of compiling one kernel (plain nvcc with its KernelBuild, or device-linked against its library); the kernels
are those the GPU suites and the bench build over a network backend, so the same cache keys come out as at
run time.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Tuple

from .. import jit
from ..engines import internode, low_latency

Variant = Tuple[str, dict]                        # (source under csrc/, the kernel's own defines)
Compiled = Tuple[str, str, float, bool]           # (label, arch, seconds, cache_hit)


def suite_variants() -> List[Variant]:
    """The low-latency kernels at every HIDDENS and top-8 (the combine also with LogFMT at 7168), the clean
    kernel, and the internode kernels of the GPU suites' node shapes."""
    ll = low_latency
    return [v for h in ll.HIDDENS for v in ll.round_variants(h, 8)] + \
        [(ll.COMBINE_SOURCE, ll.kernel_defines(7168, 8, True, ph)) for ph in (ll.PHASE_SEND, ll.PHASE_RECV)] + \
        [(ll.CLEAN_SOURCE, {})] + internode.precompile_variants()


def build_variants(name: str, compile_one: Callable[[str, dict, str], jit.CompileResult], archs: Sequence[str],
                   jobs: Optional[int] = None, variants: Optional[Sequence[Variant]] = None) -> List[Compiled]:
    """compile_one(source, defines, arch) for every variant (default suite_variants()) and arch, `jobs` nvcc
    processes at once (default: every core). Labels read "<file>[<name>,K=V,...]". Raises the first failure
    after the others finished (jit.run_all)."""
    tasks = [(source, defines, arch) for source, defines in (suite_variants() if variants is None else variants)
             for arch in archs]

    def run(task) -> Compiled:
        source, defines, arch = task
        res = compile_one(source, defines, arch)
        label = f"{os.path.basename(source)}[{name}" + "".join(f",{k}={v}" for k, v in defines.items()) + "]"
        return label, arch, res.seconds, res.cache_hit

    jit.find_nvcc()   # raises naming where it looked
    return jit.run_all(run, tasks, jobs)
