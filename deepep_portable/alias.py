"""`import deep_ep` served by deepep_portable, for code written against DeepEP V2, without editing it.

The one supported way is explicit, per process; nothing is installed into site-packages:
  - in the program, before it imports deep_ep:
        from deepep_portable.alias import install_deep_ep_alias
        install_deep_ep_alias()
  - or around an unmodified program, with the launcher of this module (as `python -m` runs a program):
        python -m deepep_portable.alias train.py --its-args ...
        python -m deepep_portable.alias -m package.module --its-args ...
        torchrun --nproc-per-node 8 -m deepep_portable.alias train.py --its-args ...
Then `import deep_ep` gives DeepEP V2's top-level names (Buffer, ElasticBuffer, EPHandle, EventOverlap,
EventHandle, Config, topk_idx_t, get_physical_domain_size, get_logical_domain_size; any other name is
deepep_portable's), and the modules `deep_ep.utils`, `deep_ep.utils.event`, `deep_ep.buffers`,
`deep_ep.buffers.elastic` and `deep_ep.buffers.legacy` are deepep_portable's. Other `deep_ep.*` modules
(V2's test helpers, its `_C`) do not exist here and fail to import. A `deep_ep` imported already (DeepEP
itself) is never replaced: the alias refuses.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import runpy
import sys
import types
from typing import List

ALIAS = "deep_ep"
# V2's module names -> ours.
MODULES = {
    "deep_ep.utils": "deepep_portable.utils",
    "deep_ep.utils.event": "deepep_portable.utils.event",
    "deep_ep.buffers": "deepep_portable.buffers",
    "deep_ep.buffers.elastic": "deepep_portable.buffers.elastic",
    "deep_ep.buffers.legacy": "deepep_portable.buffers.legacy",
}
_MARK = "__deepep_portable_alias__"


def _top_level() -> types.ModuleType:
    """The `deep_ep` module: V2's top-level names, then deepep_portable's for anything else."""
    import deepep_portable
    from deepep_portable.buffers import elastic, legacy
    from deepep_portable.utils import EventHandle, EventOverlap

    module = types.ModuleType(ALIAS, "DeepEP V2's API served by deepep_portable (deepep_portable/alias.py).")
    module.__spec__ = importlib.machinery.ModuleSpec(ALIAS, None, is_package=True)
    module.__path__ = []   # a package whose submodules are only those registered in sys.modules
    module.__package__ = ALIAS
    module.__version__ = deepep_portable.__version__
    module.Buffer, module.Config, module.topk_idx_t = legacy.Buffer, legacy.Config, legacy.topk_idx_t
    module.ElasticBuffer, module.EPHandle = elastic.ElasticBuffer, elastic.EPHandle
    module.EventOverlap, module.EventHandle = EventOverlap, EventHandle
    module.get_physical_domain_size = elastic.get_physical_domain_size
    module.get_logical_domain_size = elastic.get_logical_domain_size
    module.__getattr__ = lambda name: getattr(deepep_portable, name)
    setattr(module, _MARK, True)
    return module


def install_deep_ep_alias() -> types.ModuleType:
    """Make `import deep_ep` (and V2's submodules) resolve to deepep_portable in this process; returns the
    `deep_ep` module. Idempotent. Raises RuntimeError if another `deep_ep` is imported already."""
    existing = sys.modules.get(ALIAS)
    if existing is not None:
        if getattr(existing, _MARK, False):
            return existing
        raise RuntimeError(f"a deep_ep module is imported already ({getattr(existing, '__file__', existing)!r}); "
                           f"install the deepep_portable alias before anything imports deep_ep")
    top = _top_level()
    modules = {name: importlib.import_module(real) for name, real in MODULES.items()}
    sys.modules[ALIAS] = top
    sys.modules.update(modules)
    top.utils, top.buffers = modules["deep_ep.utils"], modules["deep_ep.buffers"]
    return top


def uninstall_deep_ep_alias() -> None:
    """Undo install_deep_ep_alias (a no-op when it is not installed)."""
    if getattr(sys.modules.get(ALIAS), _MARK, False):
        for name in [ALIAS, *MODULES]:
            sys.modules.pop(name, None)


def main(argv: List[str]) -> None:
    """`python -m deepep_portable.alias (script | -m module) [args...]`: run the program as __main__ with the
    alias installed, its sys.argv as if it had been started directly."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m deepep_portable.alias (script.py | -m module) [args...]")
    install_deep_ep_alias()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))   # as `python script.py` has it
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # Run through the importable module, so that the alias state lives in one module object.
    from deepep_portable.alias import main as _main

    _main(sys.argv[1:])
