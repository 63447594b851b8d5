"""`python -m deepep_portable verify`: one command for a first run on a cluster (or on one machine, with logical
nodes). A driver, not a collective job: it decides which transports are usable here, then launches, per transport,
the MPI GPU suites (tests/mpi, the transport given through the suites' DEEPEP_TEST_*_TRANSPORT variables as
scripts/gpu_tests.sh gives it) and the benchmark (`python -m deepep_portable bench`, with NCCL's
all_to_all_single beside it and DeepEP when `import deep_ep` is DeepEP itself), each step under a timeout, and
writes one report (verify_report.py) with the versions, the topology, every step's command, outcome, duration and
log, the benchmark table and a verdict.

Which transports: every backend of the registry whose probe says usable here (`transport="auto"`'s candidates;
one that is asked for by name only joins when `--transports` names it); `--stand-ins` runs the suites of the
backends that have a stand-in in the tests (the registry rows' test switches: a NIC model, a mock of a library)
against it instead, without their benchmark. What a backend gets follows its row and its class: a kernel backend
the conformance kernel, the low-latency suite, and the intranode suite (one node) or the internode suite (logical
or real nodes); a backend without kernels its own suite (tests/mpi/test_reference_mpi.py).

How ranks are launched: `--launcher mpirun|srun|torchrun` with `--launcher-args` passed through (hostfile, mapping,
--mpi=pmix, --nnodes ...), or `local` (this machine: the bench spawns its ranks, the MPI suites run under this
machine's mpirun). `--ranks-per-node K` makes nodes of K consecutive ranks (logical nodes on one machine, or the
real ones). When every rank is on this machine and they outnumber its GPUs, CUDA MPS is started around each step
as scripts/gpu_tests.sh starts it (`--mps auto|on|off`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import verify_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the source checkout
MPI_TESTS = "tests/mpi"
COMPARE_MODULE = "deep_ep"
# Variables that travel to every rank (Open MPI's -x, MPICH's -genvlist) when they are set: the interpreter's
# paths, the library's settings, the network libraries' settings, and what the steps themselves set.
FORWARD_PREFIXES = ("DEEPEP_PORTABLE_", "DEEPEP_TEST_", "NCCL_", "NVSHMEM_", "CUDA_MPS_", "GLOO_", "MASTER_")
FORWARD_NAMES = ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_HOME", "LD_LIBRARY_PATH",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST")
# Set for every step unless already set: NVLink multicast stays off (as scripts/gpu_env.sh sets it).
STEP_DEFAULTS = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
HOST_ARGS = {"mpirun": ("--hostfile", "-hostfile", "--host", "-host", "-H", "--machinefile", "-machinefile", "-f",
                        "--default-hostfile"),
             "torchrun": ("--nnodes",), "srun": ()}
STAND_IN_SWITCH = re.compile(r"^(DEEPEP_TEST_\w+_(?:MODEL|MOCK))=(\S+)$")


@dataclass(frozen=True)
class Suite:
    """One MPI test file as a role: the variable that names its transport, and its quick selection (-k)."""
    path: str
    variable: Optional[str]
    quick: Optional[str]


# The roles of the suites (tests/mpi): what a transport is given through, and the part `--suite quick` keeps.
SELFTEST = Suite("tests/mpi/test_transport_selftest_gpu_mpi.py", None, None)
LOW_LATENCY = Suite("tests/mpi/test_low_latency_gpu_mpi.py", "DEEPEP_TEST_LL_TRANSPORT",
                    "(test_ll_dispatch_combine and fp8-7168) or small")
INTRANODE = Suite("tests/mpi/test_intranode_gpu_mpi.py", "DEEPEP_TEST_NORMAL_TRANSPORT",
                  "test_dispatch_combine and h7168 and top8 and not column-major")
INTERNODE = Suite("tests/mpi/test_internode_gpu_mpi.py", "DEEPEP_TEST_INTERNODE_TRANSPORT",
                  "peer_tables or (test_dispatch_combine and (None or int32)) or dense")
WITHOUT_KERNELS = Suite("tests/mpi/test_reference_mpi.py", None, "small or logical_nodes")
COMMON = (Suite("tests/mpi/test_two_buffers_mpi.py", "DEEPEP_TEST_TRANSPORT", None),
          Suite("tests/mpi/test_elastic_mpi.py", "DEEPEP_TEST_TRANSPORT", None))
AGREEMENT = Suite("tests/mpi/test_buffer_agreement_mpi.py", None, None)


@dataclass
class Facts:
    """What the plan depends on, found by `gather_facts` (tests make their own)."""
    names: List[str]                     # the registry's backends, in its order
    usable: Dict[str, Tuple[bool, str]]  # probe answers here: (usable, reason)
    kernel: List[str]                    # backends with kernels (a KernelTransport)
    spans_nodes: List[str]               # backends that serve ranks on several nodes
    by_name_only: List[str]              # backends "auto" never picks (asked for by name only)
    stand_ins: Dict[str, Dict[str, str]]  # backend -> the test switches that run its suites on a stand-in
    gpus: int                            # GPUs visible here
    on_gpu: bool                         # the ranks run on GPUs (CUDA available)
    mpi: Optional[str] = "openmpi"       # flavour of this machine's mpirun (None: none here)
    mpi_ready: str = ""                  # why the MPI suites cannot run at all ("": they can)
    deep_ep: Optional[str] = None        # where DeepEP itself imports from (None: not importable)
    mps: bool = False                    # nvidia-cuda-mps-control is here
    root: bool = False                   # running as root (Open MPI then wants --allow-run-as-root)
    python: str = sys.executable


@dataclass
class Step:
    name: str
    kind: str                    # "preflight", "suites" or "bench"
    transport: Optional[str]
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)   # what this step sets on top of the environment
    ranks: int = 0
    mode: str = ""               # bench: normal, internode or low_latency
    note: str = ""               # e.g. "on the tests' stand-in"
    skip: str = ""               # not run, and why


@dataclass
class Plan:
    steps: List[Step]
    transports: List[Tuple[str, str]]    # (name, how: "real" or "stand-in")
    not_run: List[Tuple[str, str]]       # (name, why)
    single_machine: bool
    mps: bool
    ranks: int
    ranks_per_node: Optional[int]
    launcher: str
    suite: str


# ---- facts ----------------------------------------------------------------------------------------------------
def stand_ins_from_registry(rows) -> Dict[str, Dict[str, str]]:
    """backend -> the switches (DEEPEP_TEST_*_MODEL / _MOCK) its registry row's sanitizer suites set to run on the
    tests' stand-in of its hardware or library (tests/mpi/conftest.py installs it for the whole job)."""
    out: Dict[str, Dict[str, str]] = {}
    for b in rows:
        for suite in b.sanitize_steps:
            for token in suite.split("|")[-1].split():
                m = STAND_IN_SWITCH.match(token)
                if m:
                    out.setdefault(b.name, {})[m.group(1)] = m.group(2)
    return out


