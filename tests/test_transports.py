"""Transport registry and capability probing (CPU only).

On a machine without GPU / RDMA NIC (CI) every accelerated transport must be unusable with a
reason naming the missing thing; the probe logic itself is exercised against fake library trees,
a fake sysfs and a fake backend module, so its "usable" paths are tested here too.
"""
from __future__ import annotations

import importlib.machinery
import io
import os
import sys
import types

import pytest

import deepep_portable
import deepep_portable.transports as transports
from deepep_portable.transports import TRANSPORT_NAMES, TransportStatus, available_transports
from deepep_portable.transports import libraries, probe, rdma, registry, system
from deepep_portable.transports.ibgda import probe as ibgda_probe
from deepep_portable.transports.nccl_gin import probe as nccl_gin_probe
from deepep_portable.transports.nvshmem import probe as nvshmem_probe

ACCELERATED = ["nvshmem", "ibgda", "nccl_gin"]
HAS_GPU = system.driver_status()[0]
needs_no_gpu = pytest.mark.skipif(HAS_GPU, reason="this machine has a usable CUDA GPU")


@pytest.fixture
def fresh_probe():
    probe.clear_cache()
    yield probe
    probe.clear_cache()


def _backend_exists(name: str) -> bool:
    return registry.BY_NAME[name].module is not None


# ---------------------------------------------------------------------------- the registry

def test_available_transports_lists_every_transport():
    st = available_transports()
    assert set(st) == {"reference", "nvshmem", "ibgda", "nccl_gin", "nvlink"} == set(TRANSPORT_NAMES)
    for name, s in st.items():
        assert isinstance(s, TransportStatus)
        assert s.name == name
        assert isinstance(s.reason, str) and s.reason
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in s.details.items())


def test_reference_is_usable():
    s = available_transports()["reference"]
    assert s.usable, s.reason
    assert s.details["cuda_visible"] in ("True", "False")
    assert "gloo" in s.details["process_group_backends"]


@needs_no_gpu
@pytest.mark.parametrize("name", ACCELERATED)
def test_accelerated_unusable_without_gpu(name):
    s = available_transports()[name]
    assert not s.usable
    assert "no CUDA GPU" in s.reason, s.reason
    assert name in str(s)


@pytest.mark.parametrize("name", ACCELERATED)
def test_unimplemented_backend_is_named(name):
    if _backend_exists(name):
        pytest.skip(f"the {name} backend exists in this build")
    s = available_transports()[name]
    assert not s.usable
    assert f"the {name} backend is not implemented in this build yet" in s.reason


@pytest.mark.skipif(os.path.isdir(rdma.SYSFS_INFINIBAND), reason="this machine has RDMA devices")
def test_ibgda_names_missing_rdma_device():
    s = available_transports()["ibgda"]
    assert not s.usable
    assert "no RDMA device in /sys/class/infiniband" in s.reason


def test_auto_prefers_nvlink_on_one_node_only(monkeypatch):
    usable = {"nvshmem", "nvlink", "reference"}
    fake = {n: transports.TransportStatus(n, n in usable, "fake") for n in TRANSPORT_NAMES}
    monkeypatch.setattr(transports, "available_transports", lambda: fake)
    assert transports.resolve("auto", single_node=True) == "nvlink"
    assert transports.resolve("auto", single_node=False) == "nvshmem"
    usable.discard("nvshmem")
    fake["nvshmem"] = transports.TransportStatus("nvshmem", False, "fake")
    assert transports.resolve("auto", single_node=False) == "reference"


def test_auto_never_picks_a_backend_that_has_not_run(monkeypatch):
    """nccl_gin is asked for by name only until it has run on a GPU (registry in_auto)."""
    usable = {"nccl_gin", "reference"}
    fake = {n: transports.TransportStatus(n, n in usable, "fake") for n in TRANSPORT_NAMES}
    monkeypatch.setattr(transports, "available_transports", lambda: fake)
    assert transports.resolve("auto", single_node=False) == "reference"
    assert transports.resolve("auto", single_node=True, internode_normal=True) == "reference"
    assert transports.resolve("nccl_gin") == "nccl_gin"


