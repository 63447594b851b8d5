"""Structs the nccl_gin backend shares with its device code (csrc/backends/nccl_gin/device.cuh), as ctypes
mirrors checked by name and offset against the C (tests/test_nccl_gin_device.py), and how kernels over the
contract are built for it: against the headers of the loaded libnccl (host.py), with -std=c++17."""
from __future__ import annotations

import ctypes
import os

from ...windows.base import KernelBuild

NCCL_GIN_BUILD = KernelBuild("backends/nccl_gin/device.cuh", "NcclGinTransport")
SCRATCH_WORDS = 1024   # NcclGinTransport::kScratchWords


class SignalShadowParams(ctypes.Structure):
    """transport::SignalShadow: per (peer, offset) the last value SET there over GIN (device memory)."""

    _fields_ = [("keys", ctypes.c_uint64), ("values", ctypes.c_uint64), ("capacity", ctypes.c_uint32)]


class NcclGinTransportParams(ctypes.Structure):
    """transport::NcclGinTransport. `comm`: the ncclDevComm bytes in device memory; `win`: the ncclWindow_t;
    `failure`: device int32 [3]; my LSA team: ranks [lsa_first, lsa_first + lsa_size)."""

    _fields_ = [("comm", ctypes.c_uint64), ("win", ctypes.c_uint64), ("base", ctypes.c_uint64),
                ("rank", ctypes.c_int32), ("num_ranks", ctypes.c_int32), ("gin_contexts", ctypes.c_int32),
                ("lsa_first", ctypes.c_int32), ("lsa_size", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("shadow", SignalShadowParams), ("scratch_offset", ctypes.c_int64),
                ("scratch_ticket", ctypes.c_uint64), ("failure", ctypes.c_uint64)]


def build_flags(device_header: str) -> tuple:
    """nvcc flags of a kernel over this backend: the NCCL include dir next to `device_header`."""
    return ("-I" + os.path.dirname(device_header),)
