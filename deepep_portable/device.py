"""What the package needs to know about a CUDA device: its index and its facts (from the host module
`_C`, not torch, so the numbers are the driver's). The one place device indices are resolved."""
from __future__ import annotations

import functools

import torch


def device_index(where) -> int:
    """Index of a CUDA device given as a tensor, a torch.device or an int (None or an index-less
    device: torch's current device)."""
    if isinstance(where, torch.Tensor):
        where = where.device
    if isinstance(where, torch.device):
        where = where.index
    return int(where) if where is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def device_info(device: int) -> dict:
    from . import _C

    return dict(_C.device_info(device))


def sm_count(device: int) -> int:
    return int(device_info(device)["sm_count"])


def device_uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)