def _mpi_flavour() -> Optional[str]:
    exe = shutil.which("mpirun")
    if exe is None:
        return None
    try:
        text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "openmpi"
    return "mpich" if re.search(r"HYDRA|MPICH|Intel", text) else "openmpi"


def _deep_ep_location(python: str) -> Optional[str]:
    """Where `import deep_ep` comes from in a fresh interpreter, when it is DeepEP itself (not our alias)."""
    code = ("import os, deep_ep; print(os.path.abspath(getattr(deep_ep, '__file__', '') or ''));"
            "print(int(hasattr(deep_ep, '__deepep_portable_alias__')))")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    if done.returncode or len(lines) < 2 or lines[1] == "1":
        return None
    ours = os.path.join(ROOT, "deepep_portable")
    return None if lines[0].startswith(ours) else lines[0]


def gather_facts(python: str = sys.executable) -> Facts:
    from ..transports import available_transports, backend_class, registry, system
    from ..transports.kernel import KernelTransport

    def is_kernel(name: str) -> bool:
        try:
            return issubclass(backend_class(name), KernelTransport)
        except Exception:   # a backend that does not import here runs nothing
            return False

    import torch

    rows = registry.BACKENDS
    usable = {n: (bool(s.usable), s.reason) for n, s in available_transports().items()}
    flavour = _mpi_flavour()
    why = ""
    if not os.path.isdir(os.path.join(ROOT, MPI_TESTS)):
        why = f"no {MPI_TESTS} under {ROOT} (the suites come with a source checkout)"
    else:
        for module, what in (("mpi4py", "mpi4py"), ("pytest_mpi", "pytest-mpi")):
            try:
                __import__(module)
            except ImportError:
                why = f"{what} is not importable (pip install {what})"
    return Facts(names=[b.name for b in rows], usable=usable, kernel=[b.name for b in rows if is_kernel(b.name)],
                 spans_nodes=[b.name for b in rows if b.spans_nodes],
                 by_name_only=[b.name for b in rows if not b.in_auto], stand_ins=stand_ins_from_registry(rows),
                 gpus=len(system.gpu_info()), on_gpu=torch.cuda.is_available(), mpi=flavour, mpi_ready=why,
                 deep_ep=_deep_ep_location(python), mps=shutil.which("nvidia-cuda-mps-control") is not None,
                 root=hasattr(os, "geteuid") and os.geteuid() == 0, python=python)


