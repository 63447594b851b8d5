"""mlx5 PRM (Programmer's Reference Manual) DevX commands for the ibgda backend, in pure Python: the encoders of
CREATE_CQ, CREATE_QP, RST2INIT/INIT2RTR/RTR2RTS_QP and QUERY_HCA_CAP, and the parsers of their outputs. They build
an RC queue pair whose WQ, CQ and doorbell records live in GPU memory (DevX UMEMs), the recipe of
shared/research/IBGDA.md section 1.1; the provider (devx.py) sends the bytes with mlx5dv_devx_obj_create/_modify
and mlx5dv_devx_general_cmd.

Layouts. Each struct is a table of (bit offset, width) per field, nested structs (the cqc in CREATE_CQ, the qpc in
CREATE_QP/MODIFY_QP, the address path in the qpc) sit in their parent's table at their offset. The offsets are
facts of the hardware's command layout as the PRM numbers them, taken from rdma-core's scapy classes
(tests/mlx5_prm_structs.py, shipped by python3-pyverbs) and cross-checked against the field names of the
kernel's include/linux/mlx5/mlx5_ifc.h; where the two differ the kernel's is used and the table says so.

Verification: tests/test_ibgda_prm.py builds every command again with rdma-core's scapy classes and compares the
bytes exactly, checks every table offset against scapy's, and names each field scapy lacks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Mapping, Tuple, Union

CMD_QUERY_HCA_CAP = 0x100
CMD_CREATE_CQ = 0x400
CMD_CREATE_QP = 0x500
CMD_RST2INIT_QP = 0x502
CMD_INIT2RTR_QP = 0x503
CMD_RTR2RTS_QP = 0x504

MTU = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}   # bytes -> qpc.mtu (the IB MTU enum, as ibv_mtu)

# QUERY_HCA_CAP op_mod = (capability type << 1) | (1: current values, 0: maximum values); type 0 = general caps.
HCA_CAP_GENERAL_CUR = 1

QPC_ST_RC = 0x0
QPC_PM_STATE_MIGRATED = 0x3
QPC_RQ_TYPE_ZERO_LEN = 0x3       # no receive queue (0 regular, 1 SRQ): the QP never consumes a receive WQE
QPC_ATOMIC_MODE_UP_TO_64 = 0x3   # extended atomics of at most 64 bits, what NVSHMEM uses
CQE_SZ_64 = 0x0

# Output sizes in bytes: status (u8 @0), syndrome (be32 @4), then the command's own fields.
CREATE_CQ_OUT = 16
CREATE_QP_OUT = 16
MODIFY_QP_OUT = 16
QUERY_HCA_CAP_OUT = 16 + 4096    # header + the capability union (mlx5_ifc: 0x8000 bits); general caps: its first 256 B

# ---------------------------------------------------------------------------------------------------------------
# Bit fields. The PRM numbers the bits of a struct from the most significant bit of byte 0: the struct is one
# big-endian bit string, bit 0 = the MSB (0x80) of byte 0, bit 7 = its LSB, bit 8 = the MSB of byte 1, and so
# on (mlx5_ifc.h's "reserved_at_X" is a field at bit X). A field at offset o of width w holds its value
# big-endian in bits o .. o+w-1: its most significant bit at bit o. So a 24-bit field at 0x48 is bytes 9..11
# as a big-endian integer, and a 3-bit field at 0x40 is the top three bits of byte 8.
# ---------------------------------------------------------------------------------------------------------------

Layout = Dict[str, Tuple[int, Union[int, "Layout"]]]   # name -> (bit offset, width in bits | nested layout)


def _put(buf: bytearray, bit: int, width: int, value: int, name: str) -> None:
    value = int(value)
    if value < 0 or value >> width:
        raise ValueError(f"PRM field {name} is {width} bit(s) wide: {value:#x} does not fit")
    first, last = bit // 8, (bit + width - 1) // 8
    shift = (last + 1) * 8 - (bit + width)                 # bits below the field in its byte span
    word = int.from_bytes(buf[first:last + 1], "big")
    mask = ((1 << width) - 1) << shift
    buf[first:last + 1] = ((word & ~mask) | (value << shift)).to_bytes(last - first + 1, "big")


def _get(buf: bytes, bit: int, width: int) -> int:
    first, last = bit // 8, (bit + width - 1) // 8
    shift = (last + 1) * 8 - (bit + width)
    return (int.from_bytes(buf[first:last + 1], "big") >> shift) & ((1 << width) - 1)


def _write(buf: bytearray, layout: Layout, values: Mapping, base: int = 0, where: str = "") -> None:
    for name, value in values.items():
        offset, width = layout[name]
        if isinstance(width, dict):
            _write(buf, width, value, base + offset, f"{where}{name}.")
        else:
            _put(buf, base + offset, width, value, where + name)


def _encode(size: int, layout: Layout, values: Mapping) -> bytes:
    buf = bytearray(size)
    _write(buf, layout, values)
    return bytes(buf)


# The command header every input starts with (opcode, op_mod) and every output (status, syndrome).
_IN_HDR: Layout = {"opcode": (0x00, 16), "op_mod": (0x30, 16)}
_OUT_HDR: Layout = {"status": (0x00, 8), "syndrome": (0x20, 32)}

CQC: Layout = {                          # 64 bytes (cqc)
    "dbr_umem_valid": (0x06, 1),
    "cqe_sz": (0x08, 3),                 # 0: 64-byte CQEs
    "cc": (0x0b, 1),                     # collapsed: every CQE is written to entry 0
    "oi": (0x0e, 1),                     # overrun ignore: the NIC never waits for the consumer index
    "dbr_umem_id": (0x20, 32),
    "log_cq_size": (0x63, 5),
    "uar_page": (0x68, 24),
    # The kernel's mlx5_ifc.h names this whole dword c_eqn_or_apu_element[0x20]; scapy (and older headers) keep
    # only its low byte as c_eqn, the rest reserved. The values agree for every EQN below 256.
    "c_eqn": (0xa0, 32),
    "log_page_size": (0xc3, 5),          # log2(page size / 4 KiB)
    "dbr_addr": (0x1c0, 64),             # with dbr_umem_valid: the offset in the DBR UMEM; bits 2..0 reserved
}

ADS: Layout = {                          # 44 bytes (ads: an address path)
    "pkey_index": (0x10, 16),
    "grh": (0x28, 1),
    "rlid": (0x30, 16),
    "ack_timeout": (0x40, 5),
    "src_addr_index": (0x48, 8),
    "hop_limit": (0x58, 8),
    "tclass": (0x64, 8),
    "rgid_rip": (0x80, 128),
    "dscp": (0x10a, 6),                  # the byte at 0x108 is ecn[2] dscp[6]
    "udp_sport": (0x110, 16),
    "eth_prio": (0x121, 3),
    "sl": (0x124, 4),
    "vhca_port_num": (0x128, 8),
    "rmac": (0x130, 48),                 # rmac_47_32 and rmac_31_0 in mlx5_ifc.h
}

QPC: Layout = {                          # 232 bytes (qpc)
    "st": (0x08, 8),
    "pm_state": (0x13, 2),
    "pd": (0x28, 24),
    "mtu": (0x40, 3),
    "log_msg_max": (0x43, 5),
    "log_rq_size": (0x49, 4),
    "log_sq_size": (0x51, 4),
    "uar_page": (0x68, 24),
    "user_index": (0x88, 24),
    "log_page_size": (0xa3, 5),
    "remote_qpn": (0xa8, 24),
    "primary_address_path": (0xc0, ADS),
    "log_ack_req_freq": (0x380, 4),
    "log_sra_max": (0x388, 3),
    "retry_count": (0x38d, 3),
    "rnr_retry": (0x390, 3),
    "next_send_psn": (0x3c8, 24),
    "cqn_snd": (0x3e8, 24),
    "log_rra_max": (0x488, 3),
    "atomic_mode": (0x48c, 4),
    "rre": (0x490, 1),
    "rwe": (0x491, 1),
    "rae": (0x492, 1),
    "min_rnr_nak": (0x4a3, 5),
    "next_rcv_psn": (0x4a8, 24),
    "cqn_rcv": (0x4e8, 24),
    "dbr_addr": (0x500, 64),
    "rq_type": (0x565, 3),
    "cs_req": (0x630, 8),
    "cs_res": (0x638, 8),
    "dbr_umem_valid": (0x683, 1),
    "dbr_umem_id": (0x720, 32),
}

CREATE_CQ_IN: Layout = {**_IN_HDR,       # 272 bytes
                        "cq_context": (0x80, CQC),
                        "cq_umem_offset": (0x280, 64),
                        "cq_umem_id": (0x2c0, 32),
                        "cq_umem_valid": (0x2e0, 1)}
CREATE_QP_IN: Layout = {**_IN_HDR,       # 272 bytes
                        "qpc": (0xc0, QPC),
                        "wq_umem_offset": (0x800, 64),
                        "wq_umem_id": (0x840, 32),
                        "wq_umem_valid": (0x860, 1)}
MODIFY_QP_IN: Layout = {**_IN_HDR,       # 272 bytes: rst2init, init2rtr and rtr2rts_qp_in share it
                        "qpn": (0x48, 24),
                        "opt_param_mask": (0x80, 32),
                        "qpc": (0xc0, QPC)}
QUERY_HCA_CAP_IN: Layout = dict(_IN_HDR)   # 16 bytes
CREATE_OBJ_OUT: Layout = {**_OUT_HDR, "obj": (0x48, 24)}   # the cqn of CREATE_CQ, the qpn of CREATE_QP

CMD_HCA_CAP: Layout = {                  # general device caps: 256 bytes at byte 16 of the QUERY_HCA_CAP output
    "log_max_qp_sz": (0x88, 8),
    "log_max_cq_sz": (0xc8, 8),
    "log_max_ra_req_qp": (0x14a, 6),
    "log_max_ra_res_qp": (0x15a, 6),
    "port_type": (0x1b6, 2),
    "num_ports": (0x1b8, 8),
    "log_max_msg": (0x1c3, 5),
    "cqe_version": (0x1fc, 4),
    "log_bf_reg_size": (0x26b, 5),
}

# name -> (size in bytes, layout): every struct above, for the tests and for sanity checks.
LAYOUTS: Dict[str, Tuple[int, Layout]] = {
    "cqc": (64, CQC), "ads": (44, ADS), "qpc": (232, QPC),
    "create_cq_in": (272, CREATE_CQ_IN), "create_qp_in": (272, CREATE_QP_IN), "modify_qp_in": (272, MODIFY_QP_IN),
    "query_hca_cap_in": (16, QUERY_HCA_CAP_IN), "create_obj_out": (16, CREATE_OBJ_OUT),
    "cmd_hca_cap": (256, CMD_HCA_CAP),
}


# ---------------------------------------------------------------------------------------------------------------
# Encoders
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AddressPath:
    """The qpc's primary address path (ads) for INIT2RTR.

    InfiniBand: rlid + sl (+ grh=True, rgid, src_addr_index, hop_limit for a routed path).
    RoCE: grh=True, rgid, rmac (the next hop's MAC, never zero), src_addr_index, hop_limit, tclass, udp_sport,
    eth_prio. A non-zero rmac is what marks the path as RoCE. The encoding follows the kernel's mlx5_set_path:
    RoCE leaves the ads grh bit clear (it is InfiniBand's "send a GRH"; RoCE always carries one; NVSHMEM and
    rdma-core's DevX tests leave it clear too) and sets dscp = tclass >> 2; the ECN bits (tclass & 3) are not
    written to the ads' ecn field (neither the kernel nor NVSHMEM does: ECN marking is the NIC's congestion
    control configuration), they stay in the tclass field, which is written on both link layers.
    """
    vhca_port_num: int       # 1-based port
    rlid: int = 0            # InfiniBand: the peer's LID
    sl: int = 0              # InfiniBand service level
    grh: bool = False        # True for RoCE (always) and for IB with a GID
    rgid: bytes = bytes(16)  # the peer's GID (16 bytes, network order)
    rmac: bytes = bytes(6)   # RoCE: the next hop's MAC
    src_addr_index: int = 0  # my GID index
    hop_limit: int = 255
    tclass: int = 0          # traffic class: RoCE DSCP = tclass >> 2 (ads.dscp); the whole byte in ads.tclass
    udp_sport: int = 0       # RoCE v2 UDP source port
    eth_prio: int = 0        # RoCE: 802.1p priority (sl & 7)
    ack_timeout: int = 20

    @property
    def roce(self) -> bool:
        return bytes(self.rmac) != bytes(6)

    def ads(self) -> Dict[str, int]:
        rgid, rmac = bytes(self.rgid), bytes(self.rmac)
        if len(rgid) != 16 or len(rmac) != 6:
            raise ValueError(f"AddressPath: rgid must be 16 bytes and rmac 6, got {len(rgid)} and {len(rmac)}")
        v = {"vhca_port_num": self.vhca_port_num, "rlid": self.rlid, "sl": self.sl, "tclass": self.tclass,
             "ack_timeout": self.ack_timeout, "udp_sport": self.udp_sport, "eth_prio": self.eth_prio,
             "rmac": int.from_bytes(rmac, "big"), "grh": int(self.grh and not self.roce)}
        if self.grh or self.roce:
            v.update(rgid_rip=int.from_bytes(rgid, "big"), src_addr_index=self.src_addr_index,
                     hop_limit=self.hop_limit)
        if self.roce:
            v["dscp"] = self.tclass >> 2
        return v


def create_cq_in(*, log_cq_size: int, uar_page: int, eqn: int, cq_umem_id: int, dbr_umem_id: int,
                 log_page_size: int = 0, cq_umem_offset: int = 0, dbr_offset: int = 0, collapsed: bool = True,
                 overrun_ignore: bool = True) -> bytes:
    """CREATE_CQ: 64-byte CQEs (cqe_sz 0) in a UMEM, the doorbell record at dbr_offset (8-aligned) in another."""
    if dbr_offset % 8:
        raise ValueError(f"CREATE_CQ: the doorbell record offset {dbr_offset:#x} must be 8-byte aligned")
    cqc = {"dbr_umem_valid": 1, "cqe_sz": CQE_SZ_64, "cc": int(collapsed), "oi": int(overrun_ignore),
           "dbr_umem_id": dbr_umem_id, "log_cq_size": log_cq_size, "uar_page": uar_page, "c_eqn": eqn,
           "log_page_size": log_page_size, "dbr_addr": dbr_offset}
    return _encode(272, CREATE_CQ_IN, {"opcode": CMD_CREATE_CQ, "cq_context": cqc, "cq_umem_offset": cq_umem_offset,
                                       "cq_umem_id": cq_umem_id, "cq_umem_valid": 1})


def create_qp_in(*, pdn: int, uar_page: int, cqn_snd: int, cqn_rcv: int, log_sq_size: int, wq_umem_id: int,
                 dbr_umem_id: int, wq_umem_offset: int = 0, dbr_offset: int = 0, log_page_size: int = 0,
                 user_index: int = 0) -> bytes:
    """CREATE_QP: an RC QP (migrated path state) with a zero-length RQ, so its SQ starts at WQ offset 0; no
    scatter-to-CQE (cs_req = cs_res = 0); WQ and doorbell record in UMEMs."""
    qpc = {"st": QPC_ST_RC, "pm_state": QPC_PM_STATE_MIGRATED, "pd": pdn, "uar_page": uar_page,
           "rq_type": QPC_RQ_TYPE_ZERO_LEN, "log_rq_size": 0, "log_sq_size": log_sq_size, "cqn_snd": cqn_snd,
           "cqn_rcv": cqn_rcv, "cs_req": 0, "cs_res": 0, "dbr_umem_valid": 1, "dbr_umem_id": dbr_umem_id,
           "dbr_addr": dbr_offset, "user_index": user_index, "log_page_size": log_page_size}
    return _encode(272, CREATE_QP_IN, {"opcode": CMD_CREATE_QP, "qpc": qpc, "wq_umem_offset": wq_umem_offset,
                                       "wq_umem_id": wq_umem_id, "wq_umem_valid": 1})


def _modify(opcode: int, qpn: int, qpc: Mapping) -> bytes:
    return _encode(272, MODIFY_QP_IN, {"opcode": opcode, "qpn": qpn, "opt_param_mask": 0, "qpc": qpc})


def rst2init_qp_in(*, qpn: int, vhca_port_num: int, pkey_index: int = 0, atomic_mode: int = QPC_ATOMIC_MODE_UP_TO_64,
                   rwe: bool = True, rre: bool = True, rae: bool = True) -> bytes:
    """RST2INIT_QP: remote access rights, atomic mode and port; pm_state MIGRATED again (as NVSHMEM does)."""
    return _modify(CMD_RST2INIT_QP, qpn, {
        "rwe": int(rwe), "rre": int(rre), "rae": int(rae), "atomic_mode": atomic_mode,
        "pm_state": QPC_PM_STATE_MIGRATED,
        "primary_address_path": {"vhca_port_num": vhca_port_num, "pkey_index": pkey_index}})


def init2rtr_qp_in(*, qpn: int, mtu: int, remote_qpn: int, path: AddressPath, log_rra_max: int,
                   log_msg_max: int = 30, min_rnr_nak: int = 12, next_rcv_psn: int = 0) -> bytes:
    """INIT2RTR_QP: path MTU (in bytes, a key of MTU), the peer QP, its address path, the responder's
    outstanding RDMA-read/atomic depth (log2, at most 7); opt_param_mask 0."""
    if mtu not in MTU:
        raise ValueError(f"INIT2RTR: MTU {mtu} is not one of {sorted(MTU)}")
    return _modify(CMD_INIT2RTR_QP, qpn, {
        "mtu": MTU[mtu], "log_msg_max": log_msg_max, "remote_qpn": remote_qpn, "min_rnr_nak": min_rnr_nak,
        "log_rra_max": log_rra_max, "next_rcv_psn": next_rcv_psn, "primary_address_path": path.ads()})


def rtr2rts_qp_in(*, qpn: int, log_sra_max: int, retry_count: int = 7, rnr_retry: int = 7, ack_timeout: int = 20,
                  next_send_psn: int = 0, log_ack_req_freq: int = 0) -> bytes:
    """RTR2RTS_QP: retries, the ACK timeout (4.096 us * 2^ack_timeout), the requester's outstanding
    RDMA-read/atomic depth (log2, at most 7), the first PSN; opt_param_mask 0."""
    return _modify(CMD_RTR2RTS_QP, qpn, {
        "log_ack_req_freq": log_ack_req_freq, "log_sra_max": log_sra_max, "retry_count": retry_count,
        "rnr_retry": rnr_retry, "next_send_psn": next_send_psn,
        "primary_address_path": {"ack_timeout": ack_timeout}})


def query_hca_cap_in(op_mod: int) -> bytes:
    """QUERY_HCA_CAP; op_mod HCA_CAP_GENERAL_CUR (1) = the general device caps, HCA_CAP_ATOMIC_CUR the atomic
    ones, current values."""
    return _encode(16, QUERY_HCA_CAP_IN, {"opcode": CMD_QUERY_HCA_CAP, "op_mod": op_mod})


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------

_STATUS = {0x01: "internal error", 0x02: "bad operation", 0x03: "bad parameter", 0x04: "bad system state",
           0x05: "bad resource", 0x06: "resource busy", 0x08: "limits exceeded", 0x09: "bad resource state",
           0x0a: "bad index", 0x0f: "no resources", 0x10: "bad QP state", 0x30: "bad packet",
           0x40: "bad size (too many outstanding CQEs)", 0x50: "bad input length", 0x51: "bad output length"}


def _need(out: bytes, size: int, what: str) -> None:
    if len(out) < size:
        raise ValueError(f"{what}: output of {len(out)} bytes, expected at least {size}")


def check_status(out: bytes, what: str) -> None:
    """Raise RuntimeError naming `what`, the status (byte 0) and the syndrome (be32 at byte 4) if status != 0."""
    _need(out, 8, what)
    status = _get(out, *_OUT_HDR["status"])
    if status:
        syndrome = _get(out, *_OUT_HDR["syndrome"])
        raise RuntimeError(f"{what} failed: status {status:#04x} ({_STATUS.get(status, 'unknown status')}), "
                           f"syndrome {syndrome:#010x}")


def cqn_of(out: bytes) -> int:
    """The CQ number of a CREATE_CQ output (raises as check_status does if the command failed)."""
    _need(out, CREATE_CQ_OUT, "CREATE_CQ")
    check_status(out, "CREATE_CQ")
    return _get(out, *CREATE_OBJ_OUT["obj"])


def qpn_of(out: bytes) -> int:
    """The QP number of a CREATE_QP output (raises as check_status does if the command failed)."""
    _need(out, CREATE_QP_OUT, "CREATE_QP")
    check_status(out, "CREATE_QP")
    return _get(out, *CREATE_OBJ_OUT["obj"])


# Atomic caps (capability type 3): not in rdma-core's scapy classes; the Linux kernel's mlx5_ifc.h
# (struct mlx5_ifc_atomic_caps_bits, the same in UCX's and NVSHMEM's copies). The driver sets mode 1 (host
# endianness) at probe time wherever the HCA supports it (mlx5_core handle_hca_cap_atomic); NVSHMEM reads both.
HCA_CAP_ATOMIC_CUR = (0x3 << 1) | 1
ATOMIC_CAPS: Layout = {"atomic_req_8B_endianness_mode": (0x40, 2),
                       "supported_atomic_req_8B_endianness_mode_1": (0x46, 1)}


def atomic_results_big_endian(out: bytes) -> bool:
    """From a QUERY_HCA_CAP (atomic, current) output: whether 8-byte atomic results come back big-endian (mode 0)
    rather than in host order (mode 1, only where supported); raises if the command failed."""
    _need(out, 16 + 16, "QUERY_HCA_CAP (atomic)")
    check_status(out, "QUERY_HCA_CAP (atomic)")
    mode = _get(out, 128 + ATOMIC_CAPS["atomic_req_8B_endianness_mode"][0], 2)
    supported = _get(out, 128 + ATOMIC_CAPS["supported_atomic_req_8B_endianness_mode_1"][0], 1)
    return not (supported and mode == 1)


@dataclass(frozen=True)
class GeneralCaps:
    cqe_version: int         # the GPU reads version-1 CQEs
    log_max_qp_sz: int       # log2 of the most WQEBBs in a WQ
    log_max_cq_sz: int       # log2 of the most CQEs in a CQ
    log_max_ra_req_qp: int   # log2 of the most outstanding RDMA reads/atomics a requester may have (qpc 3 bits: <= 7)
    log_max_ra_res_qp: int   # the same as a responder
    log_max_msg: int         # log2 of the largest message
    port_type: int = 0       # 0 InfiniBand, 1 Ethernet
    num_ports: int = 0
    log_bf_reg_size: int = 0  # log2 of a BlueFlame register's size


def general_caps(out: bytes) -> GeneralCaps:
    """Parse a QUERY_HCA_CAP (general, op_mod HCA_CAP_GENERAL_CUR) output; raises if the command failed."""
    _need(out, 16 + 256, "QUERY_HCA_CAP")
    check_status(out, "QUERY_HCA_CAP")
    return GeneralCaps(**{f.name: _get(out, 128 + CMD_HCA_CAP[f.name][0], CMD_HCA_CAP[f.name][1])
                          for f in fields(GeneralCaps)})
