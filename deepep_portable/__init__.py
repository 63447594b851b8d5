"""deepep_portable: portable expert-parallel (MoE dispatch/combine) communication for PyTorch.

`import deepep_portable as deep_ep` is a drop-in for DeepEP V1's public API (`Buffer`, `EventOverlap`,
`Config`, `topk_idx_t`) and V2's (`ElasticBuffer`, `EPHandle`, `EventHandle`, `get_physical_domain_size`,
`get_logical_domain_size`; `deepep_portable.utils`), with the transport chosen at run time
(`Buffer(..., transport=...)`). `EventOverlap` is V2's, which is V1's with V2's additions, and every op of both
APIs returns it, as in DeepEP V2. `deepep_portable.alias` makes `import deep_ep` resolve to this package.
"""
from .buffer import Buffer, topk_idx_t
from .buffers.elastic import ElasticBuffer, EPHandle, get_logical_domain_size, get_physical_domain_size
from .config import Config
from .utils.event import EventHandle, EventOverlap
from .handles import DispatchHandle, InternodeHandle, LowLatencyHandle
from .errors import CommError, CommTimeoutError, PeerFailedError, PeersAbsentError
from .transports import TransportStatus, available_transports

__version__ = "0.1.0"

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventOverlap", "EventHandle", "topk_idx_t",
           "get_physical_domain_size", "get_logical_domain_size", "DispatchHandle", "InternodeHandle",
           "LowLatencyHandle", "TransportStatus", "CommError", "CommTimeoutError", "PeerFailedError",
           "PeersAbsentError", "available_transports", "__version__"]