# ---- the plan -------------------------------------------------------------------------------------------------
def single_machine(launcher: str, launcher_args: Sequence[str]) -> bool:
    """Every rank runs on this machine: the local launcher, or mpirun / torchrun given no hosts."""
    if launcher == "local":
        return True
    if launcher == "srun":
        return False
    names = HOST_ARGS[launcher]
    return not any(a in names or any(a.startswith(n + "=") for n in names if n.startswith("--")) for a in launcher_args)


def choose_transports(args, facts: Facts) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    """((name, "real" | "stand-in") in run order, (name, why not) for the others)."""
    asked = list(args.transports or [])
    for name in asked:
        if name not in facts.names:
            raise ValueError(f"unknown transport {name!r}; choose among {facts.names}")
    chosen, not_run = [], []
    for name in facts.names:
        if asked and name not in asked:
            continue
        if args.stand_ins and name in facts.stand_ins:
            chosen.append((name, "stand-in"))
        elif not facts.usable.get(name, (False, "not probed"))[0]:
            not_run.append((name, f"unusable here: {facts.usable.get(name, (False, 'not probed'))[1]}"
                            + ("; --stand-ins runs its suites on the tests' stand-in" if name in facts.stand_ins
                               else "")))
        elif name in facts.by_name_only and name not in asked:
            not_run.append((name, f"usable, but asked for by name only (the registry): --transports {name}"))
        else:
            chosen.append((name, "real"))
    order = {n: i for i, n in enumerate(facts.names)}
    rank = lambda item: (item[0] not in facts.kernel, item[1] == "stand-in", order[item[0]])   # noqa: E731
    return sorted(chosen, key=rank), not_run


def launch_prefix(args, facts: Facts, ranks: int, env_names: Sequence[str], for_tests: bool) -> Optional[List[str]]:
    """The launcher's words before the program for `ranks` ranks (None: this launcher cannot start it). `local`
    starts the MPI suites under this machine's mpirun and nothing else (the bench spawns its own ranks)."""
    user = list(args.launcher_args)
    launcher = args.launcher
    if launcher == "local":
        if not for_tests:
            return []
        if facts.mpi is None:
            return None
        launcher, user = "mpirun", (["--allow-run-as-root"] if facts.root and facts.mpi == "openmpi" else []) + (
            ["--oversubscribe", "--bind-to", "none"] if facts.mpi == "openmpi" else [])
    names = sorted(set(env_names))
    if launcher == "mpirun":
        if facts.mpi == "mpich":
            return ["mpirun", "-n", str(ranks), *user] + (["-genvlist", ",".join(names)] if names else [])
        return ["mpirun", "-n", str(ranks), *user] + [w for n in names for w in ("-x", n)]
    if launcher == "srun":   # srun passes the whole environment by default
        return ["srun", "-n", str(ranks), "--kill-on-bad-exit=1", *user]
    if for_tests:             # torchrun: no MPI communicator for the suites
        return None
    per_host = [] if any(a.startswith(("--nproc-per-node", "--nproc_per_node")) for a in user) \
        else ["--nproc-per-node", str(ranks)]
    return ["torchrun", *per_host, *user]