def test_auto_over_several_nodes_takes_the_internode_kernels(monkeypatch):
    """Normal mode over several nodes: the kernels' backend when usable (nvshmem: its suites passed on the
    H200 over logical nodes), else the reference transport; never nvlink (it has no network path)."""
    usable = {"nvshmem", "nvlink", "reference"}
    fake = {n: transports.TransportStatus(n, n in usable, "fake") for n in TRANSPORT_NAMES}
    monkeypatch.setattr(transports, "available_transports", lambda: fake)
    assert "nvlink" not in transports.internode_normal_transports()
    assert transports.resolve("auto", single_node=True, internode_normal=True) == "nvshmem"
    fake["nvshmem"] = transports.TransportStatus("nvshmem", False, "fake")
    assert transports.resolve("auto", single_node=True, internode_normal=True) == "reference"


def test_probe_is_cached():
    assert probe.probe("reference") is probe.probe("reference")


def test_resolve():
    assert transports.resolve("reference") == "reference"
    assert transports.resolve("auto") in TRANSPORT_NAMES
    assert transports.resolve("auto", single_node=False) != "nvlink"   # IPC cannot span nodes
    with pytest.raises(ValueError, match="unknown transport 'bogus'"):
        transports.resolve("bogus")
    with pytest.raises(ValueError):
        probe.probe("bogus")
    for name in ACCELERATED:
        s = available_transports()[name]
        if not s.usable:
            with pytest.raises(RuntimeError, match="unavailable") as e:
                transports.resolve(name)
            assert s.reason in str(e.value)


@needs_no_gpu
def test_driver_status_reason():
    ok, reason, source = system.driver_status()
    assert not ok
    assert reason.startswith("no CUDA GPU: "), reason
    assert source
    assert system.gpu_info() == []


# ------------------------------------------------------------------- NVSHMEM against fakes

def _fake_nvshmem(tmp_path):
    lib = tmp_path / "nvshmem" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvshmem_host.so.3").write_bytes(b"")
    return lib


def test_nvshmem_not_found_lists_search_path(fresh_probe, monkeypatch, tmp_path):
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr(libraries, "_site_dirs", lambda: [str(tmp_path / "site")])
    monkeypatch.setattr(libraries, "_SYSTEM_LIB_DIRS", [])
    monkeypatch.setattr(libraries, "_ldconfig_cache", lambda: {})
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    s = nvshmem_probe.probe_nvshmem()
    assert not s.usable
    assert "libnvshmem_host.so.3 not found" in s.reason
    assert str(tmp_path / "nowhere" / "lib" / "libnvshmem_host.so.3") in s.reason
    assert str(tmp_path / "site" / "nvidia/nvshmem/lib" / "libnvshmem_host.so.3") in s.reason


def test_nvshmem_needs_device_library(fresh_probe, monkeypatch, tmp_path):
    lib = _fake_nvshmem(tmp_path)
    monkeypatch.setenv("NVSHMEM_HOME", str(lib.parent))
    s = nvshmem_probe.probe_nvshmem()
    assert not s.usable
    assert f"found at {lib / 'libnvshmem_host.so.3'} but no device library" in s.reason
    assert s.details["host_lib"] == str(lib / "libnvshmem_host.so.3")


@pytest.fixture
def fake_backend(monkeypatch):
    """Pretend backend <name> is built: its registry row names a module that imports."""
    def make(name):
        mod_name = f"deepep_portable.transports._fake_{name}"
        mod = types.ModuleType(mod_name)
        mod.__spec__ = importlib.machinery.ModuleSpec(mod_name, None)
        monkeypatch.setitem(sys.modules, mod_name, mod)
        row = registry.BY_NAME[name]
        monkeypatch.setitem(registry.BY_NAME, name, type(row)(row.name, f"._fake_{name}", "Fake", row.probe,
                                                               row.spans_nodes))
    return make


