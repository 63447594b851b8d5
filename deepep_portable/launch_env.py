"""What the launcher told this process: rank, world size, local rank and size, rendezvous.

`read_launch(env)` reads the environment of the launcher that started this process. The first
launcher whose variables are present wins, in this order:

  1. torchrun (also any `env://` style launch): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
     MASTER_ADDR, MASTER_PORT. First because torchrun is often itself started by srun or mpirun, and
     then the outer launcher's variables describe torchrun's agents, not the training processes.
  2. Open MPI's mpirun / prterun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE. Before Slurm
     because mpirun inside a Slurm allocation inherits the allocation's SLURM_* variables.
  3. MPICH / Intel MPI (PMI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS. Before Slurm
     because Hydra starts its proxies with srun, whose SLURM_PROCID then numbers proxies, not ranks.
  4. Slurm's srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID, the step's
     tasks per node; the rendezvous host is the first node of SLURM_STEP_NODELIST (or SLURM_NODELIST).
PMIX_RANK alone is not used: PMIx puts no world size in the environment, and the launchers that set
it (prterun, srun --mpi=pmix) also set their own variables above.

The rest picks what a multi-host job needs and the launcher may not give:
  * `choose_interface`: this host's address for the job's sockets. DEEPEP_PORTABLE_IFNAME, else
    GLOO_SOCKET_IFNAME, else NCCL_SOCKET_IFNAME names it; else 127.0.0.1 when the whole job is on
    this host; else the interface that routes to the rendezvous host; else the first non-loopback
    IPv4 address.
  * `rendezvous`: MASTER_ADDR:MASTER_PORT (the launcher's or the user's); Slurm: first node plus a
    port derived from the job and step ids; mpirun/PMI: rank 0 picks a free port on its routable
    address and shares "addr:port" through DEEPEP_PORTABLE_RENDEZVOUS_FILE (a path all hosts see)
    when set, else over MPI with mpi4py. Without either, set MASTER_ADDR and MASTER_PORT.
  * `prepare_torch_env`: all of it written into os.environ, so `init_process_group()` (env://)
    works under any launcher; GLOO_SOCKET_IFNAME is set when the job spans hosts (otherwise gloo
    binds to what the host name resolves to, often 127.0.1.1 on Debian).
"""
from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import os
import re
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from typing import List, Mapping, MutableMapping, Optional, Tuple

IFNAME_VARIABLES = ("DEEPEP_PORTABLE_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
RENDEZVOUS_FILE_VARIABLE = "DEEPEP_PORTABLE_RENDEZVOUS_FILE"
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str                      # "torchrun", "openmpi", "pmi" or "slurm"
    rank: int
    world_size: int
    local_rank: Optional[int]          # None: the launcher does not say
    local_size: Optional[int]
    master_addr: Optional[str] = None  # rendezvous host, when the launcher (or the user) gives one
    master_port: Optional[int] = None
    job_id: Optional[str] = None       # tells this job's rendezvous file from a stale one

    @property
    def one_host(self) -> bool:
        """The whole job runs on this host (unknown counts as no)."""
        return self.local_size is not None and self.local_size == self.world_size


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return None


def _first(env: Mapping[str, str], *names: str) -> Optional[str]:
    return next((env[n] for n in names if env.get(n)), None)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "gpu-[003-005,010],cpu1" -> "gpu-003"."""
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())


def slurm_tasks_per_node(spec: str) -> List[int]:
    """Expand Slurm's tasks-per-node notation: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read Slurm tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _slurm_local_size(env: Mapping[str, str], world: int) -> Optional[int]:
    if _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") == 1:
        return world
    spec = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if spec:
        counts = slurm_tasks_per_node(spec)
        node = _int(env, "SLURM_NODEID")
        if len(set(counts)) == 1:
            return counts[0]
        if node is not None and node < len(counts):
            return counts[node]
    return _int(env, "SLURM_NTASKS_PER_NODE")


def read_launch(env: Optional[Mapping[str, str]] = None) -> Optional[LaunchInfo]:
    """This process's place in the job, from its launcher's variables; None when not launched."""
    env = os.environ if env is None else env
    master = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
                          _int(env, "LOCAL_WORLD_SIZE"), master, port, env.get("TORCHELASTIC_RUN_ID"))
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                          master, port, _first(env, "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local, local_size = _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")
        if local is None and _int(env, "SLURM_PROCID") == rank:   # srun --mpi=pmi2: Slurm knows the node
            local, local_size = _int(env, "SLURM_LOCALID"), _slurm_local_size(env, world)
        return LaunchInfo("pmi", rank, world, local, local_size, master, port, _first(env, "PMI_KVSNAME"))
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST")
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        step = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
        return LaunchInfo("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID"),
                          _slurm_local_size(env, world), master or (first_slurm_host(nodelist) if nodelist else None),
                          port, f"{job}.{step}" if job else None)
    return None


