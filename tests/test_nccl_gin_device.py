"""The nccl_gin backend's device side (csrc/backends/nccl_gin/device.cuh), without a GPU: every kernel over the
transport contract compiles for sm_90 against it and the headers of the loaded libnccl (the nvidia-nccl wheel
in CI), and the transport struct's mirror (transports/nccl_gin/abi.py) matches the C by name and offset.
Skips without nvcc or NCCL's device headers. Nothing of it has run on a GPU."""
from __future__ import annotations

import os
import sys

import pytest

from deepep_portable.engines import internode, peer_bases, transport_selftest
from deepep_portable.engines import low_latency as ll
from deepep_portable.transports import libraries

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_mirrors import _asserts, _compile, _internode_checks, _ll_checks, needs_nvcc  # noqa: E402

C_STRUCT = "deepep_portable::transport::NcclGinTransport"


class _Build:
    """NCCL_GIN_BUILD plus the NCCL include dir, shaped like a KernelBuild for test_mirrors._compile."""

    def __init__(self, include_flags) -> None:
        from deepep_portable.transports.nccl_gin.abi import NCCL_GIN_BUILD

        self.base = NCCL_GIN_BUILD
        self.flags = (*NCCL_GIN_BUILD.flags, *include_flags)

    def kernel_defines(self, defines):
        return self.base.kernel_defines(defines)


@pytest.fixture(scope="module")
def build():
    info = libraries.nccl_info()
    if info.get("device_header") is None:
        pytest.skip("no nccl_device.h here")
    from deepep_portable.transports.nccl_gin.abi import build_flags

    return _Build(build_flags(info["device_header"]))


@needs_nvcc
def test_selftest_and_low_latency_kernels(tmp_path, build):
    from deepep_portable.transports.nccl_gin.abi import NcclGinTransportParams as T

    cheap = 'static_assert(!deepep_portable::transport::Selected::kCheapFetchAdd, "no fetching atomic over GIN");'
    _compile(tmp_path, transport_selftest.SOURCE, _asserts(C_STRUCT, T) + _asserts(
        "SelftestParams", transport_selftest.params_type(T)) + [cheap], {}, build)
    _compile(tmp_path, ll.DISPATCH_SOURCE, _ll_checks(T, C_STRUCT, "dispatch"), ll.kernel_defines(256, 3), build)
    for phase in (ll.PHASE_SEND, ll.PHASE_RECV):
        _compile(tmp_path, ll.COMBINE_SOURCE, _ll_checks(T, C_STRUCT, "combine"),
                 ll.kernel_defines(512, 3, True, phase), build)
    _compile(tmp_path, ll.CLEAN_SOURCE, _ll_checks(T, C_STRUCT, "clean"), {}, build)
    _compile(tmp_path, peer_bases.SOURCE, _asserts("PeerBasesParams", peer_bases.params_type(T)), {}, build)


@needs_nvcc
@pytest.mark.parametrize("op,shape", [
    ("dispatch", dict(NUM_RANKS=16, RANKS_PER_NODE=8, HIDDEN_BYTES=7168, NUM_SCALES=56, NUM_TOPK=8)),
    ("combine", dict(NUM_RANKS=16, RANKS_PER_NODE=8, HIDDEN=7168, NUM_TOPK=8))])
def test_internode_kernels(tmp_path, build, op, shape):
    from deepep_portable.transports.nccl_gin.abi import NcclGinTransportParams as T

    source = internode.DISPATCH_SOURCE if op == "dispatch" else internode.COMBINE_SOURCE
    _compile(tmp_path, source, _internode_checks(T, C_STRUCT, op, shape), shape, build)


def test_unsupported_calls_become_clear_errors():
    """kErrorUnsupported's record (what wait_ge reports after a failed call) names the peer and the reason."""
    from deepep_portable import errors
    from deepep_portable.transports import registry

    codes, ops = errors.table()
    op = {name: i for i, name in ops.items()}["low_latency_dispatch"]
    exc = errors.from_record((codes["unsupported"], op, 3, 5, 0, 4), 1.0, registry.error_text("nccl_gin"))
    assert "cannot reach peer 5" in str(exc) and "fetch_add over GIN" in str(exc) and "rank 3" in str(exc)


def test_set_over_add_emulation_on_host_threads(run_native):
    """signal_shadow.cuh against a mock of GIN's add-only VA signals delivered out of order (host threads)."""
    run_native("nccl_gin_shadow_model", timeout=120)


@needs_nvcc
def test_kernels_compile_against_the_tests_mock_of_nccls_device_api(tmp_path):
    """The GIN branches as the GPU mock runs them (tests/nccl_gin_mock.py): every kernel over the contract builds
    against the mock's headers, and the mock's structs match their host mirrors."""
    from deepep_portable.transports.nccl_gin.abi import NcclGinTransportParams as T

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nccl_gin_mock

    build = _Build(("-I" + nccl_gin_mock.MOCK_DIR,))
    mock_structs = _asserts("ncclDevComm", nccl_gin_mock.MockDevComm) + \
        _asserts("ncclWindow_vidmem", nccl_gin_mock.MockWindowStruct)
    _compile(tmp_path, transport_selftest.SOURCE, mock_structs + _asserts(C_STRUCT, T), {}, build)
    _compile(tmp_path, ll.DISPATCH_SOURCE, _ll_checks(T, C_STRUCT, "dispatch"), ll.kernel_defines(256, 3), build)
    for phase in (ll.PHASE_SEND, ll.PHASE_RECV):
        _compile(tmp_path, ll.COMBINE_SOURCE, _ll_checks(T, C_STRUCT, "combine"),
                 ll.kernel_defines(512, 3, True, phase), build)
    _compile(tmp_path, ll.CLEAN_SOURCE, _ll_checks(T, C_STRUCT, "clean"), {}, build)
    _compile(tmp_path, peer_bases.SOURCE, [], {}, build)
    for op, shape in (("dispatch", dict(NUM_RANKS=4, RANKS_PER_NODE=2, HIDDEN_BYTES=7168, NUM_SCALES=56, NUM_TOPK=8)),
                      ("combine", dict(NUM_RANKS=4, RANKS_PER_NODE=2, HIDDEN=7168, NUM_TOPK=8))):
        source = internode.DISPATCH_SOURCE if op == "dispatch" else internode.COMBINE_SOURCE
        _compile(tmp_path, source, _internode_checks(T, C_STRUCT, op, shape), shape, build)
