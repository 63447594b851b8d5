"""deepep_portable: portable expert-parallel (MoE dispatch/combine) communication for PyTorch.

`import deepep_portable as deep_ep` is a drop-in for DeepEP V1's public API (`Buffer`, `EventOverlap`,
`Config`, `topk_idx_t`) and V2's (`ElasticBuffer`, `EPHandle`; `deepep_portable.utils`), with the transport chosen
at run time (`Buffer(..., transport=...)`). `deepep_portable.alias` makes `import deep_ep` resolve to this package.
"""
from .buffer import Buffer, topk_idx_t
from .buffers.elastic import ElasticBuffer, EPHandle
from .config import Config
from .event import EventOverlap
from .handles import DispatchHandle, InternodeHandle, LowLatencyHandle
from .errors import CommError, CommTimeoutError, PeerFailedError, PeersAbsentError
from .transports import TransportStatus, available_transports

__version__ = "0.1.0"

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventOverlap", "topk_idx_t", "DispatchHandle",
           "InternodeHandle", "LowLatencyHandle", "TransportStatus", "CommError", "CommTimeoutError", "PeerFailedError",
           "PeersAbsentError", "available_transports", "__version__"]
