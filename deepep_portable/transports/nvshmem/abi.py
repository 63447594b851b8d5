"""Structs the NVSHMEM backend shares with its device code (host mirrors, checked by name and order
against the C structs by tests/test_mirrors.py)."""
from __future__ import annotations

import ctypes


class NvshmemTransportParams(ctypes.Structure):
    """Host mirror of transport::NvshmemTransport (csrc/backends/nvshmem/device.cuh)."""

    _fields_ = [("base", ctypes.c_uint64), ("rank", ctypes.c_int32), ("num_ranks", ctypes.c_int32),
                ("peer_bases", ctypes.c_uint64)]
