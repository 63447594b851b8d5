"""A job across two hosts, for real, on one machine: two network namespaces joined by a veth pair.

Host A is 10.213.0.1/24, host B 10.213.0.2/24; each has its own loopback, so an address of 127.0.0.1
advertised by one host is unreachable from the other (as on two machines). Two ranks run on each host
(tests/two_hosts_job.py: a gloo group formed by the launch code, then a dispatch -> combine round trip
over the reference transport, checked against tests/oracle.py). The job is launched:

  * as torchrun does: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (host A),
    MASTER_PORT per process;
  * as Open MPI's mpirun does: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/NODE_RANK, PMIX_RANK,
    PMIX_NAMESPACE and OMPI_MCA_ess_base_jobid per process, and no MASTER_ADDR/MASTER_PORT. What is
    emulated: the variables (mpirun's own daemons and MPI itself are not used, mpi4py is never
    imported), so rank 0's address and port reach the other ranks through the launch code's non-MPI
    channel, DEEPEP_PORTABLE_RENDEZVOUS_FILE (the namespaces share the file system, as cluster hosts
    share one). Rank 0 must choose host A's routable address by itself (nobody names it), and every
    rank the interface for gloo.
A control run binds gloo to the loopback (GLOO_SOCKET_IFNAME=lo) and must fail: it shows the two hosts
are really apart, so the runs above pass only because the launch code chose the right interface.

Needs root and iproute2 (`ip`); skips with the reason where namespaces cannot be made (e.g. a container
without CAP_SYS_ADMIN). Every process has a hard timeout and the namespaces are always deleted.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "two_hosts_job.py")
HOSTS = ("10.213.0.1", "10.213.0.2")
RANKS_PER_HOST = 2
PROCESS_TIMEOUT_S = 120
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DEEPEP_PORTABLE_IFNAME",
                  "DEEPEP_PORTABLE_RENDEZVOUS_FILE")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def namespaces():
    """Two namespaces ("hosts") joined by a veth pair; deleted afterwards whatever happens."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux only")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (install iproute2)")
    tag = uuid.uuid4().hex[:8]
    names = (f"dpp{tag}a", f"dpp{tag}b")
    made = []
    try:
        for ns in names:
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", "veth0", "netns", names[0], "type", "veth",
                  "peer", "name", "veth0", "netns", names[1])]
        for ns, addr in zip(names, HOSTS):
            steps += [("-n", ns, "addr", "add", f"{addr}/24", "dev", "veth0"), ("-n", ns, "link", "set", "veth0", "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot join the namespaces (`ip {' '.join(step)}`): {r.stderr.strip()}")
        yield names
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_NAMES and not k.startswith(LAUNCHER_PREFIXES)}
    repo = os.path.dirname(HERE)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1",
               DEEPEP_TEST_SEED=str(random.randrange(1 << 20)))
    return env


def _run_job(namespaces, tmp_path, per_rank_env) -> list:
    """Start every rank in its host's namespace; wait (hard timeout); return (rank, rc, output)."""
    base = _clean_env()
    procs = []
    try:
        for rank in range(len(HOSTS) * RANKS_PER_HOST):
            host, local = divmod(rank, RANKS_PER_HOST)
            log = open(tmp_path / f"rank{rank}.log", "w+")
            env = {**base, **per_rank_env(rank, host, local)}
            cmd = ["ip", "netns", "exec", namespaces[host], sys.executable, JOB]
            procs.append((rank, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        results = []
        for rank, proc, log in procs:
            try:
                rc = proc.wait(timeout=PROCESS_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            log.seek(0)
            results.append((rank, rc, log.read()))
        return results
    finally:
        for _, proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def _report(results) -> str:
    return "\n".join(f"--- rank {rank} (rc {rc}) ---\n{out[-3000:]}" for rank, rc, out in results)


def _assert_round_trips(results, gloo_interface: str) -> None:
    assert all(rc == 0 and "round trip ok" in out for _, rc, out in results), _report(results)
    for rank, _, out in results:
        assert f"master {HOSTS[0]}:" in out, f"rank {rank} did not meet on host A's address\n{_report(results)}"
        assert f"gloo_ifname {gloo_interface}" in out, _report(results)


def _as_torchrun(**extra):
    world = len(HOSTS) * RANKS_PER_HOST

    def env(rank, host, local):
        return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                    LOCAL_WORLD_SIZE=str(RANKS_PER_HOST), GROUP_RANK=str(host), MASTER_ADDR=HOSTS[0],
                    MASTER_PORT="29511", TORCHELASTIC_RUN_ID="two-hosts", **extra)
    return env


def test_as_torchrun_launches(namespaces, tmp_path):
    _assert_round_trips(_run_job(namespaces, tmp_path, _as_torchrun()), "veth0")


def _as_mpirun(tmp_path, **extra):
    world = len(HOSTS) * RANKS_PER_HOST
    job = str(random.randrange(1 << 31))

    def env(rank, host, local):
        return dict(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world),
                    OMPI_COMM_WORLD_LOCAL_RANK=str(local), OMPI_COMM_WORLD_LOCAL_SIZE=str(RANKS_PER_HOST),
                    OMPI_COMM_WORLD_NODE_RANK=str(local), PMIX_RANK=str(rank), PMIX_NAMESPACE=job,
                    OMPI_MCA_ess_base_jobid=job, DEEPEP_PORTABLE_RENDEZVOUS_FILE=str(tmp_path / "rendezvous"),
                    **extra)
    return env


def test_as_mpirun_launches(namespaces, tmp_path):
    (tmp_path / "rendezvous").write_text("12345 127.0.0.1:1\n")   # a stale job's line: must be ignored
    _assert_round_trips(_run_job(namespaces, tmp_path, _as_mpirun(tmp_path)), "veth0")


def test_gloo_on_loopback_cannot_span_the_hosts(namespaces, tmp_path):
    """The control: the store on host A's address as before, but gloo bound to 127.0.0.1 (what it does
    by itself where the host name resolves to a loopback address): the job must fail, in gloo."""
    results = _run_job(namespaces, tmp_path, _as_torchrun(GLOO_SOCKET_IFNAME="lo", DEEPEP_TEST_PG_TIMEOUT_S="5"))
    assert any(rc != 0 for _, rc, _ in results), "gloo on the loopback formed a group across the hosts:\n" \
                                                 + _report(results)
    assert any("Gloo connectFullMesh failed" in out for _, _, out in results), _report(results)