def test_nvshmem_usable_path(fresh_probe, monkeypatch, tmp_path, fake_backend):
    lib = _fake_nvshmem(tmp_path)
    (lib / "libnvshmem_device.a").write_bytes(b"")
    monkeypatch.setenv("NVSHMEM_HOME", str(lib.parent))
    monkeypatch.setattr(system, "driver_status", lambda: (True, "test GPU", "test"))
    gpus = [{"index": 0, "name": "Fake H200", "cc": "9.0", "sms": 132}]
    monkeypatch.setattr(system, "gpu_info", lambda: gpus)

    if not _backend_exists("nvshmem"):
        s = nvshmem_probe.probe_nvshmem()
        assert not s.usable
        assert s.reason == (f"libraries found at {lib} but the nvshmem backend is not implemented "
                            "in this build yet")
    fake_backend("nvshmem")
    s = nvshmem_probe.probe_nvshmem()
    assert s.usable, s.reason
    assert s.details["device_libs"] == str(lib / "libnvshmem_device.a")

    gpus[0] = {"index": 0, "name": "Fake P100", "cc": "6.0", "sms": 56}
    s = nvshmem_probe.probe_nvshmem()
    assert not s.usable
    assert "GPU 0 (Fake P100) has compute capability 6.0; NVSHMEM needs >= 7.0" in s.reason


def test_real_nvshmem_wheel_layout(fresh_probe):
    info = libraries.nvshmem_info()
    if not info["pip"]:
        pytest.skip("nvidia-nvshmem-cu1x is not installed")
    if os.environ.get("NVSHMEM_HOME"):
        pytest.skip("NVSHMEM_HOME overrides the pip package")
    assert info["host_lib"] and info["host_lib"].endswith("nvidia/nvshmem/lib/libnvshmem_host.so.3")
    assert any(p.endswith(".a") or p.endswith(".bc") for p in info["device_libs"])
    assert info["version"] and info["version"].split(".")[0] == "3", info


# ---------------------------------------------------------------------------------- NCCL

def test_nccl_version_code():
    assert libraries._nccl_version_tuple(22803) == (2, 28, 3)
    assert libraries._nccl_version_tuple(23203) == (2, 32, 3)
    assert libraries._nccl_version_tuple(2708) == (2, 7, 8)