def _program(prefix: List[str], args, facts: Facts, words: List[str]) -> List[str]:
    """prefix + the interpreter running `words` (torchrun takes a module after -m itself)."""
    if prefix and prefix[0] == "torchrun":
        return prefix + words
    return prefix + [facts.python] + words


def _forwarded(env: Dict[str, str], base: Dict[str, str]) -> List[str]:
    """The variables set for a step (step_env) that its remote ranks need."""
    names = [n for n in list(base) + list(env) if n in FORWARD_NAMES or n.startswith(FORWARD_PREFIXES)]
    return sorted(set(names) | set(STEP_DEFAULTS) | {"PYTHONPATH"})


def _pytest_words(log_prefix: str, files: List[str], expr: Optional[str]) -> List[str]:
    """pytest under a shell that names each rank's junit file (and sends ranks other than 0 to their own log)."""
    rank = "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}"
    shell = (f'r={rank}; x="$0.rank$r.xml"; if [ "$r" = 0 ]; then exec "$@" --junitxml="$x"; '
             'else exec "$@" --junitxml="$x" >"$0.rank$r.log" 2>&1; fi')
    words = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--color=no", "--with-mpi", *files]
    return ["bash", "-c", shell, log_prefix, "__PYTHON__", *words] + (["-k", expr] if expr else [])


def suites_of(name: str, how: str, args, facts: Facts) -> List[Tuple[str, List[Suite], Dict[str, str]]]:
    """The suite steps of transport `name`: (step name, files, the variables that give it to them). A kernel
    backend's low-latency and normal-mode suites run in processes of their own, as scripts/gpu_tests.sh runs them
    (a backend whose memory is one heap per process, sized when it starts, has each suite's Buffers to itself)."""
    if name not in facts.kernel:
        suites = [WITHOUT_KERNELS] + ([*COMMON, AGREEMENT] if args.suite == "full" else [])
        return [(f"suites_{name}", suites, {"DEEPEP_TEST_TRANSPORT": name})]
    normal = INTERNODE if name in facts.spans_nodes else INTRANODE
    parts = [("low_latency", [SELFTEST, LOW_LATENCY]), ("internode" if normal is INTERNODE else "intranode", [normal])]
    if args.suite == "full" and how == "real":
        parts.append(("common", list(COMMON)))
    out = []
    for part, suites in parts:
        env = {s.variable: name for s in suites if s.variable}
        if normal in suites and normal is INTERNODE and args.ranks_per_node:
            env["DEEPEP_TEST_RANKS_PER_NODE"] = str(args.ranks_per_node)
        if how == "stand-in":
            env.update(facts.stand_ins[name])
        out.append((f"suites_{name}_{part}", suites, env))
    return out


def selection(name: str, suites: List[Suite], quick: bool) -> Optional[str]:
    """One -k expression for every file of the step: each file's part, qualified by its module's name."""
    parts, whole = [], []
    for s in suites:
        module = os.path.basename(s.path)[:-3]
        if s is SELFTEST:
            parts.append(f"({module} and {name})")
        elif quick and s.quick:
            parts.append(f"({module} and ({s.quick}))")
        else:
            whole.append(module)
    if not parts:
        return None
    return " or ".join(parts + [f"({m})" for m in whole])


