"""Host side of csrc/common/kernels/peer_bases.cu: every peer's window address as the backend's device code
reaches it (0: no load/store path), for windows whose host API cannot give them (nccl_gin before NCCL 2.29)."""
from __future__ import annotations

import functools
from typing import List

import torch

from .. import jit
from ..windows.base import Window
from .launch import launch, params_struct

SOURCE = "common/kernels/peer_bases.cu"
KERNEL = jit.kernel_symbol("deepep_portable::windows::peer_bases", "PeerBasesParams")


@functools.lru_cache(maxsize=None)
def params_type(transport_struct: type) -> type:
    """Mirror of PeerBasesParams for kernels built for the backend whose Transport `transport_struct` mirrors."""
    return params_struct("PeerBasesParams", [("transport", transport_struct), "num_ranks", "out"])


def peer_bases(window: Window, num_ranks: int, device: torch.device) -> List[int]:
    """Run the kernel once on the current stream and wait for it: [num_ranks] addresses."""
    transport = window.transport_params()
    out = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    p = params_type(type(transport))()
    p.transport, p.num_ranks, p.out = transport, num_ranks, out.data_ptr()
    launch(window.kernel(SOURCE, KERNEL, {}), 1, 128, p)
    return [int(b) & (2**64 - 1) for b in out.tolist()]
