"""`Buffer.transport_info` and `transports.choose`: which backend a Buffer got, why, why not the others, where
it has run for real, the warning when "auto" picks one that has not, and the error that says what to do."""
from __future__ import annotations

import warnings

import pytest

import deepep_portable as deep_ep
from deepep_portable import transports
from deepep_portable.transports import TRANSPORT_NAMES, TransportStatus, registry


def _fake(monkeypatch, usable, reasons=None):
    reasons = reasons or {}
    fake = {n: TransportStatus(n, n in usable, reasons.get(n, "fake reason" if n not in usable else "ok"))
            for n in TRANSPORT_NAMES}
    monkeypatch.setattr(transports, "available_transports", lambda: fake)
    return fake


def test_every_backend_says_where_it_has_run():
    for row in registry.BACKENDS:
        assert row.verified_hardware, row.name
    assert not registry.row("ibgda").ran_on_hardware
    assert "never on a real NIC" in registry.row("ibgda").verified_hardware
    assert "mock only" in registry.row("nccl_gin").verified_hardware
    assert registry.row("reference").verified_hardware.startswith("CPU")
    for name in ("nvlink", "nvshmem"):
        assert "one GPU shared by ranks (H200)" in registry.row(name).verified_hardware
    assert {r.name for r in registry.BACKENDS if r.rdma} == {"nvshmem", "nccl_gin", "ibgda"}


def test_buffer_transport_info_on_the_reference_transport(one_rank_group):
    buf = deep_ep.Buffer(one_rank_group, 1 << 20, 0, transport="reference")
    info = buf.transport_info
    assert info["name"] == buf.transport == "reference"
    assert info["requested"] == "reference"
    assert "asked for by name" in info["why"]
    assert info["verified_hardware"] == registry.row("reference").verified_hardware
    assert info["ran_on_hardware"] is True and info["warning"] is None


def test_buffer_auto_says_why(one_rank_group):
    if transports.resolve("auto", single_node=True) != "reference":
        pytest.skip("auto picks another transport on this machine")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the reference transport has run on real hardware: no warning
        buf = deep_ep.Buffer(one_rank_group, 1 << 20, 0, transport="auto")
    info = buf.transport_info
    assert info["requested"] == "auto" and info["name"] == "reference"
    assert "first usable backend" in info["why"]
    assert set(info["not_chosen"]) == set(TRANSPORT_NAMES) - {"reference"}
    for name, why in info["not_chosen"].items():
        status = deep_ep.available_transports()[name]
        if not status.usable:
            assert why == f"unusable: {status.reason}"


def test_every_other_backend_gets_its_reason(monkeypatch):
    _fake(monkeypatch, {"nvshmem", "nccl_gin", "nvlink", "reference"}, {"ibgda": "no RDMA device"})
    c = transports.choose("auto", single_node=False, warn=False)
    assert c.name == "nvshmem"
    assert c.not_chosen["ibgda"] == "unusable: no RDMA device"
    assert "asked for by name" in c.not_chosen["nccl_gin"]
    assert "one machine only" in c.not_chosen["nvlink"]
    assert "auto prefers 'nvshmem'" in c.not_chosen["reference"]
    c = transports.choose("auto", single_node=True, warn=False)
    assert c.name == "nvlink" and "every rank is on one machine" in c.why
    c = transports.choose("auto", single_node=True, internode_normal=True, warn=False)
    assert c.name == "nvshmem" and "internode kernels" in c.why
    assert "no kernels for the normal mode over several nodes" in c.not_chosen["nvlink"]


def test_auto_warns_at_the_call_site_when_it_picks_a_backend_never_run_on_hardware(monkeypatch):
    _fake(monkeypatch, {"ibgda", "reference"})
    with pytest.warns(RuntimeWarning, match="never run on real hardware") as rec:
        c = transports.choose("auto", single_node=False)
    assert c.name == "ibgda" and c.warning and "NIC model only" in c.warning
    assert rec[0].filename == __file__   # the caller's line, not the library's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert transports.choose("auto", single_node=False, warn=False).warning == c.warning
        assert transports.choose("ibgda").warning is None   # asked for by name: the user knows
        assert transports.resolve("auto", single_node=False) == "ibgda"   # resolve stays quiet


def test_auto_warns_when_a_backend_crosses_machines_for_the_first_time(monkeypatch):
    _fake(monkeypatch, {"nvshmem", "nvlink", "reference"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert transports.choose("auto", single_node=True, internode_normal=True).warning is None   # one machine
    with pytest.warns(RuntimeWarning, match="between machines has never run on real hardware"):
        assert transports.choose("auto", single_node=False).name == "nvshmem"


def test_named_unusable_transport_says_what_to_do_and_each_reason_once(monkeypatch):
    gpu = "no CUDA GPU: libcuda.so.1 not found"
    _fake(monkeypatch, {"reference"}, {n: gpu for n in TRANSPORT_NAMES})
    with pytest.raises(RuntimeError) as e:
        transports.choose("nvshmem")
    msg = str(e.value)
    assert msg.count(gpu) == 1
    assert "transport='auto'" in msg and "would use 'reference'" in msg
    assert "python -m deepep_portable doctor" in msg


def test_no_usable_transport_groups_the_reasons(monkeypatch):
    _fake(monkeypatch, set(), {n: "no CUDA GPU" for n in TRANSPORT_NAMES if n != "reference"} |
          {"reference": "torch.distributed is not available"})
    with pytest.raises(RuntimeError) as e:
        transports.choose("auto", single_node=False)
    msg = str(e.value)
    assert msg.count("no CUDA GPU") == 1 and "torch.distributed is not available" in msg
    assert "python -m deepep_portable doctor" in msg


def test_a_probe_states_each_reason_once():
    from deepep_portable.transports import probe

    s = probe._status("x", ["no GPU", "no library", "no GPU"], "ok", {})
    assert s.reason == "no GPU; no library"


def test_buffer_with_an_unusable_transport_says_what_to_do(one_rank_group):
    status = deep_ep.available_transports()
    name = next((n for n in TRANSPORT_NAMES if not status[n].usable), None)
    if name is None:
        pytest.skip("every transport is usable here")
    with pytest.raises(RuntimeError) as e:
        deep_ep.Buffer(one_rank_group, 1 << 20, 0, transport=name)
    assert str(e.value).count(status[name].reason) == 1
    assert "transport='auto'" in str(e.value) and "doctor" in str(e.value)


def test_doctor_prints_the_auto_choice():
    import io

    from deepep_portable.tools import doctor

    out = io.StringIO()
    doctor._transports(doctor._Out(out))
    text = out.getvalue()
    assert "auto, ranks on this machine only:" in text and "auto, ranks on several machines:" in text
    for row in registry.BACKENDS:
        assert f"has run on: {row.verified_hardware}" in text
