"""Launch glue shared by every engine: parameter structs, streams, kernel lookups.

Convention (shared with csrc/common/kernels/common.cuh): a kernel takes one struct parameter
passed by value. Its host mirror is a `ctypes.Structure` with the same fields in the same order:
pointers as `c_uint64` / `c_int64` (tensor.data_ptr()), integers with explicit widths. `launch()`
packs it to bytes; `_C` rejects a launch whose byte size differs from the kernel's parameter (when
the driver can report it), tests/test_mirrors.py checks every mirror against its C struct by field
name and offset, and tests/test_jit.py, test_low_latency_host.py, test_intranode_host.py check sizes
against the PTX.

Streams: outputs are allocated with torch on the *current* stream; device work is enqueued on the
`stream` argument. Ordering between the two (and record_stream) is the caller's job (Buffer._op).
"""
from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .. import jit
from ..device import device_index

Dim = Union[int, Sequence[int]]


# ---- generic helpers --------------------------------------------------------------------------

StreamLike = Union[None, int, torch.cuda.Stream]


# torch's current CUstream as an int without building a torch.cuda.Stream (which costs a few microseconds of
# Python per call, a visible share of an eager layout): torch._C._cuda_getCurrentRawStream, the getter Triton's
# launchers and torch's compiled code use. It is not public API, so it is used only where present and only
# after it agreed with torch.cuda.current_stream, on the default stream and inside a side stream, once per device.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_raw_stream_agrees: dict = {}   # device index -> bool


def _check_raw_stream(dev: int) -> bool:
    try:
        if _RAW_STREAM is None or _RAW_STREAM(dev) != torch.cuda.current_stream(dev).cuda_stream:
            return False
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            return _RAW_STREAM(dev) == side.cuda_stream == torch.cuda.current_stream(dev).cuda_stream
    except Exception:   # noqa: BLE001 - any failure: use the public API
        return False


def current_stream_handle(dev: int) -> int:
    """The current torch stream of device index `dev`, as a CUstream int."""
    agrees = _raw_stream_agrees.get(dev)
    if agrees is None:
        agrees = _raw_stream_agrees[dev] = _check_raw_stream(dev)
    return _RAW_STREAM(dev) if agrees else torch.cuda.current_stream(dev).cuda_stream


_wait_by_handle: list = []   # [_C.stream_wait_stream], bound on first use (this module imports without _C)


def stream_wait_stream(dev: int, waiter: int, waited: int) -> None:
    """Stream `waiter` waits for the work enqueued on `waited` so far (CUstream ints on device index `dev`): an
    event record and a wait in _C, without the Python stream and event objects of torch's Stream.wait_stream
    (~10 us of host time a wait under MPS). Twice per op: the _C function is looked up once, not imported per call."""
    if not _wait_by_handle:
        from .. import _C
        _wait_by_handle.append(_C.stream_wait_stream)
    _wait_by_handle[0](dev, waiter, waited)


_query_by_handle: list = []   # [_C.stream_query], bound on first use


def stream_idle(dev: int, stream: int) -> bool:
    """Whether every kernel enqueued so far on `stream` (a CUstream int on device index `dev`) has completed
    (cuStreamQuery): work enqueued later on another stream then follows it with no event."""
    if not _query_by_handle:
        from .. import _C
        _query_by_handle.append(_C.stream_query)
    return _query_by_handle[0](dev, stream)


def stream_handle(stream: StreamLike, device: Optional[int] = None) -> int:
    """CUstream as an int: `stream` itself if an int, its handle if a torch stream, else the
    current torch stream of `device`. (Resolve once per op: current_stream() costs microseconds.)"""
    if stream is None:
        if isinstance(device, int):
            return current_stream_handle(device)
        stream = torch.cuda.current_stream(device)
    return stream if isinstance(stream, int) else int(stream.cuda_stream)


def launch(fn, grid: Dim, block: Dim, params: ctypes.Structure, stream: StreamLike = None,
           shared_mem: int = 0, cluster: Optional[Dim] = None, cooperative: bool = False,
           programmatic: bool = False) -> None:
    """Launch `fn` (a `_C.Function`) with the packed `params` struct on `stream` (`programmatic`: a
    programmatic dependent launch, for kernels that wait for the previous grid first, sm_90+)."""
    fn.launch(grid, block, shared_mem, stream_handle(stream, fn.device), bytes(params), cluster, cooperative,
              programmatic)


def check_aligned(name: str, t: torch.Tensor) -> None:
    """Kernels that move rows as 16-byte words: a misaligned view would fault (and kill the context)."""
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (got a view at offset "
                         f"{t.data_ptr() % 16} mod 16): pass a fresh tensor or .clone() it")


# DEEPEP_PORTABLE_PDL=0: plain launches, a fallback for a driver, or a tool such as a profiler or
# compute-sanitizer, that misbehaves with programmatic dependent launches (docs/CONFIGURATION.md).
PDL_SWITCH = "DEEPEP_PORTABLE_PDL"


def programmatic_launches(device: torch.device) -> bool:
    """Whether kernels written for it (csrc/common/kernels/grid_dependency.cuh) are launched as programmatic
    dependent launches on `device`: compute capability 9.0 or newer, kernels built for it (not forced to an
    older architecture by DEEPEP_PORTABLE_FORCE_ARCH: their wait for the previous grid compiles to nothing
    there), and DEEPEP_PORTABLE_PDL not 0."""
    if os.environ.get(PDL_SWITCH, "1") == "0" or device.type != "cuda":
        return False
    forced = (jit.forced_arch() or "").strip()
    if forced and jit.arch_number(forced) < 90:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def zero_async(t: torch.Tensor, stream: StreamLike) -> None:
    """Zero a contiguous CUDA tensor on `stream` (cuMemsetD8Async, no torch kernel)."""
    from .. import _C

    nbytes = t.numel() * t.element_size()
    if nbytes:
        dev = device_index(t)
        _C.memset_d8_async(dev, t.data_ptr(), 0, nbytes, stream_handle(stream, dev))


def params_struct(name: str, fields: List[Union[str, Tuple[str, type]]]) -> type:
    """A ctypes mirror of a kernel's params struct: 64-bit fields (the kernels' params are 64-bit
    words, so no padding rules apply), or (name, ctypes type) for a nested struct such as a
    backend's Transport."""
    fields_ = [f if isinstance(f, tuple) else (f, ctypes.c_int64) for f in fields]
    return type(name, (ctypes.Structure,), {"_fields_": fields_})


def ptr(t: Optional[torch.Tensor]) -> int:
    """A tensor's address for a params field; 0 for None."""
    return 0 if t is None else t.data_ptr()