def bench_steps(name: str, how: str, args, facts: Facts, one_machine: bool, base_env: Dict[str, str]) -> List[Step]:
    """The benchmark of transport `name`: its normal-mode op (internode over the nodes when it spans them) and,
    for a kernel backend, the low-latency ops; NCCL's all_to_all_single beside each (--baseline), DeepEP too
    where bench runs it (--compare; normal and low-latency mode)."""
    k = args.ranks_per_node
    spans = name in facts.spans_nodes
    kernel = name in facts.kernel
    quick = args.suite == "quick"
    if facts.on_gpu:
        normal_size = (["--tokens", "4096", "--warmup", "2", "--iters", "10"] if quick else []) if kernel else \
            ["--tokens", "512" if quick else "4096", "--warmup", "1", "--iters", "3"]
        ll_size = ["--tokens", "128"] + (["--warmup", "2", "--iters", "10"] if quick else [])
    else:
        normal_size = ["--tokens", "64", "--hidden", "1024", "--warmup", "1", "--iters", "3"] if quick else []
        ll_size = ["--tokens", "32", "--hidden", "1024", "--warmup", "1", "--iters", "3"] if quick else []
    # A backend of one node runs over every rank when they share this machine, else over one node's ranks.
    own_node = args.ranks if spans or one_machine or not k else k
    modes = [("internode", args.ranks) if spans and k else ("normal", own_node)]
    if kernel:
        modes.append(("low_latency", args.ranks if spans else own_node))
    steps = []
    for mode, ranks in modes:
        words = ["-m", "deepep_portable", "bench", "--no-progress", "--transport", name, "--mode", mode,
                 *(["--ranks-per-node", str(k)] if mode == "internode" else []),
                 *(ll_size if mode == "low_latency" else normal_size), "--baseline"]
        if facts.deep_ep and args.compare and mode != "internode":
            words += ["--compare", args.compare]
        words += shlex.split(args.bench_args or "")
        step = Step(f"bench_{name}_{mode}", "bench", name, [], ranks=ranks, mode=mode)
        if how == "stand-in":
            step.skip = "the suites ran on the tests' stand-in; the benchmark needs the real thing"
        prefix = launch_prefix(args, facts, ranks, _forwarded({}, base_env), for_tests=False)
        if args.launcher == "local":
            words[words.index("bench") + 1:words.index("bench") + 1] = ["--ranks", str(ranks)]
        step.argv = _program(prefix or [], args, facts, words)
        steps.append(step)
    return steps


def build_plan(args, facts: Facts, base_env: Optional[Dict[str, str]] = None) -> Plan:
    """Every step, in order, with its command and environment; steps that cannot run here carry the reason."""
    base_env = dict(os.environ if base_env is None else base_env)
    k = args.ranks_per_node
    if args.ranks is None:
        args.ranks = max(2, facts.gpus)
    if args.ranks < 1:
        raise ValueError("--ranks must be at least 1")
    if k is not None and (k < 1 or k >= args.ranks or args.ranks % k):
        raise ValueError(f"--ranks-per-node {k} must divide --ranks {args.ranks} into two nodes or more")
    one_machine = single_machine(args.launcher, args.launcher_args)
    mps = args.mps == "on" or (args.mps == "auto" and facts.mps and facts.on_gpu and one_machine
                               and 0 < facts.gpus < args.ranks and "CUDA_MPS_PIPE_DIRECTORY" not in base_env)
    chosen, not_run = choose_transports(args, facts)
    logs = args.logs
    steps: List[Step] = []
    if args.preflight:
        words = ["-m", "deepep_portable", "doctor", "--cluster", "--timeout", "30",
                 *(["--ranks-per-node", str(k)] if k else [])]
        prefix = launch_prefix(args, facts, args.ranks, _forwarded({}, base_env), for_tests=args.launcher == "local")
        step = Step("preflight", "preflight", None, [], ranks=args.ranks)
        if prefix is None:
            step.skip = "doctor --cluster needs a launcher: no mpirun on this machine"
        step.argv = _program(prefix or [], args, facts, words)
        steps.append(step)

    for name, how in chosen:
        for step_name, suites, env in suites_of(name, how, args, facts) if args.tests else []:
            step = Step(step_name, "suites", name, [], env=env, ranks=args.ranks,
                        note="on the tests' stand-in" if how == "stand-in" else "")
            prefix = launch_prefix(args, facts, args.ranks, _forwarded(env, base_env), for_tests=True)
            if args.launcher == "torchrun":
                step.skip = "the MPI suites need an MPI communicator: run verify with --launcher mpirun or srun"
            elif prefix is None:
                step.skip = "the MPI suites need mpirun: there is none on this machine"
            elif facts.mpi_ready:
                step.skip = f"the MPI suites cannot run here: {facts.mpi_ready}"
            words = _pytest_words(os.path.join(logs, step.name), [s.path for s in suites],
                                  selection(name, suites, args.suite == "quick"))
            step.argv = [facts.python if w == "__PYTHON__" else w for w in (prefix or []) + words]
            steps.append(step)
        if args.bench:
            steps += bench_steps(name, how, args, facts, one_machine, base_env)
    return Plan(steps, chosen, not_run, one_machine, mps, args.ranks, k, args.launcher, args.suite)


