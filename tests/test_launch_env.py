"""deepep_portable.launch_env: each launcher's variables -> rank, world, local rank, rendezvous; which
launcher wins when several are present; the interface choice; the rendezvous channels. CPU only; the
real job across two hosts is tests/test_two_hosts.py."""
from __future__ import annotations

import dataclasses
import socket
import threading

import pytest

from deepep_portable import launch_env
from deepep_portable.launch_env import LaunchInfo, read_launch

TORCHRUN = dict(RANK="5", WORLD_SIZE="16", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="10.0.0.7",
                MASTER_PORT="29500", TORCHELASTIC_RUN_ID="run7")
OPENMPI = dict(OMPI_COMM_WORLD_RANK="6", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="2",
               OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_RANK="6", PMIX_NAMESPACE="2043346945",
               OMPI_MCA_ess_base_jobid="2043346945")
SRUN = dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8", SLURM_LOCALID="1", SLURM_NODEID="1",
            SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_STEP_NODELIST="gpu-[003-004]", SLURM_NODELIST="gpu-[001-004]",
            SLURM_JOB_ID="81234", SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="2")
HYDRA = dict(PMI_RANK="3", PMI_SIZE="4", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2", PMI_KVSNAME="kvs_77")


# ---- each launcher -------------------------------------------------------------------------------
def test_torchrun():
    assert read_launch(TORCHRUN) == LaunchInfo("torchrun", 5, 16, 1, 4, "10.0.0.7", 29500, "run7")


def test_openmpi_gives_no_rendezvous():
    assert read_launch(OPENMPI) == LaunchInfo("openmpi", 6, 8, 2, 4, None, None, "2043346945")


def test_srun_rendezvous_on_the_first_node_of_the_step():
    info = read_launch(SRUN)
    assert info == LaunchInfo("slurm", 5, 8, 1, 4, "gpu-003", None, "81234.0")
    every_task = {launch_env.rendezvous(read_launch({**SRUN, "SLURM_PROCID": str(r)})) for r in range(8)}
    assert every_task == {("gpu-003", launch_env.slurm_port("81234.0"))}
    assert launch_env.rendezvous(read_launch({**SRUN, "MASTER_PORT": "29400"})) == ("gpu-003", 29400)


def test_srun_uneven_tasks_per_node():
    env = {**SRUN, "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3",
           "SLURM_STEP_NUM_NODES": "4"}
    assert read_launch(env).local_size == 1
    assert read_launch({**env, "SLURM_NODEID": "0"}).local_size == 2


def test_srun_on_one_node_is_one_host():
    env = {k: v for k, v in SRUN.items() if "TASKS_PER_NODE" not in k}
    assert read_launch({**env, "SLURM_STEP_NUM_NODES": "1"}).one_host


def test_mpich_hydra():
    assert read_launch(HYDRA) == LaunchInfo("pmi", 3, 4, 1, 2, None, None, "kvs_77")


def test_srun_pmi2_takes_the_node_from_slurm():
    env = dict(PMI_RANK="5", PMI_SIZE="8", **{k: v for k, v in SRUN.items()})
    assert read_launch(env) == LaunchInfo("pmi", 5, 8, 1, 4, None, None, None)


def test_not_launched():
    assert read_launch({}) is None
    assert read_launch({"PMIX_RANK": "0"}) is None   # no world size in the environment


@pytest.mark.parametrize("nodelist, first", [("node7", "node7"), ("gpu-[003-005,010],cpu1", "gpu-003"),
                                             ("a[1,3],b[2-4]", "a1"), ("rack[2-3]-n[09-12]", "rack2-n09"),
                                             ("h1,h2", "h1")])
def test_first_slurm_host(nodelist, first):
    assert launch_env.first_slurm_host(nodelist) == first


def test_slurm_tasks_per_node():
    assert launch_env.slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="tasks per node"):
        launch_env.slurm_tasks_per_node("two")


def test_bad_number_names_the_variable():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK"):
        read_launch({**OPENMPI, "OMPI_COMM_WORLD_RANK": "x"})


# ---- precedence ----------------------------------------------------------------------------------
def test_torchrun_under_srun_is_torchrun():
    assert read_launch({**SRUN, **TORCHRUN}).launcher == "torchrun"


def test_mpirun_inside_a_slurm_allocation_is_openmpi():
    assert read_launch({**SRUN, **OPENMPI, "SLURM_PROCID": "0"}).rank == 6


