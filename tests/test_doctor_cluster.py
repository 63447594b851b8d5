"""`doctor --cluster` on a fake machine: a sysfs / procfs tree built in tmp_path with two NICs (mlx5_0: one RoCE
port with RoCE v1 / v2 GIDs on ens1f0; mlx5_1: one InfiniBand port that is down, on the other CPU socket) and a
GPU on mlx5_0's PCIe switch. Each finding is checked with its "what to do"; then the findings across ranks and
rank 0's report over made-up ranks and round-trip results."""
from __future__ import annotations

import os

import pytest

from deepep_portable.tools import doctor_cluster as dc

GPU_BUS = "0000:03:00.0"
SWITCH = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
GPU_PATH = f"{SWITCH}/0000:02:00.0/{GPU_BUS}"
NIC0_PATH = f"{SWITCH}/0000:02:01.0/0000:04:00.0"
NIC1_PATH = "sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"
FAR_GPU_BUS = "0000:83:00.0"
FAR_GPU_PATH = f"sys/devices/pci0000:80/0000:80:02.0/{FAR_GPU_BUS}"
GIDS = [("fe80:0000:0000:0000:0e42:a1ff:fe00:0001", "IB/RoCE v1"), ("fe80:0000:0000:0000:0e42:a1ff:fe00:0001", "RoCE v2"),
        ("0000:0000:0000:0000:0000:ffff:0a00:0001", "IB/RoCE v1"), ("0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2")]