# ---- running it ---------------------------------------------------------------------------------------------------
class Mps:
    """CUDA MPS around one step, as scripts/gpu_tests.sh runs it: a fresh daemon with its own pipe and log
    directories, quit after the step."""

    def __init__(self, env: Dict[str, str]):
        self.env = env

    def start(self) -> Dict[str, str]:
        dirs = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="mps_pipe_"),
                "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="mps_log_")}
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**self.env, **dirs}, timeout=60, check=False)
        self.dirs = dirs
        return dirs

    def stop(self) -> None:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**self.env, **self.dirs},
                       timeout=60, check=False)


def run_step(step: Step, env: Dict[str, str], log: str, timeout_s: float) -> Tuple[Optional[int], float, bool]:
    """(exit code, seconds, timed out): the step's process group is ended when it runs past timeout_s."""
    t0 = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(step.argv) + "\n")
        out.flush()
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout_s)), time.monotonic() - t0, False
        except subprocess.TimeoutExpired:
            _end(proc)
            out.write(f"\n[verify] killed after {timeout_s:.0f} s (--step-timeout / --time-limit)\n")
            return None, time.monotonic() - t0, True
        except BaseException:   # verify itself interrupted (Ctrl-C, SIGTERM): the step's processes go with it
            _end(proc)
            out.write("\n[verify] interrupted\n")
            raise


