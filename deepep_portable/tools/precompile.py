"""`python -m deepep_portable precompile`: every kernel family into the JIT cache.

A family is declared (jit.register_family) next to the code that launches its kernels, and a backend
declares the kernels built for it in its transport module (e.g. low_latency.register_families(build));
importing those modules is what makes jit.families() complete. A network backend's kernels are left out of the
families (device-linked against a library, or only run on a cluster: CI compiles every family); its registry row
points its `precompile` at what builds them (transports/precompile.py), on request (`--<name>`, one flag per
such row, e.g. `--nvshmem`, `--ibgda`)."""
from __future__ import annotations

import importlib
from typing import Collection, Dict, Sequence, Union

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


def main(archs: Sequence[str], linked: Union[bool, Collection[str]] = False) -> int:
    """Every kernel family for `archs`, then the kernels of the backends in `linked` that jit.precompile cannot build
    (their rows' `precompile`): True for every such backend, or their names (the command line's `--<name>` flags)."""
    from ..transports import registry

    load_families()
    hooks = registry.hooks("precompile")
    if linked is not True:
        unknown = sorted(set(linked or ()) - {backend for backend, _ in hooks})
        if unknown:
            raise ValueError(f"{unknown}: no such backend builds kernels of its own; those that do: "
                             f"{[backend for backend, _ in hooks]}")
    builds = [build for backend, build in hooks if linked is True or backend in (linked or ())]
    for name, arch, seconds, hit in jit.precompile(tuple(archs)):
        print(f"{name:40s} {arch:6s} {'cached' if hit else f'{seconds:.1f} s'}")
    for build in builds:
        for name, arch, seconds, hit in build(tuple(archs)):
            print(f"{name:40s} {arch:6s} {'cached' if hit else f'{seconds:.1f} s'}")
    return 0
