"""The nccl_gin backend's host glue (deepep_portable/transports/nccl_gin/host.py over
csrc/backends/nccl_gin/host.cc), without a GPU: compiled against the headers of the libnccl this process
loads (the nvidia-nccl wheel in CI) and linked to it; the version gate; the device-communicator requirements
as the installed version builds them. Skips without NCCL headers or nvcc."""
from __future__ import annotations

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
    """torch_comm.py: a torch NCCL group's communicator is reused only with torch's _comm_ptr, a non-zero pointer
    (after the warm-up collective every rank runs), and exactly one libnccl mapped, the one our glue links; the
    choice is collective. Everything else gives a reason, never an exception."""
    import torch.distributed as dist

    from deepep_portable.transports.nccl_gin import options as nccl_opts
    from deepep_portable.transports.nccl_gin.torch_comm import collective_choice, local_candidate, mapped_libraries

    lib = tmp_path / "libnccl.so.2.28.9"
    other = tmp_path / "other" / "libnccl.so.2"
    other.parent.mkdir()
    for f in (lib, other):
        f.write_bytes(b"")
    maps = tmp_path / "maps"
    line = "7f00-7f10 r-xp 00000000 08:01 123 {}\n"
    maps.write_text(line.format(lib) + line.format(lib) + "7f20-7f30 rw-p 00000000 00:00 0\n"
                    + line.format(tmp_path / "libtorch.so") + "7f40-7f50 r--p 0 0:0 0 [heap]\n")
    assert mapped_libraries("libnccl", str(maps)) == [str(lib)]
    assert mapped_libraries("libnccl", str(tmp_path / "absent")) == []

    class Backend:
        def __init__(self):
            self.ptr, self.warm = 0, 0

        def _comm_ptr(self):
            return self.ptr

    class Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            return self.backend

    b = Backend()

    def warm_up():
        b.warm += 1
        b.ptr = 0xABC0

    monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
    assert local_candidate(Group(b), str(lib), "cuda", warm_up, str(maps)) == (0xABC0, "")
    assert b.warm == 1
    b.ptr = 0
    assert "has not created" in local_candidate(Group(b), str(lib), "cuda", None, str(maps))[1]
    b.ptr = 5
    maps.write_text(line.format(lib) + line.format(other))
    ptr, why = local_candidate(Group(b), str(lib), "cuda", None, str(maps))
    assert ptr == 0 and "only valid inside the library copy" in why and str(other) in why
    assert "no ProcessGroupNCCL._comm_ptr" in local_candidate(Group(object()), str(lib), "cuda", None, str(maps))[1]
    monkeypatch.setattr(dist, "get_backend", lambda g: "gloo")
    assert "not a torch NCCL group" in local_candidate(Group(b), str(lib), "cuda", None, str(maps))[1]
    monkeypatch.setattr(dist, "get_backend", lambda g: (_ for _ in ()).throw(RuntimeError("no group")))
    assert "not reachable (RuntimeError: no group)" in local_candidate(Group(b), str(lib), "cuda", None, str(maps))[1]
    assert collective_choice([(1, ""), (2, "")]) == (True, "torch's NCCL communicator of the Buffer's group")
    assert collective_choice([(1, ""), (0, "why")]) == (False, "rank 1: why")
    nccl_opts.nccl_environment({"reuse_torch_comm": False})
    with pytest.raises(ValueError, match="reuse_torch_comm"):
        nccl_opts.nccl_environment({"reuse_torch_comm": "yes"})