def test_hydra_proxies_under_slurm_are_not_ranks():
    assert read_launch({**SRUN, **HYDRA, "SLURM_PROCID": "0"}).rank == 3


def test_user_master_addr_port_count_under_mpirun():
    info = read_launch({**OPENMPI, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert launch_env.rendezvous(info, {}) == ("head", 1234)


# ---- interface -----------------------------------------------------------------------------------
FAKE_INTERFACES = [("lo", "127.0.0.1"), ("eth9", "10.1.2.3"), ("ib0", "10.9.9.9")]
SPANS = LaunchInfo("openmpi", 1, 8, 1, 4, "10.9.0.1", None)


@pytest.fixture
def fake_host(monkeypatch):
    monkeypatch.setattr(launch_env, "ipv4_interfaces", lambda: list(FAKE_INTERFACES))
    routes = {}
    monkeypatch.setattr(launch_env, "_route_source", lambda host: routes.get(host))
    return routes


def test_one_host_job_stays_on_loopback(fake_host):
    got = launch_env.choose_interface(LaunchInfo("openmpi", 1, 4, 1, 4), {})
    assert (got.name, got.address) == ("lo", "127.0.0.1")


def test_interface_towards_the_rendezvous_host(fake_host):
    fake_host["10.9.0.1"] = "10.9.9.9"
    got = launch_env.choose_interface(SPANS, {})
    assert (got.name, got.address) == ("ib0", "10.9.9.9") and "rendezvous" in got.why


def test_first_non_loopback_when_no_route(fake_host):
    fake_host["10.9.0.1"] = "127.0.1.1"   # e.g. a host name that resolves to Debian's 127.0.1.1
    assert launch_env.choose_interface(SPANS, {}).address == "10.1.2.3"
    assert launch_env.choose_interface(LaunchInfo("openmpi", 1, 8, None, None), {}).address == "10.1.2.3"


@pytest.mark.parametrize("variable", launch_env.IFNAME_VARIABLES)
def test_interface_override(fake_host, variable):
    fake_host["10.9.0.1"] = "10.1.2.3"
    assert launch_env.choose_interface(SPANS, {variable: "ib0"}).name == "ib0"
    one_host = LaunchInfo("openmpi", 1, 4, 1, 4)
    assert launch_env.choose_interface(one_host, {variable: "ib"}).address == "10.9.9.9"   # a prefix, as NCCL's


def test_override_order_and_syntax(fake_host):
    env = {"DEEPEP_PORTABLE_IFNAME": "eth9", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert launch_env.choose_interface(SPANS, env).name == "eth9"
    assert launch_env.choose_interface(SPANS, {"NCCL_SOCKET_IFNAME": "^eth"}).name == "ib0"
    with pytest.raises(RuntimeError, match="NCCL_SOCKET_IFNAME='=ib'.*eth9 10.1.2.3"):
        launch_env.choose_interface(SPANS, {"NCCL_SOCKET_IFNAME": "=ib"})


def test_no_address_to_offer(monkeypatch):
    monkeypatch.setattr(launch_env, "ipv4_interfaces", lambda: [("lo", "127.0.0.1")])
    with pytest.raises(RuntimeError, match="DEEPEP_PORTABLE_IFNAME"):
        launch_env.choose_interface(LaunchInfo("openmpi", 1, 8, 1, 4), {})


def test_gloo_interface_set_only_when_the_job_spans_hosts(fake_host):
    fake_host["10.9.0.1"] = "10.9.9.9"
    env = {}
    assert launch_env.set_gloo_interface(SPANS, "10.9.0.1", env) == "ib0" and env == {"GLOO_SOCKET_IFNAME": "ib0"}
    env = {"GLOO_SOCKET_IFNAME": "eth9"}   # the user's choice stays
    assert launch_env.set_gloo_interface(SPANS, "10.9.0.1", env) is None and env["GLOO_SOCKET_IFNAME"] == "eth9"
    env = {}
    assert launch_env.set_gloo_interface(LaunchInfo("openmpi", 1, 4, 1, 4), "127.0.0.1", env) is None and env == {}


# ---- this machine's real interfaces --------------------------------------------------------------
def test_loopback_on_this_machine():
    assert ("lo", "127.0.0.1") in launch_env.ipv4_interfaces()
    assert launch_env.interface_name("127.0.0.1") == "lo"
    assert launch_env.interface_name("203.0.113.77") is None   # an address no interface holds


def test_real_route_to_an_address_of_this_machine():
    own = [(n, a) for n, a in launch_env.ipv4_interfaces() if not a.startswith("127.")]
    if not own:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, addr = own[0]
    got = launch_env.choose_interface(LaunchInfo("openmpi", 1, 8, 1, 4, addr, None), {})
    assert (got.name, got.address) == (name, addr)


def test_real_override_with_lo():
    got = launch_env.choose_interface(SPANS, {"DEEPEP_PORTABLE_IFNAME": "lo"})
    assert (got.name, got.address) == ("lo", "127.0.0.1")


# ---- rendezvous channels -------------------------------------------------------------------------
def test_rendezvous_file(tmp_path):
    path = tmp_path / "rdzv"
    path.write_text("stale-job 10.0.0.1:1\n")   # a previous job's line is never taken
    env = {"DEEPEP_PORTABLE_RENDEZVOUS_FILE": str(path)}
    info = LaunchInfo("openmpi", 0, 2, 0, 2, None, None, "job42")
    got = {}
    reader = threading.Thread(target=lambda: got.update(r1=launch_env.rendezvous(
        LaunchInfo("openmpi", 1, 2, 1, 2, None, None, "job42"), env, timeout_s=30)))
    reader.start()
    got["r0"] = launch_env.rendezvous(info, env)
    reader.join(timeout=60)
    assert got["r0"] == got["r1"] and got["r0"][0] == "127.0.0.1"   # one host: the loopback
    with socket.socket() as s:
        s.bind(("", got["r0"][1]))   # rank 0 named a free port


def test_rendezvous_file_waits_for_its_own_job(tmp_path):
    path = tmp_path / "rdzv"
    path.write_text("old 10.0.0.1:1\n")
    with pytest.raises(TimeoutError, match="job new"):
        launch_env.rendezvous(LaunchInfo("openmpi", 1, 2, 1, 2, None, None, "new"),
                              {"DEEPEP_PORTABLE_RENDEZVOUS_FILE": str(path)}, timeout_s=0.3)


class FakeComm:
    def __init__(self, rank, size, root_value=None):
        self.rank, self.size, self.root_value = rank, size, root_value

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, value, root=0):
        return value if self.rank == root else self.root_value


def test_rendezvous_over_mpi(fake_host):
    rank0 = launch_env.rendezvous(LaunchInfo("openmpi", 0, 8, 0, 4), {}, mpi_comm=FakeComm(0, 8))
    assert rank0[0] == "10.1.2.3"   # spans hosts: rank 0's routable address, never the loopback
    shared = f"{rank0[0]}:{rank0[1]}"
    rank5 = launch_env.rendezvous(LaunchInfo("openmpi", 5, 8, 1, 4), {}, mpi_comm=FakeComm(5, 8, shared))
    assert rank5 == rank0


def test_no_rendezvous_says_what_to_set():
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT"):   # mpi4py of another MPI: a singleton
        launch_env.rendezvous(LaunchInfo("openmpi", 1, 8, 1, 4), {}, mpi_comm=FakeComm(0, 1))
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT"):
        launch_env.rendezvous(LaunchInfo("torchrun", 1, 8, 1, 4), {})


def test_prepare_torch_env_under_srun(fake_host):
    fake_host["gpu-003"] = "10.9.9.9"
    env = dict(SRUN)
    info = launch_env.prepare_torch_env(env)
    assert info.launcher == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "8", "1", "4")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu-003", str(launch_env.slurm_port("81234.0")))
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    # afterwards the environment reads as torchrun's, with the same numbers
    expected = dataclasses.replace(info, launcher="torchrun", master_port=int(env["MASTER_PORT"]), job_id=None)
    assert read_launch(env) == expected


def test_spawn_reads_the_launcher(monkeypatch):
    from deepep_portable.tools import spawn

    for k in list(TORCHRUN) + list(OPENMPI) + list(SRUN) + list(HYDRA):
        monkeypatch.delenv(k, raising=False)
    assert spawn.launched_rank_world() is None
    for k, v in OPENMPI.items():
        monkeypatch.setenv(k, v)
    assert spawn.launched_rank_world() == (6, 8)