def test_nccl_not_found_lists_search_path(fresh_probe, monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_HOME", str(tmp_path / "nccl"))
    monkeypatch.setattr(libraries, "_site_dirs", lambda: [])
    monkeypatch.setattr(libraries, "_SYSTEM_LIB_DIRS", [])
    monkeypatch.setattr(libraries, "_ldconfig_cache", lambda: {})
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    s = nccl_gin_probe.probe_nccl_gin()
    assert not s.usable
    assert f"libnccl.so.2 not found (searched: {tmp_path / 'nccl' / 'lib' / 'libnccl.so.2'}" in s.reason


def test_nccl_without_gin_is_named(fresh_probe, monkeypatch):
    """2.28.3 had the device API with LSA only; GIN arrived in 2.28.7 (shared/research/NCCL_GIN.md)."""
    fake = dict(lib="/x/libnccl.so.2", version="2.28.3", version_code=22803, device_header="/x/nccl_device.h",
                searched=[], header_searched=[], pip={})
    monkeypatch.setattr(nccl_gin_probe, "nccl_info", lambda: fake)
    s = nccl_gin_probe.probe_nccl_gin()
    assert not s.usable and "NCCL 2.28.3 at /x/libnccl.so.2 has no GIN device API (needs >= 2.28.7)" in s.reason


def test_real_nccl_wheel(fresh_probe):
    info = libraries.nccl_info()
    if not info["pip"] or os.environ.get("NCCL_HOME"):
        pytest.skip("nvidia-nccl-cu1x not installed or NCCL_HOME overrides it")
    assert info["lib"].endswith("nvidia/nccl/lib/libnccl.so.2")
    assert info["version"], info
    s = nccl_gin_probe.probe_nccl_gin()
    assert s.details["version"] == info["version"]
    if libraries._nccl_version_tuple(info["version_code"]) >= (2, 28, 0):
        assert info["device_header"] and info["device_header"].endswith("nccl_device.h")
        if not _backend_exists("nccl_gin"):
            assert f"libraries found at {info['lib']} (NCCL {info['version']}" in s.reason


# ---------------------------------------------------------------------------- RDMA / IBGDA

def _fake_sysfs(root, name="mlx5_0", driver="mlx5_core", state="4: ACTIVE", link="Ethernet"):
    dev = root / name
    (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    (dev / "device").mkdir(parents=True)
    os.symlink(root / "drivers" / driver, dev / "device" / "driver")
    (dev / "fw_ver").write_text("28.39.1002\n")
    (dev / "hca_type").write_text("MT4129\n" if driver == "mlx5_core" else "\n")
    port = dev / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "gid_attrs" / "ndevs").mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text(link + "\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    gids = {0: "fe80:0000:0000:0000:0e42:a1ff:fe00:0001", 1: zero,
            3: "0000:0000:0000:0000:0000:ffff:0a00:0001"}
    for i, g in gids.items():
        (port / "gids" / str(i)).write_text(g + "\n")
    (port / "gid_attrs" / "types" / "0").write_text("IB/RoCE v1\n")
    (port / "gid_attrs" / "types" / "3").write_text("RoCE v2\n")
    (port / "gid_attrs" / "ndevs" / "3").write_text("eth0\n")
    return root


def test_sysfs_parsing(tmp_path):
    root = _fake_sysfs(tmp_path / "ib")
    (tmp_path / "ib" / "drivers").rename(tmp_path / "drivers")  # keep only devices under root
    os.remove(root / "mlx5_0" / "device" / "driver")
    os.symlink(tmp_path / "drivers" / "mlx5_core", root / "mlx5_0" / "device" / "driver")
    devs = rdma.rdma_devices_sysfs(str(root))
    assert [d["name"] for d in devs] == ["mlx5_0"]
    d = devs[0]
    assert d["driver"] == "mlx5_core" and d["fw_ver"] == "28.39.1002" and rdma.is_mlx5(d)
    (p,) = d["ports"]
    assert p["port"] == 1 and p["state"] == "4: ACTIVE" and p["link_layer"] == "Ethernet"
    assert [g["index"] for g in p["gids"]] == [0, 3]          # the all-zero entry is dropped
    assert p["gids"][1] == {"index": 3, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0001",
                            "type": "RoCE v2", "netdev": "eth0"}


def test_ibgda_probe_with_fake_devices(tmp_path, fake_backend, monkeypatch):
    root = tmp_path / "ib"
    _fake_sysfs(root, name="rxe0", driver="rdma_rxe")
    os.rename(root / "drivers", tmp_path / "drivers")
    s = ibgda_probe.probe_ibgda(str(root))
    assert not s.usable
    assert "no RDMA device" not in s.reason
    assert "no mlx5 RDMA device (IBGDA writes mlx5 WQEs)" in s.reason and "rxe0" in s.reason

    root2 = tmp_path / "ib2"
    _fake_sysfs(root2, state="1: DOWN")
    s = ibgda_probe.probe_ibgda(str(root2))
    assert "no mlx5 port is ACTIVE: mlx5_0:1 1: DOWN" in s.reason

    root3 = tmp_path / "ib3"
    _fake_sysfs(root3)
    monkeypatch.setattr(system, "driver_status", lambda: (True, "test GPU", "test"))
    fake_backend("ibgda")
    s = ibgda_probe.probe_ibgda(str(root3))
    libs_ok = "libibverbs.so.1" in s.details and "libmlx5.so.1" in s.details
    # An mlx5 port up and the libraries there: usable exactly when the DevX provider's C glue builds.
    from deepep_portable.transports.ibgda.devx_glue import glue_status

    glue_ok, glue_why = glue_status() if libs_ok else (False, "")
    assert s.usable == (libs_ok and glue_ok), s.reason
    if libs_ok:
        assert s.details["devx_glue"] == glue_why
    if s.usable:
        assert "never run on a real NIC" in s.reason
    assert s.details["active_mlx5_ports"] == "mlx5_0:1"


def test_ibgda_probe_with_an_installed_provider(monkeypatch):
    """A NIC provider installed (the tests' NIC model) makes the backend usable wherever a GPU and nvcc are,
    RDMA devices or not; removing it brings the machine's answer back."""
    from deepep_portable.transports.ibgda import provider

    monkeypatch.setattr(system, "driver_status", lambda: (True, "test GPU", "test"))
    try:
        provider.install(lambda ctx: None)
        s = probe.probe("ibgda")
        assert s.reason.startswith("ibgda over an installed NIC provider") or "nvcc" in s.reason, s.reason
    finally:
        provider.install(None)
    assert probe.probe("ibgda").reason != s.reason


def test_a_tests_nic_model_inside_the_sessions_leaves_the_sessions_in_place():
    """The MPI suites' conftest installs the NIC model for a whole pytest run (DEEPEP_TEST_IBGDA_MODEL=1) and a
    test may install its own inside it; leaving the inner one puts the session's back, so a file run after it in
    the same process (verify runs the self-test and the low-latency suite in one) still finds a provider."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ibgda_model
    from deepep_portable.transports.ibgda import provider

    def session(ctx):
        return None

    def inner(ctx):
        return None

    assert provider.installed() is None
    with ibgda_model.installed(session):
        with ibgda_model.installed(inner):
            assert provider.installed() is inner
        assert provider.installed() is session
        with ibgda_model.installed():   # the model itself
            assert provider.installed() not in (None, session)
        assert provider.installed() is session
    assert provider.installed() is None


def test_ibgda_no_sysfs_dir(tmp_path):
    s = ibgda_probe.probe_ibgda(str(tmp_path / "absent"))
    assert not s.usable
    assert f"no RDMA device in {tmp_path / 'absent'} (directory does not exist)" in s.reason


def test_pyverbs_answer():
    mod, why = rdma.pyverbs_module()
    assert (mod is None) == bool(why)
    if mod is None:
        assert why.startswith("pyverbs not importable")
    devs, source = rdma.rdma_devices()
    assert isinstance(devs, list) and source


# ------------------------------------------------------------------------------- topology

TOPO = ("\x1b[4mGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tPIX\t0-47\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\t0-47\t0\t\tN/A\n"
        "NIC0\tPIX\tSYS\t X \t\t\t\t\n\nLegend:\n\n  X    = Self\n")


def test_topology_parse():
    links = system.parse_topology(TOPO)
    assert links == {"GPU0": {"GPU1": "NV18", "NIC0": "PIX"},
                     "GPU1": {"GPU0": "NV18", "NIC0": "SYS"}}


# ---------------------------------------------------------------------------------- doctor

def test_doctor_prints_every_section():
    from deepep_portable.tools.doctor import run_doctor

    buf = io.StringIO()
    assert run_doctor(file=buf) == 0
    text = buf.getvalue()
    own = [f"Backend {b.name}" for b in registry.BACKENDS if b.doctor]
    assert own
    for title in ["Python / torch", "CUDA driver and GPUs", "CUDA compiler", "RDMA devices", "Transports"] + own:
        assert f"== {title}" in text
    assert "section failed" not in text, text
    for name in TRANSPORT_NAMES:
        assert f"\n  {name:10s} " in text


def _device_capabilities(header: str) -> dict:
    """The Capabilities a backend's device.cuh returns (`c.field = value;` lines, in the struct's field order), as
    Python values by field name."""
    import re

    text = open(os.path.join(os.path.dirname(deepep_portable.__file__), "..", "csrc", "backends", header)).read()
    body = re.search(r"static constexpr Capabilities capabilities\(\) \{(.*?)return c;", text, re.S).group(1)
    items = re.findall(r"c\.(\w+) = ([^;]+);", body)
    conv = {"true": True, "false": False}
    net = {"Network::kNone": "none", "Network::kInfiniBand": "infiniband", "Network::kRoCE": "roce",
           "Network::kOther": "other"}
    return {k: conv.get(x, net.get(x, int(x) if x.isdigit() else x)) for k, x in items}


@pytest.mark.parametrize("name,header", [("nvlink", "nvlink/device.cuh"), ("nvshmem", "nvshmem/device.cuh"),
                                         ("ibgda", "ibgda/device.cuh"), ("nccl_gin", "nccl_gin/device.cuh")])
def test_host_capabilities_mirror_the_device_records(name, header):
    from deepep_portable.transports import backend_class

    device = _device_capabilities(header)
    host = backend_class(name).capabilities.as_dict()
    assert list(device) == list(host), "every field set, in the struct's order"
    assert device == host


def test_available_transports_show_capabilities():
    st = available_transports()
    assert st["reference"].capabilities["graph_safe"] is False
    assert st["nvlink"].capabilities["peer_load_store"] is True
    assert set(st["nvshmem"].capabilities) == {"peer_load_store", "remote_atomics", "ordered_delivery",
                                                "max_channels", "graph_safe", "network"}
    assert st["ibgda"].capabilities["remote_atomics"] is True   # the class's record, usable or not


def test_available_transports_print_as_an_aligned_table():
    """Still the dict callers index and iterate (name -> TransportStatus, in the registry's order), but print()
    and the interpreter show one row per transport: name, usable, reason (wrapped in its column), capabilities."""
    from deepep_portable.contract import TransportTable

    st = available_transports()
    assert isinstance(st, dict) and list(st) == list(TRANSPORT_NAMES)
    text = str(st)
    assert repr(st) == text
    lines = text.splitlines()
    head = lines[0]
    assert head.split() == ["transport", "usable", "reason", "capabilities"]
    col = {word: head.index(word) for word in ("usable", "reason", "capabilities")}
    for name, s in st.items():
        row = next(line for line in lines if line.startswith(name + " "))
        assert row[col["usable"]:].startswith("yes" if s.usable else "no")
        assert row[col["capabilities"]:] == s.capabilities_in_short()
        assert row[col["reason"]:col["capabilities"]].strip() in s.reason
    for line in lines[1:]:   # continuation lines of a long reason start in the reason column
        assert line[:col["usable"]].strip() in (*TRANSPORT_NAMES, "transport", "")
    # Every word of every reason is in the table.
    assert " ".join(text.split()).count("no CUDA GPU") >= sum("no CUDA GPU" in s.reason for s in st.values())

    fake = TransportTable(
        a=TransportStatus("a", True, "short", capabilities=dict(peer_load_store=True, remote_atomics=False,
                          ordered_delivery=True, max_channels=24, graph_safe=True, network="roce")),
        long_name=TransportStatus("long_name", False, "word " * 40))
    lines = str(fake).splitlines()
    assert lines[1].startswith("a          yes     short") and lines[1].endswith(
        "load/store, ordered, graphs, 24 channels, network roce")
    assert lines[2].startswith("long_name  no      word word") and lines[2].endswith("-")
    assert len(lines) == 6 and all(line.startswith(" " * 19 + "word") for line in lines[3:])
    assert all(len(line) <= 19 + TransportTable.REASON_WIDTH for line in lines[3:])


def test_nccl_headers_must_match_the_library(fresh_probe, monkeypatch, tmp_path):
    """GIN kernels compiled against other headers than the loaded libnccl's are rejected or wrong: a
    version mismatch is a reason, named with both versions."""
    (tmp_path / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_VERSION_CODE 22809\n")
    assert libraries.nccl_header_version(str(tmp_path / "nccl.h")) == 22809
    assert libraries.nccl_header_version(str(tmp_path / "missing.h")) is None
    fake = dict(lib="/x/libnccl.so.2", version="2.30.4", version_code=23004, pip={}, searched=[],
                header_searched=[], device_header=str(tmp_path / "nccl_device.h"), header_version_code=22809)
    monkeypatch.setattr(nccl_gin_probe, "nccl_info", lambda: fake)
    s = nccl_gin_probe.probe_nccl_gin()
    assert not s.usable and "headers next to" in s.reason and "version 2.28.9" in s.reason and "2.30.4" in s.reason


def test_real_nccl_wheel_headers_match(fresh_probe):
    info = libraries.nccl_info()
    if not info["pip"] or os.environ.get("NCCL_HOME") or info["device_header"] is None:
        pytest.skip("nvidia-nccl-cu1x (with its headers) not installed, or NCCL_HOME overrides it")
    assert info["header_version_code"] == info["version_code"], info


def test_system_opens_the_driver_library_the_host_module_opens(monkeypatch, tmp_path):
    # transports/system.py, the one driver loader (_C takes its entry points from it), opens DEEPEP_PORTABLE_LIBCUDA,
    # else libcuda.so.1.
    missing = str(tmp_path / "libcuda-missing.so.1")
    monkeypatch.setenv(system.LIBCUDA_ENV, missing)
    system.libcuda.cache_clear()
    try:
        lib, why = system.libcuda()
    finally:
        system.libcuda.cache_clear()
    assert lib is None and why.startswith(f"{missing} not found"), why
    monkeypatch.delenv(system.LIBCUDA_ENV)
    assert system.libcuda_path() == "libcuda.so.1"
