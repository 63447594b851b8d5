"""`python -m deepep_portable precompile`: every kernel family into the JIT cache.

A family is declared (jit.register_family) next to the code that launches its kernels; importing
those modules is what makes jit.families() complete."""
from __future__ import annotations

import importlib
from typing import Dict, Sequence

from .. import jit

# Every module that declares kernel families (relative to the package).
FAMILY_MODULES = (".engines.dispatch_layout", ".engines.intranode", ".transports.nvlink.transport", ".tools.kernels")


def load_families() -> Dict[str, jit.KernelFamily]:
    """Every kernel family of the package (imports the modules that declare them)."""
    for name in FAMILY_MODULES:
        importlib.import_module(name, "deepep_portable")
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
