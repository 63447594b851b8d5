"""The nccl_gin backend's host glue (deepep_portable/transports/nccl_gin/host.py over
csrc/backends/nccl_gin/host.cc), without a GPU: compiled against the headers of the libnccl this process
loads (the nvidia-nccl wheel in CI) and linked to it; the version gate; the device-communicator requirements
as the installed version builds them. Skips without NCCL headers or nvcc."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
from types import SimpleNamespace

import pytest

from deepep_portable.transports import libraries


@pytest.fixture(scope="module")
def glue():
    info = libraries.nccl_info()
    if info.get("lib") is None or info.get("device_header") is None:
        pytest.skip("no libnccl.so.2 with nccl_device.h here")
    from deepep_portable import jit
    from deepep_portable.transports.nccl_gin import host

    try:
        jit.find_nvcc()
    except Exception as e:  # pragma: no cover - CI installs a compiler
        pytest.skip(f"no nvcc: {e}")
    return host, host.HostLib()


def test_headers_are_the_loaded_librarys(glue):
    host, lib = glue
    info = libraries.nccl_info()
    assert lib.header_version == info["header_version_code"] == info["version_code"]
    assert lib.check_versions() == info["version_code"]


def test_a_header_library_mismatch_is_refused(glue, monkeypatch):
    host, lib = glue
    monkeypatch.setattr(lib, "runtime_version", lambda: lib.header_version + 1)
    with pytest.raises(RuntimeError, match="the device API needs the loaded library's own headers"):
        lib.check_versions()


def test_lsa_only_requirements_request_no_gin_resource(glue):
    """What makes a NIC-less node work: no GIN connection, no indexed signals or counters, and LSA barriers
    instead of the hybrid barrierCount (which counts as a GIN resource from 2.29.7)."""
    host, lib = glue
    raw, f = lib.requirements(host.Request(lsa_barriers=6))
    assert len(raw) == lib.lib.dgin_requirements_size()
    assert f["lsaBarrierCount"] == 6 and f["barrierCount"] == 0 and f["lsaMultimem"] == 0
    assert f["ginSignalCount"] == 0 and f["ginCounterCount"] == 0
    if lib.header_version >= 22907:
        assert f["ginConnectionType"] == 0   # NCCL_GIN_CONNECTION_NONE
    if lib.header_version >= 22900:        # the initializer's size and magic, not a zeroed struct
        assert f["size"] == len(raw) and f["magic"] != 0


def test_gin_requirements(glue):
    host, lib = glue
    _, f = lib.requirements(host.Request(gin=True, gin_contexts=8))
    assert f["ginContextCount"] == 8 and f["ginSignalCount"] == 0
    if lib.header_version >= 22907:
        assert f["ginConnectionType"] == 1   # NCCL_GIN_CONNECTION_FULL
    if lib.header_version >= 23007:
        assert f["ginVaSignalsRequired"] == 1   # the SET emulation adds to VA signals in our window
    if lib.header_version < 23004:
        with pytest.raises(ValueError, match="ginTrafficClass needs NCCL >= 2.30.4"):
            lib.requirements(host.Request(gin=True, gin_traffic_class=106))
    else:
        lib.requirements(host.Request(gin=True, gin_traffic_class=106))


def test_torch_communicator_reuse_rules(tmp_path, monkeypatch):
    """torch_comm.py: a torch NCCL group's communicator is reused only through ProcessGroupNCCL._comm_ptr, with a
    non-zero pointer (after the warm-up collective every rank runs), exactly one libnccl.so mapped (plugins do
    not count) that is our glue's, loaded by libtorch_cuda.so dynamically, at torch's NCCL version; the choice is
    collective. Everything else gives a reason, never an exception."""
    import shutil
    import sys

    import torch

    from deepep_portable.transports.nccl_gin import options as nccl_opts
    from deepep_portable.transports.nccl_gin import torch_comm as tc

    lib = tmp_path / "libnccl.so.2.28.9"
    other = tmp_path / "other" / "libnccl.so.2"
    other.parent.mkdir()
    for f in (lib, other, tmp_path / "libnccl-net.so"):
        f.write_bytes(b"")
    # A real ELF that needs libnccl.so.2 would need a toolchain: take this interpreter's needs instead and check
    # the parser on it, then stand a fake libtorch_cuda.so in whose DT_NEEDED we control through elf_needed.
    needed = tc.elf_needed(os.path.realpath(sys.executable)) or []
    assert tc.elf_needed(str(lib)) is None and all(isinstance(n, str) for n in needed)
    if shutil.which("readelf") and needed:
        out = subprocess.run(["readelf", "-d", os.path.realpath(sys.executable)], capture_output=True, text=True).stdout
        assert needed == re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out)
    torch_cuda = tmp_path / "libtorch_cuda.so"
    torch_cuda.write_bytes(b"")
    maps = tmp_path / "maps"
    line = "7f00-7f10 r-xp 00000000 08:01 123 {}\n"
    maps.write_text(line.format(lib) + line.format(lib) + "7f20-7f30 rw-p 00000000 00:00 0\n"
                    + line.format(tmp_path / "libnccl-net.so") + line.format(torch_cuda)
                    + "7f40-7f50 r--p 0 0:0 0 [heap]\n")
    assert tc.mapped_libraries("libnccl.so", str(maps)) == [str(lib)]
    assert tc.mapped_libraries("libnccl.so", str(tmp_path / "absent")) == []
    monkeypatch.setattr(tc, "elf_needed", lambda p: ["libnccl.so.2", "libc.so.6"] if p == str(torch_cuda) else None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "nccl", SimpleNamespace(version=lambda: (2, 28, 9)), raising=False)

    class ProcessGroupNCCL:
        def __init__(self):
            self.ptr, self.warm = 0, 0

        def _comm_ptr(self):
            return self.ptr

    class Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            return self.backend

    b = ProcessGroupNCCL()

    def warm_up():
        b.warm += 1
        b.ptr = 0xABC0

    def cand(group, warm=None, version=22809):
        return tc.local_candidate(group, "cpu", str(lib), version, warm, str(maps))

    assert cand(Group(b), warm_up) == (0xABC0, "") and b.warm == 1
    assert tc.still_owned(Group(b), "cpu", 0xABC0) and not tc.still_owned(Group(b), "cpu", 0x1)
    assert "torch reports NCCL 22809, our glue's library is 23000" in cand(Group(b), None, 23000)[1]
    b.ptr = 0
    assert "has not created" in cand(Group(b))[1]
    b.ptr = 5
    monkeypatch.setattr(tc, "elf_needed", lambda p: ["libc.so.6"])
    assert "does not load libnccl.so dynamically" in cand(Group(b))[1]
    maps.write_text(line.format(lib) + line.format(other))
    ptr, why = cand(Group(b))
    assert ptr == 0 and "only valid inside the library copy" in why and str(other) in why
    assert "no torch NCCL backend" in cand(Group(object()))[1] and "no torch NCCL backend" in cand(None)[1]

    class ProcessGroupNCCLOld:
        pass
    ProcessGroupNCCLOld.__name__ = "ProcessGroupNCCL"
    assert "no ProcessGroupNCCL._comm_ptr" in cand(Group(ProcessGroupNCCLOld()))[1]

    class Broken:
        def _get_backend(self, device):
            raise RuntimeError("no group")
    assert "not reachable (RuntimeError: no group)" in cand(Broken())[1]
    assert tc.collective_choice([(1, ""), (2, "")]) == (True, "torch's NCCL communicator of the Buffer's group")
    assert tc.collective_choice([(1, ""), (0, "why")]) == (False, "rank 1: why")
    nccl_opts.nccl_environment({"reuse_torch_comm": False})
    with pytest.raises(ValueError, match="reuse_torch_comm"):
        nccl_opts.nccl_environment({"reuse_torch_comm": "yes"})
