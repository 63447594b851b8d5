"""Every host mirror of a device struct or constant, checked against the C it mirrors, without a GPU.

A kernel takes one struct by value, filled on the host through a ctypes mirror (engines/launch.py).
Sizes alone would not catch two swapped 64-bit fields, so for every mirror a translation unit is
generated that includes the kernel source (built as the JIT builds it: the backend's header
pre-included for kernels over the transport contract) and asserts, field by field, that the C struct
has a member of that name at that offset, and the struct's size. A missing, renamed or reordered field
fails to compile. Also here: Capabilities (Python dataclass vs transport.cuh), the kernels' constants
the host repeats, each window's cheap_fetch_add against its build's kCheapFetchAdd, and the error table.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
from typing import Callable, Dict, List, Optional, Sequence

import pytest

from deepep_portable import errors, jit
from deepep_portable import layout as L
from deepep_portable.contract import Capabilities
from deepep_portable.engines import dispatch_layout, handle_kernel, intranode, transport_selftest
from deepep_portable.transports import registry
from deepep_portable.engines import low_latency as ll
from deepep_portable.tools import kernels as copy_kernels
from deepep_portable.transports import libraries
from deepep_portable.transports.nvlink.window import NvlinkTransportParams, nvlink_build
from deepep_portable.windows.base import KernelBuild

try:
    NVCC = jit.find_nvcc()
except Exception:   # pragma: no cover - CI installs a compiler
    NVCC = None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc")

Path = Callable[[str], str]   # ctypes field name -> C member designator (nested structs)


def _asserts(c_struct: str, mirror: type, path: Path = lambda n: n) -> List[str]:
    """static_asserts: the C struct's size, and for each field of the mirror (a nested mirror, e.g. the
    Transport struct, counts as one field: its own case checks its members) a member of that name
    (through `path`) at that offset."""
    lines = [f'static_assert(sizeof({c_struct}) == {ctypes.sizeof(mirror)}, "sizeof {c_struct}");']
    for designator, offset in ((path(name), getattr(mirror, name).offset) for name, _ in mirror._fields_):
        lines.append(f'static_assert(offsetof({c_struct}, {designator}) == {offset}, '
                     f'"{c_struct}.{designator} is not at offset {offset} (host mirror {mirror.__name__})");')
    return lines


def _compile(tmp_path, source: str, checks: Sequence[str], defines: Dict, build: Optional[KernelBuild] = None,
             nvshmem: bool = False) -> None:
    """Compile `source` (under csrc/) followed by `checks`; fail with nvcc's messages."""
    src = tmp_path / "mirror_check.cu"
    src.write_text(f'#include "{source}"\n#include <cstddef>\n' + "\n".join(checks) + "\n")
    flags = [*jit.BASE_FLAGS, "-arch=sm_90", f"-I{jit.kernel_root()}"]
    if build is not None:
        flags += list(build.flags)
        defines = build.kernel_defines(defines)
    if nvshmem:
        from deepep_portable.transports.nvshmem import link

        paths = link.nvshmem_build_paths()
        flags += ["-rdc=true", f"-I{paths.include_dir}", *(f"-I{d}" for d in link.cuda_include_dirs(NVCC))]
    cmd = [NVCC, *flags, *(f"-D{k}={v}" for k, v in defines.items()), "-c", str(src), "-o", str(tmp_path / "m.o")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, "host mirror disagrees with the device struct:\n" + out.stdout + out.stderr


def _nvshmem_or_skip():
    if not libraries.nvshmem_info().get("include_dir"):
        pytest.skip("no NVSHMEM headers here (pip install nvidia-nvshmem-cu13)")


# ---- kernels without a transport ----------------------------------------------------------------------

@needs_nvcc
def test_intranode_params(tmp_path):
    defines = dict(NUM_RANKS=4, HIDDEN_BYTES=256, HIDDEN=128, NUM_TOPK=2, NUM_SCALES=2)

    def path(name: str) -> str:   # the control offsets are a nested ControlLayout `ctrl`
        return f"ctrl.{name[len('ctrl_'):]}" if name.startswith("ctrl_") else name

    _compile(tmp_path, intranode.DISPATCH_SOURCE, _asserts("DispatchParams", intranode.DispatchParams, path), defines)
    _compile(tmp_path, intranode.COMBINE_SOURCE, _asserts("CombineParams", intranode.CombineParams, path), defines)


@needs_nvcc
def test_layout_and_benchmark_params(tmp_path):
    _compile(tmp_path, dispatch_layout.LAYOUT_SOURCE, _asserts("LayoutParams", dispatch_layout.LayoutParams),
             {})
    checks = (_asserts("CopyParams", copy_kernels.CopyParams)
              + _asserts("CopySegmentsParams", copy_kernels.CopySegmentsParams)
              + _asserts("StartLineParams", copy_kernels.StartLineParams))
    _compile(tmp_path, copy_kernels.COPY_SOURCE, checks, {})
    _compile(tmp_path, handle_kernel.SOURCE, _asserts("HandleParams", handle_kernel.HandleParams), {})


# ---- kernels over the transport contract, per backend -----------------------------------------------

def _ll_checks(transport_struct: type, c_transport: str, op: str) -> List[str]:
    mirrors = dict(zip(("dispatch", "combine", "clean"), ll.params_types(transport_struct)))
    common = {"transport", *ll._COMMON}

    def path(name: str) -> str:   # Common is nested as `c` in the C structs
        return f"c.{name}" if name in common else name

    c_struct = {"dispatch": "LLDispatchParams", "combine": "LLCombineParams", "clean": "LLCleanParams"}[op]
    ns = "deepep_portable::low_latency"
    constants = [f'static_assert({ns}::kMaxStageBlocks == {L.LL_MAX_STAGE_BLOCKS}, "stage flags");',
                 f'static_assert({ns}::kThreads == {ll.THREADS}, "threads");',
                 f'static_assert({ns}::kMsgHeader == {L.LL_MSG_HEADER}, "message head");']
    return _asserts(c_transport, transport_struct) + _asserts(c_struct, mirrors[op], path) + constants


def _selftest_checks(transport_struct: type, c_transport: str) -> List[str]:
    return _asserts(c_transport, transport_struct) + _asserts("SelftestParams",
                                                              transport_selftest.params_type(transport_struct))


@needs_nvcc
@pytest.mark.parametrize("shareable", [True, False])
def test_nvlink_backend_params(tmp_path, shareable):
    build, c_struct = nvlink_build(shareable), "deepep_portable::transport::NvlinkTransport"
    cheap = f'static_assert(deepep_portable::transport::Selected::kCheapFetchAdd == {str(shareable).lower()}, ' \
            f'"NvlinkWindow.cheap_fetch_add is the kernels\' kCheapFetchAdd");'
    shape = ll.kernel_defines(256, 3)
    _compile(tmp_path, ll.DISPATCH_SOURCE, _ll_checks(NvlinkTransportParams, c_struct, "dispatch") + [cheap], shape,
             build)
    for phase in (ll.PHASE_SEND, ll.PHASE_RECV):
        _compile(tmp_path, ll.COMBINE_SOURCE, _ll_checks(NvlinkTransportParams, c_struct, "combine"),
                 ll.kernel_defines(512, 3, True, phase), build)
    _compile(tmp_path, ll.CLEAN_SOURCE, _ll_checks(NvlinkTransportParams, c_struct, "clean"), {}, build)
    _compile(tmp_path, transport_selftest.SOURCE, _selftest_checks(NvlinkTransportParams, c_struct), {}, build)


@needs_nvcc
def test_nvshmem_backend_params(tmp_path):
    _nvshmem_or_skip()
    from deepep_portable.transports.nvshmem.abi import NvshmemTransportParams
    from deepep_portable.transports.nvshmem.window import NVSHMEM_BUILD, NvshmemWindow

    c_struct = "deepep_portable::transport::NvshmemTransport"
    cheap = f'static_assert(deepep_portable::transport::Selected::kCheapFetchAdd == ' \
            f'{str(NvshmemWindow.cheap_fetch_add).lower()}, "NvshmemWindow.cheap_fetch_add");'
    _compile(tmp_path, ll.DISPATCH_SOURCE, _ll_checks(NvshmemTransportParams, c_struct, "dispatch") + [cheap],
             ll.kernel_defines(256, 3), NVSHMEM_BUILD, nvshmem=True)
    for phase in (ll.PHASE_SEND, ll.PHASE_RECV):
        _compile(tmp_path, ll.COMBINE_SOURCE, _ll_checks(NvshmemTransportParams, c_struct, "combine"),
                 ll.kernel_defines(256, 3, False, phase), NVSHMEM_BUILD, nvshmem=True)
    _compile(tmp_path, ll.CLEAN_SOURCE, _ll_checks(NvshmemTransportParams, c_struct, "clean"), {},
             NVSHMEM_BUILD, nvshmem=True)
    _compile(tmp_path, transport_selftest.SOURCE, _selftest_checks(NvshmemTransportParams, c_struct), {},
             NVSHMEM_BUILD, nvshmem=True)


def _internode_checks(transport_struct: type, c_transport: str, op: str, shape: dict) -> List[str]:
    """The internode params (Common nested as `common`) and the slot / row constants the host layout repeats."""
    from deepep_portable import internode_layout as IL
    from deepep_portable.engines import internode

    common_t, dispatch_t, combine_t, ceiling_t = internode.params_types(transport_struct)
    regions = IL.InternodeRegions(shape["NUM_RANKS"], shape["RANKS_PER_NODE"])
    ns = "deepep_portable::internode"
    checks = _asserts(c_transport, transport_struct) + _asserts(f"{ns}::Common", common_t)
    checks += [f'static_assert({ns}::kChunkTokens == {IL.INTERNODE_CHUNK_TOKENS}, "chunk tokens");',
               f'static_assert({ns}::kMaxChunks == {IL.INTERNODE_MAX_CHUNKS}, "max chunks");',
               f'static_assert({ns}::kThreads == {internode.THREADS}, "threads");']
    if op == "dispatch":
        lay = IL.InternodeDispatchLayout(regions, shape["HIDDEN_BYTES"], shape["NUM_SCALES"], shape["NUM_TOPK"])
        checks += _asserts("InternodeDispatchParams", dispatch_t)
        checks += [f'static_assert({ns}::kBodyBytes == {lay.body_bytes}, "body bytes");',
                   f'static_assert({ns}::kMetaBytes == {lay.meta_bytes}, "meta bytes");',
                   f'static_assert({ns}::kSlotBytes == {lay.slot_bytes}, "slot bytes");']
    elif op == "combine":
        lay = IL.InternodeCombineLayout(regions, shape["HIDDEN"], shape["NUM_TOPK"])
        checks += _asserts("InternodeCombineParams", combine_t)
        checks += [f'static_assert({ns}::kRowBytes == {lay.row_bytes}, "row bytes");']
    else:
        checks += _asserts("TrafficCeilingParams", ceiling_t)
    return checks


INTERNODE_SHAPES = [("dispatch", dict(NUM_RANKS=16, RANKS_PER_NODE=8, HIDDEN_BYTES=7168, NUM_SCALES=56, NUM_TOPK=8)),
                    ("dispatch", dict(NUM_RANKS=6, RANKS_PER_NODE=1, HIDDEN_BYTES=4096 * 2, NUM_SCALES=0, NUM_TOPK=0)),
                    ("dispatch", dict(NUM_RANKS=8, RANKS_PER_NODE=2, HIDDEN_BYTES=2560, NUM_SCALES=20, NUM_TOPK=9)),
                    ("combine", dict(NUM_RANKS=16, RANKS_PER_NODE=8, HIDDEN=7168, NUM_TOPK=8)),
                    ("combine", dict(NUM_RANKS=144, RANKS_PER_NODE=72, HIDDEN=1280, NUM_TOPK=0)),
                    ("ceiling", dict(NUM_RANKS=16, RANKS_PER_NODE=8))]


@needs_nvcc
@pytest.mark.parametrize("op,shape", INTERNODE_SHAPES)
def test_internode_params_and_sm90_compile(tmp_path, op, shape):
    """The internode kernels compile for sm_90 for every backend build that can carry them (nvshmem; the
    nvlink build too: the kernels use nothing beyond the contract) and their params / layout constants
    match the host's."""
    from deepep_portable.engines import internode

    source = {"dispatch": internode.DISPATCH_SOURCE, "combine": internode.COMBINE_SOURCE,
              "ceiling": internode.CEILING_SOURCE}[op]
    c_nvlink = "deepep_portable::transport::NvlinkTransport"
    _compile(tmp_path, source, _internode_checks(NvlinkTransportParams, c_nvlink, op, shape), shape,
             nvlink_build(True))
    if libraries.nvshmem_info().get("include_dir"):
        from deepep_portable.transports.nvshmem.abi import NvshmemTransportParams
        from deepep_portable.transports.nvshmem.window import NVSHMEM_BUILD

        c_nvshmem = "deepep_portable::transport::NvshmemTransport"
        _compile(tmp_path, source, _internode_checks(NvshmemTransportParams, c_nvshmem, op, shape), shape,
                 NVSHMEM_BUILD, nvshmem=True)


@needs_nvcc
def test_ibgda_backend_params(tmp_path):
    """The ibgda device structs (sq.cuh, ops.cuh, device.cuh) against their mirrors, and every kernel over the
    contract (the self-test, the low-latency and internode ops) compiled for sm_90 with the ibgda backend."""
    from deepep_portable.engines import internode
    from deepep_portable.transports.ibgda.abi import (IBGDA_BUILD, SCRATCH_WORDS, EndpointParams,
                                                      IbgdaTransportParams, SendQueueParams)

    c_struct = "deepep_portable::transport::IbgdaTransport"
    structs = (_asserts("deepep_portable::ibgda::SendQueue", SendQueueParams) +
               _asserts("deepep_portable::ibgda::Endpoint", EndpointParams) +
               [f'static_assert({c_struct}::kScratchWords == {SCRATCH_WORDS}, "scratch words");',
                f'static_assert(!{c_struct}::kCheapFetchAdd, "a network fetch_add is not cheap");'])
    _compile(tmp_path, transport_selftest.SOURCE, structs + _selftest_checks(IbgdaTransportParams, c_struct), {},
             IBGDA_BUILD)
    _compile(tmp_path, ll.DISPATCH_SOURCE, _ll_checks(IbgdaTransportParams, c_struct, "dispatch"),
             ll.kernel_defines(7168, 8), IBGDA_BUILD)
    for phase in (ll.PHASE_SEND, ll.PHASE_RECV):
        _compile(tmp_path, ll.COMBINE_SOURCE, _ll_checks(IbgdaTransportParams, c_struct, "combine"),
                 ll.kernel_defines(7168, 8, True, phase), IBGDA_BUILD)
    _compile(tmp_path, ll.CLEAN_SOURCE, _ll_checks(IbgdaTransportParams, c_struct, "clean"), {}, IBGDA_BUILD)
    for op, shape in INTERNODE_SHAPES[:1] + INTERNODE_SHAPES[3:4]:
        source = {"dispatch": internode.DISPATCH_SOURCE, "combine": internode.COMBINE_SOURCE,
              "ceiling": internode.CEILING_SOURCE}[op]
        _compile(tmp_path, source, _internode_checks(IbgdaTransportParams, c_struct, op, shape), shape, IBGDA_BUILD)


# ---- records and constants ----------------------------------------------------------------------------

def _read(rel: str) -> str:
    with open(os.path.join(jit.kernel_root(), rel)) as f:
        return f.read()


def _c_members(text: str, struct: str) -> List[str]:
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return [re.findall(r"[A-Za-z_]\w*", d)[-1] for d in body.split(";") if d.strip()]


def test_capabilities_fields_by_name_and_order():
    assert _c_members(_read("common/kernels/transport.cuh"), "Capabilities") == \
        [f.name for f in dataclasses.fields(Capabilities)]
    with pytest.raises(TypeError):
        Capabilities(True, False, True, 1, True, "none")   # keyword only: a positional list hides swaps


def _constant(rel: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", _read(rel))
    assert m, f"{name} not in {rel}"
    return int(m.group(1))


def test_kernel_constants_the_host_repeats():
    assert intranode.THREADS == _constant("common/kernels/intranode/protocol.cuh", "kThreads")
    assert ll.THREADS == _constant("common/kernels/low_latency/protocol.cuh", "kThreads")
    assert ll.TRACE_CALLS == _constant("common/kernels/low_latency/protocol.cuh", "kTraceCalls")
    assert dispatch_layout.LAYOUT_THREADS == _constant(dispatch_layout.LAYOUT_SOURCE, "kThreads")
    assert handle_kernel.THREADS == _constant(handle_kernel.SOURCE, "kThreads")
    st = transport_selftest
    assert st.THREADS == _constant(st.SOURCE, "kThreads")
    assert (st.OUT_MISMATCHES, st.OUT_GET_VALUE, st.OUT_WAITS, st.OUT_TIMED_OUT, st.OUT_PEER_PTR) == tuple(
        _constant(st.SOURCE, n) for n in ("kOutMismatches", "kOutGetValue", "kOutWaits", "kOutTimedOut", "kOutPeerPtr"))
    names = re.search(r"enum TraceKernel : int \{(.*?)\};", _read("common/kernels/low_latency/protocol.cuh"), re.S)
    kernels = [re.sub(r"(?<!^)(?=[A-Z])", "_", n[len("kTrace"):]).lower()
               for n in re.findall(r"kTrace\w+", names.group(1))]
    assert kernels[:-1] == list(ll.TRACE_KERNELS) and kernels[-1] == "kernels"


def test_error_table_is_read_from_the_device_header():
    codes, ops = errors.table()
    assert codes == {"none": 0, "timeout": 1, "capacity": 2, "overrun": 3, "overwrite": 4, "nic": 5, "unsupported": 6}
    assert ops == {1: "dispatch", 2: "combine", 3: "low_latency_dispatch", 4: "low_latency_combine",
                   5: "transport_selftest", 6: "low_latency_clean"}
    # the decoder names the op and the peer from any record
    timeout = errors.from_record((1, 3, 2, 5, 7, 0), 3.0)
    assert isinstance(timeout, errors.CommTimeoutError) and timeout.op == "low_latency_dispatch"
    assert (timeout.rank, timeout.peer, timeout.channel) == (2, 5, 7)
    assert "num_worst_tokens" in str(errors.from_record((2, 1, 0, -1, 0, 99), 1.0))
    assert "rank 3 would receive 99 rows" in str(errors.from_record((2, 1, 0, 3, 0, 99), 1.0))
    # a backend's own code, decoded by the backend its registry row points at (ibgda: the failed QP's channel, the
    # syndrome); without that decoder, only the code
    nic = str(errors.from_record((5, 3, 0, 5, 2, 0x13), 1.0, registry.error_text("ibgda")))
    assert "queue pair to peer 5 (channel 2) failed" in nic and "syndrome 0x13" in nic
    assert "kernel error code 5" in str(errors.from_record((5, 3, 0, 5, 2, 0x13), 1.0, registry.error_text("nvlink")))
    assert "two calls ahead" in str(errors.from_record((3, 4, 0, 2, 0, 9), 1.0, registry.error_text("ibgda")))
    assert "recv_x it returned" in str(errors.from_record((3, 3, 0, -1, 0, 1), 1.0))
    assert "zero-copy combine buffer" in str(errors.from_record((3, 4, 0, -1, 0, 1), 1.0))
    assert "two calls ahead" in str(errors.from_record((3, 4, 0, 2, 0, 9), 1.0))
    assert "still receiving" in str(errors.from_record((4, 3, 0, 2, 0, 9), 1.0))
    assert "kernel error code 77" in str(errors.from_record((77, 9, 0, 2, 0, 9), 1.0))
    assert "peer 3 (channel 0) failed: an error completion, syndrome 0x13" in str(
        errors.from_record((5, 1, 0, 3, 0, 0x13), 1.0, registry.error_text("ibgda")))
    assert "no completion within the timeout" in str(errors.from_record((5, 1, 0, 3, 0, -1), 1.0,
                                                                         registry.error_text("ibgda")))
