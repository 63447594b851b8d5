"""`Buffer(..., nccl_options={...})`: what the nccl_gin backend passes to NCCL, validated before anything is set
up. Ours: `gin` (True / False; default: GIN when the ranks span nodes), `reuse_torch_comm` (default True: the
window runs over the torch NCCL group's own communicator when that is safe, torch_comm.py). NCCL's own settings
go through its environment, read when the first communicator of the process is made (so the first Buffer's options win):
ib_gid_index -> NCCL_IB_GID_INDEX, ib_traffic_class -> NCCL_IB_TC, ib_sl -> NCCL_IB_SL, hca_list ->
NCCL_IB_HCA, gin_type -> NCCL_GIN_TYPE. NCCL_NVLS_ENABLE=0 always (NVLink SHARP stays off: DESIGN.md)."""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

PASS_THROUGH = {"ib_gid_index": ("NCCL_IB_GID_INDEX", 0, 255), "ib_traffic_class": ("NCCL_IB_TC", 0, 255),
                "ib_sl": ("NCCL_IB_SL", 0, 15), "hca_list": ("NCCL_IB_HCA", None, None),
                "gin_type": ("NCCL_GIN_TYPE", -1, 5)}
OURS = {"gin", "reuse_torch_comm"}


def nccl_environment(options: Optional[Mapping[str, Any]] = None) -> Dict[str, str]:
    """The NCCL_* variables for these options (pure). ValueError for an unknown name or a value out of range."""
    env = {"NCCL_NVLS_ENABLE": "0"}
    for key, value in (options or {}).items():
        if key in OURS:
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"nccl_options[{key!r}] must be True, False or None, got {value!r}")
            continue
        if key not in PASS_THROUGH:
            raise ValueError(f"unknown nccl option {key!r}; known: {sorted([*PASS_THROUGH, *OURS])}")
        if value is None:
            continue
        var, lo, hi = PASS_THROUGH[key]
        if lo is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"nccl_options[{key!r}] must be an integer in [{lo}, {hi}], got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"nccl_options[{key!r}] must be a non-empty string such as 'mlx5_0:1,mlx5_1:1'")
        env[var] = str(value)
    return env


def validate_options(options: Mapping[str, Any]) -> Dict[str, Any]:
    """The registry's options schema of this backend: `Buffer(transport_options=...)` checked before any set-up
    (nccl_environment's ValueErrors); the window applies them before its communicator is made."""
    nccl_environment(options)
    return dict(options)


def apply_environment(options: Optional[Mapping[str, Any]] = None) -> Dict[str, str]:
    env = nccl_environment(options)
    os.environ.update(env)
    return env