def _end(proc: subprocess.Popen) -> None:
    """End a step's whole process group (the launcher and every rank it started here): TERM, then KILL."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def step_env(step: Step, base: Dict[str, str]) -> Dict[str, str]:
    env = dict(base)
    for k, v in STEP_DEFAULTS.items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(step.env)
    return env


def execute(plan: Plan, args, base_env: Dict[str, str]) -> List[verify_report.Outcome]:
    os.makedirs(args.logs, exist_ok=True)
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    outcomes = []
    for i, step in enumerate(plan.steps, 1):
        log = os.path.join(args.logs, f"{step.name}.log")
        left = None if deadline is None else deadline - time.monotonic()
        if not step.skip and left is not None and left < 5:
            step.skip = f"{verify_report.LIMIT_SKIP} {args.time_limit:.0f} s reached before this step"
        if step.skip:
            outcome = verify_report.Outcome(step.name, "skipped", why=step.skip)
        else:
            print(f"[verify {i}/{len(plan.steps)}] {step.name}: {shlex.join(step.argv)[:160]}", flush=True)
            env = step_env(step, base_env)
            mps = Mps(env) if plan.mps else None
            if mps is not None:
                env.update(mps.start())
            try:
                limited = left is not None and left < args.step_timeout   # the run's limit comes first
                timeout = min(args.step_timeout, left) if limited else args.step_timeout
                rc, seconds, timed_out = run_step(step, env, log, timeout)
            except KeyboardInterrupt:
                outcomes.append(verify_report.Outcome(step.name, "failed", log=log, why="interrupted"))
                outcomes += [verify_report.Outcome(s.name, "skipped", why="verify was interrupted")
                             for s in plan.steps[i:]]
                print(f"[verify] interrupted at {step.name}", flush=True)
                return outcomes
            finally:
                if mps is not None:
                    mps.stop()
            outcome = verify_report.judge(step, rc, seconds, timed_out, log, cut=timed_out and limited)
        print(f"[verify {i}/{len(plan.steps)}] {step.name}: {verify_report.one_line(outcome)}", flush=True)
        outcomes.append(outcome)
    return outcomes


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", nargs="+", default=None, metavar="NAME",
                   help="the transports to verify (default: every one usable here; one asked for by name only joins "
                        "when named)")
    p.add_argument("--launcher", choices=["mpirun", "srun", "torchrun", "local"], default="local",
                   help="how ranks start: under mpirun / srun / torchrun (with --launcher-args), or local: this "
                        "machine (the bench spawns its ranks, the MPI suites run under this machine's mpirun)")
    p.add_argument("--launcher-args", default="", metavar="ARGS",
                   help='the launcher\'s own arguments, one string: "--hostfile hosts --map-by ppr:8:node", '
                        '"--nodes 2 --ntasks-per-node 8 --mpi=pmix", "--nnodes 2 --node-rank 0 --rdzv-endpoint h:29500"')
    p.add_argument("--ranks", type=int, default=None, help="ranks of every step (default: the GPUs here, at least 2)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="K consecutive ranks make a node (logical nodes on one machine, or the real ones): the "
                        "internode suites and bench --mode internode over them")
    p.add_argument("--suite", choices=["quick", "full"], default="full",
                   help="quick: a few cases of each suite and one size of each bench; full: the whole suites and "
                        "the bench's default sizes")
    p.add_argument("--stand-ins", action="store_true",
                   help="run the suites of the backends the tests have a stand-in for (a NIC model, a library mock) "
                        "against it instead of the real hardware or library (no bench for those)")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the MPI suites")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the benchmarks")
    p.add_argument("--no-preflight", dest="preflight", action="store_false", help="skip doctor --cluster")
    p.add_argument("--compare", default=COMPARE_MODULE, metavar="MODULE",
                   help="time this DeepEP-API library beside ours when it imports and is not our alias "
                        "(default deep_ep; '' for none)")
    p.add_argument("--bench-args", default="", metavar="ARGS", help='more bench arguments, one string ("--num-sms 16")')
    p.add_argument("--mps", choices=["auto", "on", "off"], default="auto",
                   help="CUDA MPS around each step (auto: when every rank is on this machine and they outnumber "
                        "its GPUs)")
    p.add_argument("--step-timeout", type=float, default=600.0, help="each step is killed after this many seconds")
    p.add_argument("--time-limit", type=float, default=None,
                   help="the whole run's bound (s): steps not started by then are skipped, a running one is cut")
    p.add_argument("--report", default="verify_report.md", help="the report (markdown)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--logs", default=None, help="the steps' logs (default: next to the report, REPORT_logs/)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and stop")


def main(args) -> int:
    args.launcher_args = shlex.split(args.launcher_args) if isinstance(args.launcher_args, str) else args.launcher_args
    args.report = os.path.abspath(args.report)
    args.logs = os.path.abspath(args.logs or os.path.splitext(args.report)[0] + "_logs")
    started = datetime.datetime.now().astimezone()
    t0 = time.monotonic()
    facts = gather_facts()
    base_env = dict(os.environ)
    try:
        plan = build_plan(args, facts, base_env)
    except ValueError as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(verify_report.plan_text(plan))
        return 0
    os.makedirs(args.logs, exist_ok=True)
    context = verify_report.context(facts, args.logs)
    signal.signal(signal.SIGTERM, _interrupted)   # a launcher's or scheduler's stop ends the step, then reports
    outcomes = execute(plan, args, base_env)
    result = verify_report.Result(command=shlex.join([os.path.basename(sys.executable), "-m", "deepep_portable",
                                                      "verify", *sys.argv[2:]]) if sys.argv[1:2] == ["verify"]
                                  else "python -m deepep_portable verify",
                                  started=started.isoformat(timespec="seconds"), seconds=time.monotonic() - t0,
                                  plan=plan, outcomes=outcomes, context=context, logs=args.logs)
    text = verify_report.markdown(result)
    with open(args.report, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(verify_report.as_json(result), f, indent=1, default=str)
    verdict = verify_report.verdict(result)
    print(f"\n{verdict.line}\nreport: {args.report}" + (f"\njson: {args.json}" if args.json else ""))
    return 0 if verdict.passed else 2 if verdict.incomplete else 1   # 2: nothing failed, the time limit cut the run


