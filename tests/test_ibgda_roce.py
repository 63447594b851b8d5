"""The ibgda backend's addressing choices (transports/ibgda/roce.py) over fake sysfs trees and options."""
import os

import pytest

from deepep_portable.transports import rdma
from deepep_portable.transports.ibgda import roce
from deepep_portable.transports.ibgda.roce import IbgdaOptions, ibgda_options, pick_gid

V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"      # ::ffff:10.0.0.1
V6 = "fd00:0000:0000:0000:0000:0000:0000:0007"
LINK_LOCAL = "fe80:0000:0000:0000:0a88:66ff:fe00:0001"


def _fake_port(root, dev, port, link_layer, gids, state="4: ACTIVE"):
    p = root / dev / "ports" / str(port)
    (p / "gids").mkdir(parents=True)
    (p / "gid_attrs" / "types").mkdir(parents=True)
    (p / "state").write_text(state + "\n")
    (p / "link_layer").write_text(link_layer + "\n")
    for i, (gid, kind) in enumerate(gids):
        (p / "gids" / str(i)).write_text(gid + "\n")
        (p / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")


def test_options_defaults_env_and_errors():
    assert ibgda_options({}, environ={}) == IbgdaOptions()
    env = {"DEEPEP_PORTABLE_IB_GID_INDEX": "3", "DEEPEP_PORTABLE_IB_TRAFFIC_CLASS": "106",
           "DEEPEP_PORTABLE_IB_HCA_LIST": "mlx5_0,mlx5_1:1"}
    o = ibgda_options({"service_level": 3}, environ=env)
    assert (o.gid_index, o.traffic_class, o.service_level, o.hca_list) == (3, 106, 3, ("mlx5_0", "mlx5_1:1"))
    assert ibgda_options({"gid_index": 1}, environ=env).gid_index == 1          # the call wins over the environment
    with pytest.raises(ValueError, match="unknown ibgda option"):
        ibgda_options({"gid": 1}, environ={})
    with pytest.raises(ValueError, match=r"traffic_class=256 is outside \[0, 255\]"):
        ibgda_options({"traffic_class": 256}, environ={})
    with pytest.raises(ValueError, match="service_level must be an integer"):
        ibgda_options({}, environ={"DEEPEP_PORTABLE_IB_SERVICE_LEVEL": "high"})
    with pytest.raises(ValueError, match="address_family"):
        ibgda_options({"address_family": "ipx"}, environ={})
    assert ibgda_options({"udp_sport_base": "0xd000"}, environ={}).udp_sport_base == 0xD000


def test_gid_choice_from_sysfs(tmp_path):
    _fake_port(tmp_path, "mlx5_0", 1, "Ethernet",
               [(LINK_LOCAL, "IB/RoCE v1"), (LINK_LOCAL, "RoCE v2"), (V6, "IB/RoCE v1"), (V6, "RoCE v2"),
                (V4, "IB/RoCE v1"), (V4, "RoCE v2")])
    _fake_port(tmp_path, "mlx5_1", 1, "InfiniBand", [("fe80:0000:0000:0000:b859:9f03:00d4:e6a0", "IB/RoCE v1")])
    devs = {d["name"]: d for d in rdma.rdma_devices_sysfs(str(tmp_path))}
    roce_port, ib_port = devs["mlx5_0"]["ports"][0], devs["mlx5_1"]["ports"][0]
    assert pick_gid(roce_port)[:2] == (5, V4)                                        # RoCE v2, IPv4-mapped
    assert pick_gid(roce_port, IbgdaOptions(address_family="ipv6"))[:2] == (3, V6)   # RoCE v2, global IPv6
    assert pick_gid(roce_port, IbgdaOptions(gid_index=4))[:2] == (4, V4)             # the override, as given
    assert pick_gid(ib_port)[0] == 0                                                 # IB: the default GID
    with pytest.raises(ValueError, match="not a valid GID"):
        pick_gid(roce_port, IbgdaOptions(gid_index=9))


def test_gid_choice_refuses_link_local_only_roce(tmp_path):
    _fake_port(tmp_path, "mlx5_0", 1, "Ethernet", [(LINK_LOCAL, "IB/RoCE v1"), (LINK_LOCAL, "RoCE v2")])
    port = rdma.rdma_devices_sysfs(str(tmp_path))[0]["ports"][0]
    with pytest.raises(ValueError, match="no usable GID"):
        pick_gid(port)


def test_udp_source_ports():
    ports = {roce.udp_sport(0x100 + q, 0x900 + q, c) for q in range(64) for c in range(4)}
    assert all(0xC000 <= p <= 0xFFFF for p in ports)
    assert len(ports) > 200                                    # 256 QPs: (almost) all on distinct ports
    assert roce.udp_sport(1, 2, 3) == roce.udp_sport(1, 2, 3)  # stable per QP
    assert [roce.udp_sport(1, 2, c, base=0xD000) for c in range(3)] == [0xD000, 0xD001, 0xD002]
    with pytest.raises(ValueError, match="leaves"):
        roce.udp_sport(1, 2, 5, base=0xFFFE)


def _pci(root, *chain):
    """A sysfs device directory at /sys/devices/<chain...>, returned as a link the way /sys/class links it."""
    d = root.joinpath("devices", *chain)
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_nic_distance_and_ranking(tmp_path):
    rc, port = "pci0000:00", "0000:00:01.0"
    gpu = _pci(tmp_path, rc, port, "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")
    same_switch = _pci(tmp_path, rc, port, "0000:01:00.0", "0000:02:01.0", "0000:04:00.0")
    two_switches = _pci(tmp_path, rc, port, "0000:05:00.0", "0000:06:00.0", "0000:07:00.0")
    host_bridge = _pci(tmp_path, rc, "0000:00:02.0", "0000:08:00.0")
    other_socket = _pci(tmp_path, "pci0000:80", "0000:80:01.0", "0000:81:00.0")
    assert roce.nic_distance(str(gpu), str(same_switch)) == roce.PIX
    assert roce.nic_distance(str(gpu), str(two_switches)) == roce.PXB
    assert roce.nic_distance(str(gpu), str(host_bridge)) == roce.PHB
    assert roce.nic_distance(str(gpu), str(other_socket)) == roce.SYS
    ib = tmp_path / "class" / "infiniband"
    for name, target in (("mlx5_3", other_socket), ("mlx5_0", host_bridge), ("mlx5_1", same_switch)):
        (ib / name).mkdir(parents=True)
        os.symlink(target, ib / name / "device")
    ranked = roce.rank_nics(str(gpu), [{"name": n} for n in ("mlx5_3", "mlx5_0", "mlx5_1")], str(ib))
    assert ranked == [(roce.PIX, "mlx5_1"), (roce.PHB, "mlx5_0"), (roce.SYS, "mlx5_3")]


def test_channels_alternate_over_rails():
    rails = [("mlx5_0", 1), ("mlx5_0", 2), ("mlx5_1", 1)]
    assert roce.spread_channels(5, rails) == [rails[0], rails[1], rails[2], rails[0], rails[1]]
    with pytest.raises(ValueError, match="no usable"):
        roce.spread_channels(2, [])


def test_doctor_says_which_gid_ibgda_would_use(tmp_path):
    from deepep_portable.transports.ibgda import doctor

    _fake_port(tmp_path, "mlx5_0", 1, "Ethernet", [(LINK_LOCAL, "RoCE v2"), (V4, "RoCE v2")])
    _fake_port(tmp_path, "mlx5_1", 1, "Ethernet", [(LINK_LOCAL, "RoCE v2")])
    devs = {d["name"]: d for d in rdma.rdma_devices_sysfs(str(tmp_path))}
    assert doctor.gid_choice(devs["mlx5_0"]["ports"][0]).startswith(f"ibgda would use gid[1] {V4}: RoCE v2")
    assert "no usable GID" in doctor.gid_choice(devs["mlx5_1"]["ports"][0])
