"""`doctor --cluster`'s collective report on every rank of the MPI job, where no network transport is usable (CPU,
gloo): rank 0 prints one report that says so, the round trips run over the reference transport between the first
ranks of every pair of (logical) nodes, and nothing fails.

Run:  mpirun --allow-run-as-root --oversubscribe -n 4 .venv/bin/python -m pytest --with-mpi -q tests/mpi/test_doctor_cluster_mpi.py
"""
from __future__ import annotations

import io
import socket

import pytest
import torch.distributed as dist

from deepep_portable.tools import doctor_cluster
from deepep_portable.transports import available_transports, registry

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_the_report_over_the_reference_transport(pg, ranks_per_node):
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    if size % ranks_per_node:
        pytest.skip(f"{size} ranks do not make nodes of {ranks_per_node}")
    if any(available_transports()[b.name].usable for b in registry.BACKENDS if b.rdma):
        pytest.skip("a network transport is usable here: this test is about the case without one")
    out = io.StringIO()
    assert doctor_cluster.cluster_report(pg, file=out, ranks_per_node=ranks_per_node, timeout_s=60.0, tokens=8,
                                         hidden=256, iters=1) == 0
    text = out.getvalue()
    if rank != 0:
        assert text == ""   # one report, from rank 0
        return
    print(text)
    nodes = size // ranks_per_node
    assert f"{size} ranks, {nodes} nodes" in text
    for section in ("Versions", "Nodes", "Findings", "Transports", "Round trips between nodes", "Verdict"):
        assert f"== {section} " in text
    assert "no network transport is usable on every rank" in text and "what to do:" in text
    assert "reference  usable on every rank" in text
    if nodes == 1:
        assert "one node: no pair of nodes to test" in text
        return
    ok = [ln for ln in text.splitlines() if ln.strip().startswith("OK    reference (baseline")]
    assert len(ok) == nodes * (nodes - 1) // 2, text
    assert all("bit-exact" in ln and "GB/s" in ln for ln in ok)
    assert f"{nodes * (nodes - 1) // 2} round trip(s) passed" in text
    assert "FAIL  reference" not in text


def test_the_report_names_every_host(pg):
    out = io.StringIO()
    doctor_cluster.cluster_report(pg, file=out, timeout_s=60.0, tokens=8, hidden=256, iters=1)
    hosts = [None] * dist.get_world_size(pg)
    dist.all_gather_object(hosts, socket.gethostname(), group=pg)
    if dist.get_rank(pg) == 0:
        assert all(h in out.getvalue() for h in hosts)
        if len(set(hosts)) == 1:
            assert "one node: no pair of nodes to test" in out.getvalue()


def test_a_round_trip_that_comes_back_wrong_is_a_fail(pg, monkeypatch):
    size = dist.get_world_size(pg)
    if size < 2:
        pytest.skip("needs two ranks")
    real = doctor_cluster._pair

    def corrupted(buf, me, a, b, *args):   # the second rank of every pair reports 5 wrong values
        result = real(buf, me, a, b, *args)
        if result is not None and me == b:
            result["wrong"] = 5
        return result

    monkeypatch.setattr(doctor_cluster, "_pair", corrupted)
    out = io.StringIO()
    doctor_cluster.cluster_report(pg, file=out, ranks_per_node=1, timeout_s=60.0, tokens=8, hidden=256, iters=1)
    if dist.get_rank(pg) == 0:
        text = out.getvalue()
        fails = [ln for ln in text.splitlines() if ln.strip().startswith("FAIL  reference")]
        assert len(fails) == size * (size - 1) // 2 and all("5 of " in ln for ln in fails), text
        assert "NCCL_DEBUG=INFO" in text and "0 round trip(s) passed" in text