# ---- interfaces ----------------------------------------------------------------------------------
_SIOCGIFFLAGS, _SIOCGIFADDR, _IFF_UP = 0x8913, 0x8915, 0x1


def _ioctl(name: str, request: int) -> Optional[bytes]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            return fcntl.ioctl(s.fileno(), request, struct.pack("256s", name.encode()[:15]))
        except OSError:   # no IPv4 address, or not Linux
            return None


def ipv4_interfaces() -> List[Tuple[str, str]]:
    """(name, IPv4 address) of every interface that is up and has one, in index order."""
    found = []
    for _, name in socket.if_nameindex():
        flags, addr = _ioctl(name, _SIOCGIFFLAGS), _ioctl(name, _SIOCGIFADDR)
        if flags and addr and struct.unpack("H", flags[16:18])[0] & _IFF_UP:
            found.append((name, socket.inet_ntoa(addr[20:24])))
    if not found:   # the ioctl gives one address per interface; `ip` lists them all
        try:
            out = subprocess.run(["ip", "-o", "-4", "addr", "show", "up"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        found = [(m.group(1), m.group(2)) for m in re.finditer(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet\s+([\d.]+)", out, re.M)]
    return found


def interface_name(address: str) -> Optional[str]:
    """The interface that holds `address`, or None."""
    return next((name for name, addr in ipv4_interfaces() if addr == address), None)


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _named_interface(spec: str, variable: str) -> Tuple[str, str]:
    """The first interface a name list picks (NCCL's syntax: "eth0,ib", "=eth0" exact, "^docker" excludes)."""
    interfaces = ipv4_interfaces()
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    names = [n for n in spec.lstrip("^").lstrip("=").split(",") if n]
    for name, addr in interfaces:
        hit = any(name == n or (not exact and name.startswith(n)) for n in names)
        if hit != exclude and not (exclude and _is_loopback(addr)):
            return name, addr
    raise RuntimeError(f"{variable}={spec!r} matches no interface with an IPv4 address "
                       f"(this host has: {', '.join(f'{n} {a}' for n, a in interfaces) or 'none'})")


def _route_source(host: str) -> Optional[str]:
    """This host's address on the route to `host` (a UDP connect sends nothing)."""
    try:
        target = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class Interface:
    name: Optional[str]
    address: str
    why: str   # which rule picked it, for messages


def choose_interface(info: Optional[LaunchInfo], env: Optional[Mapping[str, str]] = None) -> Interface:
    """The interface this process's sockets should use (module docstring: the rules in order)."""
    env = os.environ if env is None else env
    for variable in IFNAME_VARIABLES:
        if env.get(variable):
            name, addr = _named_interface(env[variable], variable)
            return Interface(name, addr, f"{variable}={env[variable]}")
    if info is None or info.one_host:
        return Interface("lo", "127.0.0.1", "the whole job is on this host")
    if info.master_addr:
        source = _route_source(info.master_addr)
        if source and not _is_loopback(source):
            return Interface(interface_name(source), source, f"routes to the rendezvous host {info.master_addr}")
    for name, addr in ipv4_interfaces():
        if not _is_loopback(addr):
            return Interface(name, addr, "first non-loopback IPv4 interface")
    raise RuntimeError(f"rank {info.rank}: the job spans hosts but this host has no non-loopback IPv4 address; "
                       f"name the interface with DEEPEP_PORTABLE_IFNAME")


# ---- rendezvous ----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on every address of this host (the store listens on all of them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_port(job_id: str) -> int:
    """A port every task of a Slurm step derives alike from "job.step"."""
    job, _, step = job_id.partition(".")
    digits = int(re.sub(r"\D", "", job) or 0) * 7919 + int(re.sub(r"\D", "", step) or 0)
    return SLURM_PORT_BASE + digits % SLURM_PORT_SPAN


def _rank0_endpoint(info: LaunchInfo, env: Mapping[str, str]) -> str:
    addr = info.master_addr or choose_interface(info, env).address
    return f"{addr}:{info.master_port or free_port()}"


def _through_file(info: LaunchInfo, env: Mapping[str, str], path: str, timeout_s: float) -> str:
    """Rank 0 writes "job addr:port" (atomically); the others wait for their job's line."""
    job = info.job_id or "-"
    if info.rank == 0:
        endpoint = _rank0_endpoint(info, env)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{job} {endpoint}\n")
        os.replace(tmp, path)
        return endpoint
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                written_job, _, endpoint = f.read().strip().partition(" ")
            if endpoint and (written_job == job or info.job_id is None):
                return endpoint
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {info.rank}: rank 0 wrote no rendezvous for job {job} into {path} "
                               f"in {timeout_s:.0f} s ({RENDEZVOUS_FILE_VARIABLE})")
        time.sleep(0.1)


def _through_mpi(info: LaunchInfo, env: Mapping[str, str], comm) -> Optional[str]:
    if comm is None:
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            return None
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size:   # mpi4py built for another MPI: a singleton, not this job
        return None
    return comm.bcast(_rank0_endpoint(info, env) if comm.Get_rank() == 0 else None, root=0)


def rendezvous(info: LaunchInfo, env: Optional[Mapping[str, str]] = None, mpi_comm=None,
               timeout_s: float = 300.0) -> Tuple[str, int]:
    """(address, port) where rank 0 serves the job's store; every rank gets the same answer.

    mpi_comm: an mpi4py communicator over the job's ranks to share rank 0's choice (default
    MPI.COMM_WORLD when mpi4py is installed and the launcher is an MPI one)."""
    env = os.environ if env is None else env
    if info.master_addr and info.master_port:
        endpoint = f"{info.master_addr}:{info.master_port}"
    elif info.master_port and info.one_host:
        endpoint = f"127.0.0.1:{info.master_port}"
    elif info.launcher == "slurm" and info.master_addr and info.job_id:
        endpoint = f"{info.master_addr}:{slurm_port(info.job_id)}"
    elif env.get(RENDEZVOUS_FILE_VARIABLE):
        endpoint = _through_file(info, env, env[RENDEZVOUS_FILE_VARIABLE], timeout_s)
    elif info.world_size == 1:
        endpoint = _rank0_endpoint(info, env)
    else:
        endpoint = _through_mpi(info, env, mpi_comm) if (mpi_comm is not None or info.launcher != "torchrun") else None
        if endpoint is None:
            raise RuntimeError(f"rank {info.rank} ({info.launcher}): no rendezvous; set MASTER_ADDR and MASTER_PORT "
                               f"(rank 0's host and a free port), or {RENDEZVOUS_FILE_VARIABLE}, or install mpi4py")
    addr, _, port = endpoint.rpartition(":")
    return addr, int(port)


def prepare_torch_env(env: Optional[MutableMapping[str, str]] = None, mpi_comm=None) -> Optional[LaunchInfo]:
    """Write RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
    GLOO_SOCKET_IFNAME when the job spans hosts and it is unset) into `env` (default os.environ),
    so that torch.distributed.init_process_group() works as under torchrun (and reads as torchrun's
    from then on, with the same numbers). None when not launched."""
    env = os.environ if env is None else env
    info = read_launch(env)
    if info is None:
        return None
    addr, port = rendezvous(info, env, mpi_comm)
    env.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
    if info.local_rank is not None:
        env.setdefault("LOCAL_RANK", str(info.local_rank))
    if info.local_size is not None:
        env.setdefault("LOCAL_WORLD_SIZE", str(info.local_size))
    set_gloo_interface(info, addr, env)
    return info


def set_gloo_interface(info: LaunchInfo, master_addr: str, env: Optional[MutableMapping[str, str]] = None
                       ) -> Optional[str]:
    """Set GLOO_SOCKET_IFNAME to this host's interface when the job spans hosts and it is unset;
    returns the name set, if any."""
    env = os.environ if env is None else env
    if info.one_host or env.get("GLOO_SOCKET_IFNAME"):
        return None
    chosen = choose_interface(dataclasses.replace(info, master_addr=master_addr), env)
    if chosen.name:
        env["GLOO_SOCKET_IFNAME"] = chosen.name
    return chosen.name
