"""deepep_portable: portable expert-parallel (MoE dispatch/combine) communication for PyTorch.

`import deepep_portable as deep_ep` is a drop-in for DeepEP V1's public API (`Buffer`, `EventOverlap`,
`Config`, `topk_idx_t`), with the transport chosen at run time (`Buffer(..., transport=...)`).
"""
from .buffer import Buffer, topk_idx_t
from .config import Config
from .event import EventOverlap
from .handles import DispatchHandle, InternodeHandle, LowLatencyHandle
from .errors import CommError, CommTimeoutError, PeerFailedError, PeersAbsentError
from .transports import TransportStatus, available_transports

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "DispatchHandle", "InternodeHandle", "LowLatencyHandle",
           "TransportStatus", "CommError", "CommTimeoutError", "PeerFailedError", "PeersAbsentError", "available_transports", "__version__"]
