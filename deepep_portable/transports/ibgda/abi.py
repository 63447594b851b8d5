"""Structs the ibgda backend shares with its device code (csrc/backends/ibgda/: sq.cuh's SendQueue, ops.cuh's
Endpoint, device.cuh's IbgdaTransport), as ctypes mirrors checked by name and offset against the C by
tests/test_ibgda_transport.py; and how kernels over the contract are built for this backend."""
from __future__ import annotations

import ctypes

from ...windows.base import KernelBuild

# Kernels over the contract for this backend (selected_transport.cuh); fetch_add is not cheap (a network AMO).
IBGDA_BUILD = KernelBuild("backends/ibgda/device.cuh", "IbgdaTransport")
SCRATCH_WORDS = 8192   # IbgdaTransport::kScratchWords: u64 result words at scratch_offset of the window


class SendQueueParams(ctypes.Structure):
    """ibgda::SendQueue: one send queue's ring, posting words, doorbell record, doorbell and collapsed CQE."""

    _fields_ = [("ring", ctypes.c_uint64), ("depth", ctypes.c_uint32), ("qpn", ctypes.c_uint32),
                ("reserve", ctypes.c_uint64), ("turn", ctypes.c_uint64), ("completed", ctypes.c_uint64),
                ("dbr", ctypes.c_uint64), ("doorbell", ctypes.c_uint64), ("cq", ctypes.c_uint64)]


class EndpointParams(ctypes.Structure):
    """ibgda::Endpoint: my queue pair to one (peer, channel) and the keys its WQEs name."""

    _fields_ = [("q", SendQueueParams), ("raddr_base", ctypes.c_uint64), ("rkey", ctypes.c_uint32),
                ("lkey", ctypes.c_uint32)]


class IbgdaTransportParams(ctypes.Structure):
    """transport::IbgdaTransport (csrc/backends/ibgda/device.cuh). `endpoints`: [ranks * channels] EndpointParams,
    one QP to every rank (self included: fetch_add goes through the NIC for all); `nic_error`: int32 [6];
    `atomic_result_be`: the HCA's atomic_req_8B_endianness_mode says big-endian results."""

    _fields_ = [("endpoints", ctypes.c_uint64), ("peer_bases", ctypes.c_uint64), ("base", ctypes.c_uint64),
                ("scratch_offset", ctypes.c_int64), ("scratch_ticket", ctypes.c_uint64), ("nic_error", ctypes.c_uint64),
                ("rank", ctypes.c_int32), ("num_ranks", ctypes.c_int32), ("channels", ctypes.c_int32),
                ("atomic_result_be", ctypes.c_int32), ("timeout_ns", ctypes.c_int64)]