def _write(root, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _link(root, rel: str, target_rel: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.makedirs(os.path.join(root, target_rel), exist_ok=True)
    os.symlink(os.path.join(root, target_rel), path)


def _port(root, dev: str, port: int, state: str, phys: str, layer: str, gids, netdev=None) -> None:
    base = f"sys/class/infiniband/{dev}/ports/{port}"
    for name, value in (("state", state), ("phys_state", phys), ("link_layer", layer), ("rate", "200 Gb/sec (4X HDR)")):
        _write(root, f"{base}/{name}", value)
    for i, (gid, kind) in enumerate(gids):
        _write(root, f"{base}/gids/{i}", gid)
        if kind:
            _write(root, f"{base}/gid_attrs/types/{i}", kind)
        if netdev:
            _write(root, f"{base}/gid_attrs/ndevs/{i}", netdev)


@pytest.fixture
def machine(tmp_path):
    """The fake tree: returns its root."""
    return build_machine(str(tmp_path))


def build_machine(root: str) -> str:
    for dev, path, numa in (("mlx5_0", NIC0_PATH, 0), ("mlx5_1", NIC1_PATH, 1)):
        _link(root, f"sys/class/infiniband/{dev}/device", path)
        _link(root, f"{path}/driver", "sys/bus/pci/drivers/mlx5_core")
        _write(root, f"{path}/numa_node", str(numa))
    os.makedirs(os.path.join(root, NIC0_PATH, "net", "ens1f0"))
    _port(root, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "Ethernet", GIDS, "ens1f0")
    _port(root, "mlx5_1", 1, "1: DOWN", "2: Polling", "InfiniBand", [("fe80:0000:0000:0000:0e42:a1ff:fe00:0099", None)])
    _write(root, "sys/class/net/ens1f0/mtu", "1500")
    for bus, path, numa in ((GPU_BUS, GPU_PATH, 0), (FAR_GPU_BUS, FAR_GPU_PATH, 1)):
        _link(root, f"sys/bus/pci/devices/{bus}", path)
        _write(root, f"{path}/numa_node", str(numa))
    _write(root, "dev/infiniband/uverbs0", "")
    os.makedirs(os.path.join(root, "sys/module/nvidia"))
    _write(root, "proc/driver/nvidia/version",
           "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024")
    _write(root, "proc/driver/nvidia/params", 'ResmanDebugLevel: 4294967295\nEnableStreamMemOPs: 0\nRegistryDwords: ""')
    _write(root, "proc/sys/kernel/osrelease", "6.1.0-18-amd64")
    return root


def facts(root, env=None, bus=GPU_BUS):
    return dc.collect_local(root=root, env=env or {}, gpu_bus_id=bus, ask_driver=False)


def find(findings, subject, text):
    hits = [f for f in findings if f.subject == subject and text in f.text]
    assert len(hits) == 1, f"{subject} / {text!r} in:\n" + "\n".join(map(str, findings))
    return hits[0]


def absent(findings, subject, text):
    assert not [f for f in findings if f.subject == subject and text in f.text], findings


def test_the_machine_is_read_from_the_fake_tree(machine):
    m = dc.read_machine(machine)
    nics = {d["name"]: d for d in m["nics"]}
    assert set(nics) == {"mlx5_0", "mlx5_1"} and m["uverbs"] == ["uverbs0"]
    assert nics["mlx5_0"]["driver"] == "mlx5_core" and nics["mlx5_1"]["numa_node"] == 1
    assert nics["mlx5_0"]["pci_path"].endswith(NIC0_PATH)
    port = nics["mlx5_0"]["ports"][0]
    assert (port["netdev"], port["netdev_mtu"], port["link_layer"]) == ("ens1f0", 1500, "Ethernet")
    assert [g["type"] for g in port["gids"]] == ["IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"]
    assert m["modules"] == {"nvidia": True, "nvidia_peermem": False, "nv_peer_mem": False}
    assert m["nvidia_params"]["EnableStreamMemOPs"] == "0" and m["nvidia_params"]["RegistryDwords"] == ""
    assert dc.versions(m)["NVIDIA driver"] == "550.54.15"
    gpu = dc.read_gpu(machine, GPU_BUS)
    assert gpu["numa_node"] == 0 and gpu["dir"].endswith(GPU_BUS)


def test_gpu_to_nic_affinity(machine):
    ranked, findings = dc.affinity(facts(machine))
    assert [(r["name"], r["distance"], r["numa"]) for r in ranked] == [("mlx5_0", "PIX", 0), ("mlx5_1", "SYS", 1)]
    assert find(findings, "ibgda rails", "channels spread over").text.endswith("mlx5_0:1")
    absent(findings, f"GPU {GPU_BUS}", "closest")
    ranked, findings = dc.affinity(facts(machine, bus=FAR_GPU_BUS))   # a GPU on the socket whose NIC port is down
    assert [(r["name"], r["distance"]) for r in ranked] == [("mlx5_1", "PHB"), ("mlx5_0", "SYS")]
    f = find(findings, f"GPU {FAR_GPU_BUS}", "closest RDMA NIC with an active port, mlx5_0, is SYS")
    assert "closer, with no active port: mlx5_1 PHB" in f.text
    assert f.level == dc.WARN and "share a PCIe switch with a NIC" in f.todo and "NCCL_IB_HCA" in f.todo
    f = find(dc.affinity(facts(machine, {"DEEPEP_PORTABLE_IB_HCA_LIST": "mlx5_0"}, bus=FAR_GPU_BUS))[1],
             "ibgda rails", "channels spread over")
    f = find(dc.affinity(facts(machine, bus="0000:99:00.0"))[1], "GPU", "not found")
    assert "/sys" in f.todo
    assert find(dc.affinity(facts(machine, bus=None))[1], "GPU", "no GPU on this rank").level == dc.NOTE


def test_a_port_that_is_down_says_what_to_do(machine):
    f = find(dc.local_findings(facts(machine)), "mlx5_1:1", "port is 1: DOWN")
    assert f.level == dc.WARN and "InfiniBand" in f.text and "check the cable" in f.todo and "NCCL_IB_HCA" in f.todo
    _write(machine, "sys/class/infiniband/mlx5_1/ports/1/state", "2: INIT")
    _write(machine, "sys/class/infiniband/mlx5_1/ports/1/phys_state", "5: LinkUp")
    assert "subnet manager" in find(dc.local_findings(facts(machine)), "mlx5_1:1", "port is 2: INIT").todo


def test_roce_gids_mtu_and_traffic_class(machine):
    found = dc.local_findings(facts(machine))
    f = find(found, "mlx5_0:1", "NVSHMEM_IB_GID_INDEX is unset")
    assert f.level == dc.WARN and "RoCE v1" in f.text and "export NVSHMEM_IB_GID_INDEX=3" in f.todo
    absent(found, "mlx5_0:1", "NCCL_IB_GID_INDEX")       # NCCL picks a RoCE v2 GID itself
    absent(found, "mlx5_0:1", "ibgda")                   # ibgda's own pick is gid 3
    f = find(found, "mlx5_0:1", "RDMA MTU at most 1024")
    assert "ens1f0 has MTU 1500" in f.text and "9000" in f.todo
    f = find(found, "mlx5_0:1", "traffic class 0")
    assert "DEEPEP_PORTABLE_IB_TRAFFIC_CLASS" in f.todo and "NCCL_IB_TC" in f.todo and "106" in f.todo
    env = {"NVSHMEM_IB_GID_INDEX": "1", "NCCL_IB_GID_INDEX": "7", "DEEPEP_PORTABLE_IB_TRAFFIC_CLASS": "106"}
    _write(machine, "sys/class/net/ens1f0/mtu", "9000")
    found = dc.local_findings(facts(machine, env))
    f = find(found, "mlx5_0:1", "NVSHMEM_IB_GID_INDEX=1 is fe80")
    assert f.level == dc.FAIL and "not routable" in f.text and "NVSHMEM_IB_GID_INDEX=3" in f.todo
    assert find(found, "mlx5_0:1", "NCCL_IB_GID_INDEX=7 is not a GID").todo.startswith("export NCCL_IB_GID_INDEX=3")
    absent(found, "mlx5_0:1", "RDMA MTU")
    absent(found, "mlx5_0:1", "traffic class 0")
    f = find(dc.local_findings(facts(machine, {"DEEPEP_PORTABLE_IB_GID_INDEX": "0"})), "mlx5_0:1", "ibgda uses gid[0]")
    assert "DEEPEP_PORTABLE_IB_GID_INDEX" in f.todo and "3" in f.todo


def test_a_roce_port_without_a_v2_gid(machine):
    base = "sys/class/infiniband/mlx5_0/ports/1"
    for i in (2, 3):
        os.remove(os.path.join(machine, base, "gids", str(i)))
    found = dc.local_findings(facts(machine))
    f = find(found, "mlx5_0:1", "no routable RoCE v2 GID")
    assert f.level == dc.FAIL and "give ens1f0 an IPv4 address" in f.todo
    f = find(found, "mlx5_0:1", "ibgda: RoCE port 1 has no usable GID")
    assert f.level == dc.FAIL and "ens1f0" in f.todo


def test_gpudirect_rdma_path(machine):
    f = find(dc.local_findings(facts(machine)), "GPUDirect RDMA", "no path for the NIC to reach GPU memory")
    assert f.level == dc.FAIL and "modprobe nvidia-peermem" in f.todo and "open kernel modules" in f.todo
    os.makedirs(os.path.join(machine, "sys/module/nvidia_peermem"))
    assert find(dc.local_findings(facts(machine)), "GPUDirect RDMA", "nvidia_peermem loaded").level == dc.OK
    os.rmdir(os.path.join(machine, "sys/module/nvidia_peermem"))
    _write(machine, "proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03")
    assert find(dc.local_findings(facts(machine)), "GPUDirect RDMA", "dma-buf expected").level == dc.OK
    f_ = dict(facts(machine), dma_buf=False)
    assert "reports no dma-buf" in find(dc.local_findings(f_), "GPUDirect RDMA", "no path").text


def test_driver_settings_for_nvshmem_ibgda_and_the_ibgda_doorbell(machine):
    found = dc.local_findings(facts(machine))
    f = find(found, "NVSHMEM IBGDA", "would need")
    assert f.level == dc.NOTE and "NVreg_EnableStreamMemOPs=1" in f.todo and "PeerMappingOverride=1" in f.todo
    assert "/etc/modprobe.d" in f.todo
    f = find(found, "ibgda doorbell", "host thread")
    assert f.level == dc.WARN and "PeerMappingOverride=1" in f.todo
    found = dc.local_findings(facts(machine, {"NVSHMEM_IB_ENABLE_IBGDA": "1", "DEEPEP_PORTABLE_IB_DOORBELL": "gpu"}))
    assert find(found, "NVSHMEM IBGDA", "is on but the driver lacks").level == dc.FAIL
    f = find(found, "ibgda doorbell", "doorbell='gpu'")
    assert f.level == dc.FAIL and "DEEPEP_PORTABLE_IB_DOORBELL=auto" in f.todo
    _write(machine, "proc/driver/nvidia/params", 'EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"')
    found = dc.local_findings(facts(machine))
    assert find(found, "NVIDIA driver", "PeerMappingOverride=1").level == dc.OK
    absent(found, "ibgda doorbell", "")


def test_rdma_device_files_and_options(machine):
    os.remove(os.path.join(machine, "dev/infiniband/uverbs0"))
    f = find(dc.local_findings(facts(machine)), "RDMA", "no /dev/infiniband/uverbs")
    assert f.level == dc.FAIL and "modprobe ib_uverbs" in f.todo and "--device=/dev/infiniband" in f.todo
    found = dc.local_findings(facts(machine, {"NCCL_IB_HCA": "mlx5_7:1", "DEEPEP_PORTABLE_IB_HCA_LIST": "mlx5_1"}))
    assert find(found, "nccl_gin", "NCCL_IB_HCA names mlx5_7").todo == "fix NCCL_IB_HCA"
    assert "not ACTIVE" in find(found, "ibgda rails", "").text or "no ACTIVE" in find(found, "ibgda rails", "").text
    f = find(dc.local_findings(facts(machine, {"DEEPEP_PORTABLE_IB_TRAFFIC_CLASS": "300"})), "ibgda options", "300")
    assert f.level == dc.FAIL and "DEEPEP_PORTABLE_IB_" in f.todo


def test_no_rdma_nic(tmp_path):
    f = find(dc.local_findings(facts(str(tmp_path))), "RDMA", "no RDMA NIC")
    assert f.level == dc.FAIL
    assert "does not exist" in f.text and "rdma-core" in f.todo and "reference transport" in f.todo
    # every rank on one machine (logical nodes): nothing needs the NIC, so its absence is a note
    f = find(dc.local_findings(facts(str(tmp_path)), one_machine=True), "RDMA", "no RDMA NIC")
    assert f.level == dc.NOTE and "separate hosts need one" in f.text
    everyone = [_rank(facts(str(tmp_path)), "one")] * 4
    text = dc.format_report(everyone, [[0, 1], [2, 3]], False, [], [])
    assert "NOTE  RDMA: no RDMA NIC" in text and "FAIL  RDMA" not in text
    text = dc.format_report([_rank(facts(str(tmp_path)), h) for h in "aabb"], [[0, 1], [2, 3]], True, [], [])
    assert "FAIL  RDMA: no RDMA NIC" in text
    # containers on two machines may share a hostname: machines are told apart by node identity
    twins = [dict(_rank(facts(str(tmp_path)), "same"), node=n) for n in ("same/boot-1", "same/boot-2")]
    assert "FAIL  RDMA: no RDMA NIC" in dc.format_report(twins, [[0], [1]], True, [], [])


def test_rdma_mtu():
    assert [dc.rdma_mtu(m) for m in (1500, 4200, 9000, 4000, None)] == [1024, 4096, 4096, 2048, None]


# ---- across ranks and the report ---------------------------------------------------------------------------------
def _rank(f, host, versions=None):
    return dict(f, host=host, node=host + "/boot", versions=dict(f["versions"], **(versions or {})))


def test_ranks_that_differ_are_flagged(machine):
    base = facts(machine)
    other = facts(machine, {"DEEPEP_PORTABLE_IB_TRAFFIC_CLASS": "106"})
    everyone = [_rank(base, "a"), _rank(other, "b", versions={"NCCL": "2.21.5"})]
    everyone[1]["transports"] = dict(everyone[1]["transports"], reference=(False, "no torch.distributed"))
    found = dc.cross_rank_findings(everyone)
    f = find(found, "version of NCCL", "differs between ranks")
    assert "2.21.5 on ranks 1" in f.text and "same venv or container image" in f.todo
    f = find(found, "ibgda traffic_class", "0 on ranks 0; 106 on ranks 1")
    assert "mpirun -x" in f.todo
    f = find(found, "transport reference", "usable on ranks 0 only")
    assert "no torch.distributed" in f.text and "alike" in f.todo


def test_the_report_with_round_trips(machine):
    base = facts(machine)
    base["transports"] = {n: (n == "reference", "fake reason" if n != "reference" else "ok") for n in base["transports"]}
    everyone = [_rank(base, "node-a"), _rank(base, "node-a"), _rank(base, "node-b"), _rank(base, "node-b")]
    nodes, separate = dc.nodes_of(everyone, None)
    assert nodes == [[0, 1], [2, 3]] and separate
    ok = dict(transport="reference", pair=(0, 2), wrong=0, values=10, dispatch_s=1e-3, combine_s=2e-3, bytes=262144)
    results = [ok, dict(ok), {"transport": "reference", "pair": None, "notes": {}}]
    text = dc.format_report(everyone, nodes, separate, results, ["reference"])
    assert "4 ranks, 2 nodes on 2 machine(s): node-a, node-b" in text
    assert "node 0 (node-a, rank 0) <-> node 1 (node-b, rank 2): bit-exact; each way dispatch 0.26 GB/s" in text
    assert "baseline: torch.distributed, not RDMA" in text
    assert "no network transport is usable on every rank" in text and "fake reason" in text
    assert "mlx5_0 (mlx5_core" in text and "RoCE v2 GID 3 ::ffff:10.0.0.1" in text and "rank 0: GPU 0000:03:00.0 (NUMA 0): mlx5_0 PIX" in text
    assert "what to do:" in text and "Not ready" in text
    bad = dict(ok, wrong=3)
    text = dc.format_report(everyone, nodes, separate, [bad, dict(ok)], ["reference"])
    assert "FAIL  reference (baseline: torch.distributed, not RDMA): node 0" in text and "3 of 20 values" in text
    assert "NCCL_DEBUG=INFO" in text
    text = dc.format_report(everyone, nodes, separate, [{"transport": "reference", "pair": None, "error": "boom"}],
                            ["reference"])
    assert "the Buffer could not be made: boom" in text


def test_logical_nodes(machine):
    base = facts(machine)
    everyone = [_rank(base, "one")] * 4
    assert dc.nodes_of(everyone, None) == ([[0, 1, 2, 3]], True)
    nodes, separate = dc.nodes_of(everyone, 2)
    assert nodes == [[0, 1], [2, 3]] and not separate
    assert "do not cross a NIC" in dc.format_report(everyone, nodes, separate, [], [])
    with pytest.raises(ValueError, match="does not divide"):
        dc.nodes_of(everyone, 3)
    assert "one node: no pair of nodes to test" in dc.format_report(everyone, [[0, 1, 2, 3]], True, [], [])


def test_rank_ranges():
    assert dc.rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"


def test_cluster_report_alone(machine, capsys):
    import io

    out = io.StringIO()
    assert dc.cluster_report(None, file=out, root=machine) == 0
    text = out.getvalue()
    assert "1 ranks, 1 nodes" in text and "== Findings" in text and "== Verdict" in text


def test_ibgda_rails_farther_than_the_closest_nic(machine):
    _write(machine, "sys/class/infiniband/mlx5_1/ports/1/state", "4: ACTIVE")
    found = dc.affinity(facts(machine, {"DEEPEP_PORTABLE_IB_HCA_LIST": "mlx5_1"}))[1]
    f = find(found, "ibgda rails", "hca_list puts channels on mlx5_1, farther from the GPU than mlx5_0")
    assert f.level == dc.WARN and "DEEPEP_PORTABLE_IB_HCA_LIST" in f.todo
    assert find(found, "ibgda rails", "channels spread over mlx5_1:1")


# ---- what the backends' registry rows add ------------------------------------------------------------------------
def _fake_backend(monkeypatch, hook):
    """A registry row "fake" after the real ones, whose cluster_findings is `hook`."""
    import sys
    import types

    from deepep_portable.transports import registry

    module = types.ModuleType("deepep_portable_fake_backend")
    module.findings = hook
    monkeypatch.setitem(sys.modules, module.__name__, module)
    row = registry.Backend("fake", None, None, f"{module.__name__}:probe", spans_nodes=False,
                           cluster_findings=f"{module.__name__}:findings")
    monkeypatch.setattr(registry, "BACKENDS", registry.BACKENDS + (row,))


def test_a_rows_cluster_findings_are_in_the_report(machine, monkeypatch):
    from deepep_portable.transports import registry

    asked = []

    def hook(part, facts, context):
        asked.append((part, dict(context)))
        return [("WARN", f"fake {part}", f"seen at {context.get('where', part)}", f"fix the {part}")]

    _fake_backend(monkeypatch, hook)
    found = dc.local_findings(facts(machine))
    assert [p for p, _ in asked] == list(registry.CLUSTER_PARTS)   # one ACTIVE port, readable driver params, a GPU
    context = dict(asked)
    assert context["port"]["where"] == "mlx5_0:1" and [g["index"] for g in context["port"]["routable_v2"]] == [3]
    assert context["driver"]["has_nic"] and not context["driver"]["peer_mapping_override"]
    assert "NVreg_EnableStreamMemOPs=1" in context["driver"]["missing"]
    assert [r["name"] for r in context["affinity"]["ranked"]] == ["mlx5_0", "mlx5_1"]
    assert context["affinity"]["best"]["name"] == "mlx5_0" and context["affinity"]["gpu_dir"].endswith(GPU_BUS)
    f = find(found, "fake port", "seen at mlx5_0:1")
    assert f.level == dc.WARN and f.todo == "fix the port"
    base = facts(machine)
    text = dc.format_report([_rank(base, "a"), _rank(base, "b")], [[0], [1]], True, [], [])
    assert "WARN  fake port: seen at mlx5_0:1  [every rank]" in text and "what to do: fix the affinity" in text
    assert "WARN  ibgda doorbell" in text   # the real rows' findings stay


def test_a_rows_cluster_findings_that_fail_are_a_finding(machine, monkeypatch):
    def hook(part, facts, context):
        if part == "rank":
            return [("LOUD", "fake", "a level that is none", "")]
        raise RuntimeError("boom")

    _fake_backend(monkeypatch, hook)
    found = dc.local_findings(facts(machine))
    assert find(found, "doctor", "fake's findings: bad level").level == dc.FAIL
    f = find(found, "doctor", "fake's findings (port): RuntimeError: boom")
    assert f.level == dc.FAIL and f.todo
    find(found, "ibgda rails", "channels spread over")   # the other rows are still asked
