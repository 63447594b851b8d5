"""deepep_portable/transports/ibgda/prm.py against rdma-core's own scapy classes for the mlx5 PRM structs
(tests/mlx5_prm_structs.py, shipped gzipped by python3-pyverbs in /usr/share/doc/rdma-core/tests/): every encoder
is built again with those classes and compared byte for byte, with value sets that leave no field at zero; every
table offset is compared with scapy's; the parsers read outputs that scapy built. Fields prm.py writes that the
scapy classes lack (or define narrower) are listed in BEYOND_SCAPY with the source they come from instead, and
test_every_field_is_in_scapy_or_called_out fails on any other. Needs scapy (the `test` extra) and the .py.gz;
skips with the reason when either is missing.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
import struct

import pytest

from deepep_portable.transports.ibgda import prm

PRM_STRUCTS_GZ = "/usr/share/doc/rdma-core/tests/mlx5_prm_structs.py.gz"

# prm.py name -> scapy name, where the two differ (same bits).
RENAMED = {"cq_context": "sw_cqc", "qpc": "sw_qpc", "cq_umem_offset": "e_mtt_pointer_or_cq_umem_offset",
           "wq_umem_offset": "e_mtt_pointer_or_wq_umem_offset", "obj": "cqn"}

# Fields prm.py writes that scapy's classes do not have as such: struct.field -> where the layout comes from and
# how the test covers it instead.
BEYOND_SCAPY = {
    "cqc.c_eqn": "32 bits at 0xa0 as the kernel's mlx5_ifc.h c_eqn_or_apu_element[0x20]; scapy: reserved8[24] + "
                 "c_eqn[8] (same bits; test_cq_eqn_wider_than_scapy sets both halves)",
    "cqc.dbr_addr": "64 bits at 0x1c0 as mlx5_ifc.h dbr_addr[0x40]; scapy splits it into db_record_addr_63_32 and "
                    "db_record_addr_31_3 (+3 reserved bits); the CQ encoder tests set both halves",
}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    pytest.importorskip("scapy", reason="scapy is not installed (pip install -e '.[test]')")
    if not os.path.exists(PRM_STRUCTS_GZ):
        pytest.skip(f"{PRM_STRUCTS_GZ} not found: rdma-core's scapy PRM classes ship in python3-pyverbs")
    path = tmp_path_factory.mktemp("rdma_core") / "mlx5_prm_structs.py"
    with gzip.open(PRM_STRUCTS_GZ, "rb") as f:
        path.write_bytes(f.read())
    spec = importlib.util.spec_from_file_location("rdma_core_mlx5_prm_structs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def same(mine: bytes, theirs) -> None:
    ref = bytes(theirs)
    diff = [i for i in range(max(len(mine), len(ref))) if mine[i:i + 1] != ref[i:i + 1]]
    assert not diff and len(mine) == len(ref), (
        f"{len(mine)} vs {len(ref)} bytes; differing bytes at {diff[:16]}: "
        + ", ".join(f"[{i}] {mine[i:i + 1].hex()} != {ref[i:i + 1].hex()}" for i in diff[:8]))


def scapy_offsets(cls) -> dict:
    """scapy field name -> (bit offset, width in bits) of a Packet class (nested packets as one field)."""
    from scapy.fields import BitField
    pkt, bit, out = cls(), 0, {}
    for f in cls.fields_desc:
        width = f.size if isinstance(f, BitField) else 8 * len(f.addfield(pkt, b"", pkt.getfieldval(f.name)))
        out[f.name] = (bit, width)
        bit += width
    return out


# --- layouts ----------------------------------------------------------------------------------------------------

def bits(width) -> int:
    """A layout entry's width in bits (a nested layout: its struct's size)."""
    if isinstance(width, dict):
        return next(size for size, layout in prm.LAYOUTS.values() if layout is width) * 8
    return width


def _pairs(ref):
    return [("cqc", prm.CQC, ref.SwCqc), ("ads", prm.ADS, ref.SwAds), ("qpc", prm.QPC, ref.SwQpc),
            ("create_cq_in", prm.CREATE_CQ_IN, ref.CreateCqIn), ("create_qp_in", prm.CREATE_QP_IN, ref.CreateQpIn),
            ("modify_qp_in", prm.MODIFY_QP_IN, ref.ModifyQpIn),
            ("query_hca_cap_in", prm.QUERY_HCA_CAP_IN, ref.QueryHcaCapIn),
            ("create_obj_out", prm.CREATE_OBJ_OUT, ref.CreateCqOut), ("cmd_hca_cap", prm.CMD_HCA_CAP, ref.CmdHcaCap)]


def test_every_field_is_in_scapy_or_called_out(ref):
    missing, checked = [], 0
    for struct_name, layout, cls in _pairs(ref):
        theirs = scapy_offsets(cls)
        assert prm.LAYOUTS[struct_name][0] * 8 == sum(w for _, w in theirs.values()), struct_name
        for name, (offset, width) in layout.items():
            other = RENAMED.get(name, name)
            key = f"{struct_name}.{name}"
            if key in BEYOND_SCAPY:
                missing.append(key)
                continue
            assert other in theirs, f"{key}: not in scapy's {cls.__name__} and not in BEYOND_SCAPY"
            assert theirs[other] == (offset, bits(width)), f"{key}: prm {(offset, bits(width))} vs {theirs[other]}"
            checked += 1
    assert sorted(missing) == sorted(BEYOND_SCAPY)
    assert checked > 70


def test_layouts_fit_and_do_not_overlap():
    for name, (size, layout) in prm.LAYOUTS.items():
        spans = sorted((off, off + bits(w), f) for f, (off, w) in layout.items())
        assert spans[-1][1] <= size * 8, name
        for (a0, a1, fa), (b0, b1, fb) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{name}: {fa} overlaps {fb}"


def test_bit_numbering():
    # bit 0 = MSB of byte 0: a 3-bit field at bit 0x40 is the top of byte 8, a 24-bit one at 0x48 bytes 9..11
    buf = bytearray(16)
    prm._put(buf, 0x40, 3, 0b101, "a")
    prm._put(buf, 0x48, 24, 0x123456, "b")
    assert buf[8] == 0b1010_0000 and buf[9:12] == b"\x12\x34\x56"
    assert prm._get(buf, 0x40, 3) == 0b101 and prm._get(buf, 0x48, 24) == 0x123456
    with pytest.raises(ValueError, match="b is 24 bit"):
        prm._put(buf, 0x48, 24, 1 << 24, "b")


# --- encoders ---------------------------------------------------------------------------------------------------

CQ_CASES = [
    dict(log_cq_size=9, uar_page=0x12345, eqn=0x17, cq_umem_id=0x11223344, dbr_umem_id=0x55667788, log_page_size=4,
         cq_umem_offset=0x10000, dbr_offset=0x20040, collapsed=True, overrun_ignore=True),
    dict(log_cq_size=31, uar_page=0xfedcba, eqn=0xff, cq_umem_id=0xffffffff, dbr_umem_id=0x1, log_page_size=31,
         cq_umem_offset=0x1234_5678_9abc_def0, dbr_offset=0xfedc_ba98_7654_3218, collapsed=False, overrun_ignore=False),
]


@pytest.mark.parametrize("kw", CQ_CASES)
def test_create_cq_in(ref, kw):
    dbr = kw["dbr_offset"]
    cqc = ref.SwCqc(dbr_umem_valid=1, cqe_sz=0, cc=int(kw["collapsed"]), oi=int(kw["overrun_ignore"]),
                    dbr_umem_id=kw["dbr_umem_id"], log_cq_size=kw["log_cq_size"], uar_page=kw["uar_page"],
                    c_eqn=kw["eqn"], log_page_size=kw["log_page_size"],
                    db_record_addr_63_32=dbr >> 32, db_record_addr_31_3=(dbr & 0xffffffff) >> 3)
    theirs = ref.CreateCqIn(sw_cqc=cqc, e_mtt_pointer_or_cq_umem_offset=kw["cq_umem_offset"],
                            cq_umem_id=kw["cq_umem_id"], cq_umem_valid=1)
    same(prm.create_cq_in(**kw), theirs)


def test_cq_eqn_wider_than_scapy(ref):
    kw = dict(CQ_CASES[0], eqn=0x12345)
    cqc = ref.SwCqc(dbr_umem_valid=1, cc=1, oi=1, dbr_umem_id=kw["dbr_umem_id"], log_cq_size=kw["log_cq_size"],
                    uar_page=kw["uar_page"], reserved8=0x123, c_eqn=0x45, log_page_size=kw["log_page_size"],
                    db_record_addr_31_3=kw["dbr_offset"] >> 3)
    theirs = ref.CreateCqIn(sw_cqc=cqc, e_mtt_pointer_or_cq_umem_offset=kw["cq_umem_offset"],
                            cq_umem_id=kw["cq_umem_id"], cq_umem_valid=1)
    same(prm.create_cq_in(**kw), theirs)


def test_create_cq_in_rejects_unaligned_dbr():
    with pytest.raises(ValueError, match="8-byte aligned"):
        prm.create_cq_in(**dict(CQ_CASES[0], dbr_offset=0x44))


QP_CASES = [
    dict(pdn=0xabcdef, uar_page=0x123456, cqn_snd=0x654321, cqn_rcv=0x13579b, log_sq_size=15, wq_umem_id=0xdeadbeef,
         dbr_umem_id=0xcafef00d, wq_umem_offset=0x1_0000_0000, dbr_offset=0x40, log_page_size=4, user_index=0x7531),
    dict(pdn=1, uar_page=0xffffff, cqn_snd=0xffffff, cqn_rcv=1, log_sq_size=1, wq_umem_id=1, dbr_umem_id=0xffffffff,
         wq_umem_offset=0xffff_ffff_ffff_f000, dbr_offset=0x1234_5678_9abc_def8, log_page_size=31,
         user_index=0xffffff),
]


@pytest.mark.parametrize("kw", QP_CASES)
def test_create_qp_in(ref, kw):
    qpc = ref.SwQpc(st=0, pm_state=3, pd=kw["pdn"], uar_page=kw["uar_page"], rq_type=3, log_rq_size=0,
                    log_sq_size=kw["log_sq_size"], cqn_snd=kw["cqn_snd"], cqn_rcv=kw["cqn_rcv"], cs_req=0, cs_res=0,
                    dbr_umem_valid=1, dbr_umem_id=kw["dbr_umem_id"], dbr_addr=kw["dbr_offset"],
                    user_index=kw["user_index"], log_page_size=kw["log_page_size"])
    theirs = ref.CreateQpIn(sw_qpc=qpc, e_mtt_pointer_or_wq_umem_offset=kw["wq_umem_offset"],
                            wq_umem_id=kw["wq_umem_id"], wq_umem_valid=1)
    same(prm.create_qp_in(**kw), theirs)


@pytest.mark.parametrize("kw", [
    dict(qpn=0xabcdef, vhca_port_num=2, pkey_index=0x7fff, atomic_mode=3, rwe=True, rre=True, rae=True),
    dict(qpn=0x000001, vhca_port_num=255, pkey_index=0xffff, atomic_mode=0xf, rwe=False, rre=True, rae=False),
    dict(qpn=0xffffff, vhca_port_num=1, pkey_index=1, atomic_mode=1, rwe=True, rre=False, rae=True),
])
def test_rst2init_qp_in(ref, kw):
    ads = ref.SwAds(vhca_port_num=kw["vhca_port_num"], pkey_index=kw["pkey_index"])
    qpc = ref.SwQpc(rwe=int(kw["rwe"]), rre=int(kw["rre"]), rae=int(kw["rae"]), atomic_mode=kw["atomic_mode"],
                    pm_state=3, primary_address_path=ads)
    same(prm.rst2init_qp_in(**kw), ref.ModifyQpIn(opcode=0x502, qpn=kw["qpn"], sw_qpc=qpc))


GID = bytes.fromhex("fe800000000000000002c90300a1b2c3")
GID_V4 = bytes(10) + b"\xff\xff" + bytes([10, 1, 2, 3])
MAC = bytes.fromhex("b8cef6a1b2c3")
PATHS = [
    # InfiniBand on one subnet: LID routed, no GRH
    (prm.AddressPath(vhca_port_num=1, rlid=0xbeef, sl=0xa, tclass=0x6a, ack_timeout=0x13),
     dict(vhca_port_num=1, rlid=0xbeef, sl=0xa, tclass=0x6a, ack_timeout=0x13)),
    # InfiniBand with a GRH
    (prm.AddressPath(vhca_port_num=2, rlid=0x1234, sl=0xf, grh=True, rgid=GID, src_addr_index=0x7e, hop_limit=0x41,
                     tclass=0xff, ack_timeout=0x1f),
     dict(vhca_port_num=2, rlid=0x1234, sl=0xf, grh=1, rgid=GID, src_addr_index=0x7e, hop_limit=0x41, tclass=0xff,
          ack_timeout=0x1f)),
    # RoCE v2, IPv4-mapped GID, TC 106 (DSCP 26, ECT0): no ads.grh bit, dscp = tc >> 2, ecn not written
    (prm.AddressPath(vhca_port_num=1, grh=True, rgid=GID_V4, rmac=MAC, src_addr_index=3, hop_limit=64, tclass=106,
                     udp_sport=0xc0de, eth_prio=5, ack_timeout=14),
     dict(vhca_port_num=1, rgid=GID_V4, rmac=MAC, src_addr_index=3, hop_limit=64, tclass=106, dscp=26,
          udp_sport=0xc0de, eth_prio=5, ack_timeout=14)),
    # RoCE, every field at its widest
    (prm.AddressPath(vhca_port_num=0xff, sl=0xf, grh=True, rgid=b"\xff" * 16, rmac=b"\xff" * 6, src_addr_index=0xff,
                     hop_limit=0xff, tclass=0xff, udp_sport=0xffff, eth_prio=7, ack_timeout=0x1f),
     dict(vhca_port_num=0xff, sl=0xf, rgid=b"\xff" * 16, rmac=b"\xff" * 6, src_addr_index=0xff, hop_limit=0xff,
          tclass=0xff, dscp=0x3f, udp_sport=0xffff, eth_prio=7, ack_timeout=0x1f)),
]


def scapy_ads(ref, rgid=None, rmac=None, **fields):
    ads = ref.SwAds(**fields)
    if rgid is not None:
        ads.rgid_rip = list(struct.unpack(">4I", rgid))
    if rmac is not None:
        ads.rmac = ":".join(f"{b:02x}" for b in rmac)
    return ads


@pytest.mark.parametrize("path,expected", PATHS)
@pytest.mark.parametrize("kw", [
    dict(qpn=0x123456, mtu=4096, remote_qpn=0xabcdef, log_rra_max=4),
    dict(qpn=0xfedcba, mtu=1024, remote_qpn=0x000fed, log_rra_max=7, log_msg_max=31, min_rnr_nak=0x1f,
         next_rcv_psn=0xa5a5a5),
])
def test_init2rtr_qp_in(ref, path, expected, kw):
    full = dict(dict(log_msg_max=30, min_rnr_nak=12, next_rcv_psn=0), **kw)
    qpc = ref.SwQpc(mtu={4096: 5, 1024: 3}[kw["mtu"]], log_msg_max=full["log_msg_max"], remote_qpn=kw["remote_qpn"],
                    min_rnr_nak=full["min_rnr_nak"], log_rra_max=kw["log_rra_max"],
                    next_rcv_psn=full["next_rcv_psn"], primary_address_path=scapy_ads(ref, **expected))
    theirs = ref.ModifyQpIn(opcode=0x503, qpn=kw["qpn"], opt_param_mask=0, sw_qpc=qpc)
    same(prm.init2rtr_qp_in(path=path, **kw), theirs)


def test_mtu_table():
    # qpc.mtu is the IB MTU enum (ibv_mtu: IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5)
    assert prm.MTU == {256 << i: i + 1 for i in range(5)}
    with pytest.raises(ValueError, match="MTU 9000"):
        prm.init2rtr_qp_in(qpn=1, mtu=9000, remote_qpn=2, path=PATHS[0][0], log_rra_max=1)


@pytest.mark.parametrize("kw", [
    dict(qpn=0x123456, log_sra_max=4),
    dict(qpn=0xabcdef, log_sra_max=7, retry_count=3, rnr_retry=6, ack_timeout=0x1f, next_send_psn=0x5a5a5a,
         log_ack_req_freq=0xf),
    dict(qpn=0x000001, log_sra_max=1, retry_count=1, rnr_retry=1, ack_timeout=1, next_send_psn=0xffffff,
         log_ack_req_freq=1),
])
def test_rtr2rts_qp_in(ref, kw):
    full = dict(dict(retry_count=7, rnr_retry=7, ack_timeout=20, next_send_psn=0, log_ack_req_freq=0), **kw)
    qpc = ref.SwQpc(log_ack_req_freq=full["log_ack_req_freq"], log_sra_max=kw["log_sra_max"],
                    retry_count=full["retry_count"], rnr_retry=full["rnr_retry"],
                    next_send_psn=full["next_send_psn"],
                    primary_address_path=ref.SwAds(ack_timeout=full["ack_timeout"]))
    same(prm.rtr2rts_qp_in(**kw), ref.ModifyQpIn(opcode=0x504, qpn=kw["qpn"], opt_param_mask=0, sw_qpc=qpc))


def test_out_of_range_values_raise():
    with pytest.raises(ValueError, match="log_sra_max is 3 bit"):
        prm.rtr2rts_qp_in(qpn=1, log_sra_max=8)
    with pytest.raises(ValueError, match="primary_address_path.vhca_port_num"):
        prm.rst2init_qp_in(qpn=1, vhca_port_num=256)
    with pytest.raises(ValueError, match="rgid must be 16 bytes"):
        prm.init2rtr_qp_in(qpn=1, mtu=4096, remote_qpn=2, log_rra_max=1,
                           path=prm.AddressPath(vhca_port_num=1, grh=True, rgid=b"\x01" * 4))


@pytest.mark.parametrize("op_mod", [prm.HCA_CAP_GENERAL_CUR, 0, 0x1d])
def test_query_hca_cap_in(ref, op_mod):
    same(prm.query_hca_cap_in(op_mod), ref.QueryHcaCapIn(op_mod=op_mod))


def test_opcodes(ref):
    ops = ref.DevxOps
    assert (prm.CMD_QUERY_HCA_CAP, prm.CMD_CREATE_CQ, prm.CMD_CREATE_QP, prm.CMD_RST2INIT_QP, prm.CMD_INIT2RTR_QP,
            prm.CMD_RTR2RTS_QP) == (ops.MLX5_CMD_OP_QUERY_HCA_CAP, ops.MLX5_CMD_OP_CREATE_CQ,
                                    ops.MLX5_CMD_OP_CREATE_QP, ops.MLX5_CMD_OP_RST2INIT_QP,
                                    ops.MLX5_CMD_OP_INIT2RTR_QP, ops.MLX5_CMD_OP_RTR2RTS_QP)
    assert (prm.QPC_ST_RC, prm.QPC_PM_STATE_MIGRATED) == (ops.MLX5_QPC_ST_RC, ops.MLX5_QPC_PM_STATE_MIGRATED)


# --- outputs ----------------------------------------------------------------------------------------------------

def test_output_sizes(ref):
    assert prm.CREATE_CQ_OUT == len(ref.CreateCqOut())
    assert prm.CREATE_QP_OUT == len(ref.CreateQpOut())
    assert prm.MODIFY_QP_OUT == len(ref.ModifyQpOut())
    # scapy pads the capability to 2048 bytes; the PRM's capability union is 4096 (mlx5_ifc.h
    # hca_cap_union_bits, 0x8000 bits), which is what NVSHMEM asks for: ours is the larger, holding scapy's
    assert prm.QUERY_HCA_CAP_OUT == 16 + 4096 >= len(ref.QueryCmdHcaCapOut())


def test_cqn_and_qpn(ref):
    assert prm.cqn_of(bytes(ref.CreateCqOut(cqn=0xabcdef))) == 0xabcdef
    assert prm.qpn_of(bytes(ref.CreateQpOut(qpn=0x123456))) == 0x123456
    assert prm.cqn_of(bytes(ref.CreateCqOut(cqn=1, reserved2=0xff))) == 1


def test_general_caps(ref):
    names = [f.name for f in dataclasses.fields(prm.GeneralCaps)]
    widths = {n: prm.CMD_HCA_CAP[n][1] for n in names}
    values = {n: (0x2d + 7 * i) % (1 << widths[n]) or 1 for i, n in enumerate(names)}
    assert len(set(values.values())) >= len(names) - 2    # distinct, so a swapped offset shows
    out = bytes(ref.QueryCmdHcaCapOut(capability=ref.CmdHcaCap(**values)))
    assert prm.general_caps(out) == prm.GeneralCaps(**values)
    assert prm.general_caps(out + bytes(prm.QUERY_HCA_CAP_OUT - len(out))) == prm.GeneralCaps(**values)
    # the other fields around them are set too: a parser reading a neighbour would see it
    noisy = ref.CmdHcaCap(**values, log_max_qp=0x1f, log_max_cq=0x1f, log_max_srq_sz=0xff, log_max_eq_sz=0xff,
                          roce=1, atomic=1, log_pg_sz=0xff, uar_4k=1)
    assert prm.general_caps(bytes(ref.QueryCmdHcaCapOut(capability=noisy))) == prm.GeneralCaps(**values)


def test_check_status(ref):
    prm.check_status(bytes(ref.ModifyQpOut()), "INIT2RTR")
    with pytest.raises(RuntimeError, match=r"INIT2RTR of QP 0x5 failed: status 0x03 \(bad parameter\), "
                                           r"syndrome 0x1234abcd"):
        prm.check_status(bytes(ref.ModifyQpOut(status=3, syndrome=0x1234abcd)), "INIT2RTR of QP 0x5")
    with pytest.raises(RuntimeError, match="CREATE_CQ failed: status 0x77 .unknown status., syndrome 0x00000001"):
        prm.cqn_of(bytes(ref.CreateCqOut(status=0x77, syndrome=1, cqn=5)))
    with pytest.raises(RuntimeError, match="QUERY_HCA_CAP failed: status 0x0f"):
        prm.general_caps(bytes(ref.QueryCmdHcaCapOut(status=0xf, syndrome=0xfeed)))
    with pytest.raises(ValueError, match="output of 4 bytes"):
        prm.check_status(b"\0" * 4, "X")


def test_atomic_result_order_from_the_atomic_caps():
    """mlx5_ifc.h atomic_caps (not in scapy): atomic_req_8B_endianness_mode at bit 0x40 (2 bits), its support bit
    supported_atomic_req_8B_endianness_mode_1 at 0x46; results are host-order only for mode 1 where supported."""
    assert prm.HCA_CAP_ATOMIC_CUR == 7 and prm.query_hca_cap_in(prm.HCA_CAP_ATOMIC_CUR)[6:8] == b"\x00\x07"

    def out(supported, mode, status=0):
        b = bytearray(prm.QUERY_HCA_CAP_OUT)
        b[0] = status
        b[16 + 8] = (mode << 6) | (supported << 1)   # byte 8 of the caps: mode in bits 7-6, support in bit 1
        return bytes(b)

    assert prm.atomic_results_big_endian(out(1, 1)) is False
    assert prm.atomic_results_big_endian(out(1, 0)) is True
    assert prm.atomic_results_big_endian(out(0, 1)) is True
    assert prm.atomic_results_big_endian(out(0, 0)) is True
    with pytest.raises(RuntimeError, match="QUERY_HCA_CAP"):
        prm.atomic_results_big_endian(out(1, 1, status=3))
