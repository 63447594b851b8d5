"""DeepEP V2's `deep_ep.buffers.legacy`: V1's `Buffer` (deepep_portable/buffer.py), where V2 keeps it."""
from ..buffer import Buffer, topk_idx_t
from ..config import Config

__all__ = ["Buffer", "Config", "topk_idx_t"]
