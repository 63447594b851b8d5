"""`python -m deepep_portable precompile`: every kernel family into the JIT cache.

A family is declared (jit.register_family) next to the code that launches its kernels, and a backend
declares the kernels built for it in its transport module (e.g. low_latency.register_families(build));
importing those modules is what makes jit.families() complete. A backend whose kernels are
device-linked against a library offers `precompile(archs)` in that module instead (NVSHMEM:
`--nvshmem`)."""
from __future__ import annotations

import importlib
from typing import Dict, Sequence

from .. import jit

# The modules besides the backends' that declare kernel families (relative to the package).
FAMILY_MODULES = (".engines.dispatch_layout", ".engines.intranode", ".tools.kernels")


def load_families() -> Dict[str, jit.KernelFamily]:
    """Every kernel family of the package (imports the modules that declare them, every backend's too)."""
    from ..transports import registry

    for name in FAMILY_MODULES:
        importlib.import_module(name, "deepep_portable")
    for backend in registry.BACKENDS:
        if backend.module is not None:
            importlib.import_module(backend.module, "deepep_portable.transports")
    return jit.families()


def main(archs: Sequence[str], nvshmem: bool) -> int:
    load_families()
    for name, arch, seconds, hit in jit.precompile(tuple(archs)):
        print(f"{name:40s} {arch:6s} {'cached' if hit else f'{seconds:.1f} s'}")
    if nvshmem:
        from ..transports.nvshmem.transport import precompile

        for name, arch, seconds, hit in precompile(tuple(a for a in archs if a != "sm_80")):
            print(f"{name:40s} {arch:6s} {'cached' if hit else f'{seconds:.1f} s'}")
    return 0
