"""The list of backends: one row each. Everything that needs to know which backends exist reads this
table (`available_transports`, `resolve`, `Buffer(transport=...)`, the probes, `doctor`, the GPU and sanitizer
scripts), so a new backend is its folders (csrc/backends/<name>/, transports/<name>/) and one row here.

A row points into the backend's folder for what only the backend knows, as "module:function" relative to this
package (imported when first asked, so a backend's libraries are never loaded by reading the table):
  probe       whether it can run in this process, and exactly why not (transports/probe.py calls and caches it;
              it never raises: every "no" is a reason);
  options     validates `Buffer(transport_options=...)` for it, before any set-up: returns what its transport
              reads from BufferContext.options[name], or raises ValueError naming the bad key;
  error_text  the text of its own kernel error codes (errors.cuh's backend codes: `describe(name, op, rank, peer,
              channel, detail)` -> str, or None for codes it does not own);
  doctor      its own section of `python -m deepep_portable doctor`: () -> lines (what only it looks at: its
              libraries on disk, its choices on this machine's NICs); never raises for a missing piece;
  network_settings  (environ) -> the network settings it would use ({gid_index, traffic_class, service_level,
              hca_list, ...}, or {"error": ...}); `doctor --cluster` compares them between ranks and with each port;
  cluster_findings  its own findings in `doctor --cluster`'s report: (part, facts, context) -> [(level, subject,
              text, todo)], plain tuples (level "FAIL", "WARN", "NOTE" or "OK"; every FAIL and WARN with a todo),
              asked at each part of one rank's findings (CLUSTER_PARTS below) with that rank's collected facts
              (its network settings under facts["settings"][name]) and what the report derived there; a backend
              cannot import the tools' Finding, which sit a floor above it;
  precompile  (archs) -> [(label, arch, seconds, cache_hit)]: its kernels that `jit.precompile` leaves out (device-
              linked against a library, or run only on a cluster), which `python -m deepep_portable precompile
              --<name>` builds;
and lists its GPU test steps (scripts/gpu_tests.sh step names) and its compute-sanitizer suites
(scripts/sanitize.sh entries). `python -m deepep_portable.transports.registry --steps gpu|sanitize` prints them.
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Backend:
    name: str
    module: Optional[str]     # its Transport class's module, relative to this package (None: not built yet)
    cls: Optional[str]        # the Transport class in that module
    probe: str                # its probe ("module:function"; never raises: reasons, not exceptions)
    spans_nodes: bool         # can serve ranks on several nodes ("auto" skips it otherwise)
    in_auto: bool = True      # "auto" may pick it (False: asked for by name only, e.g. not run at several ranks yet)
    rdma: bool = False        # reaches other machines by RDMA through a NIC (doctor --cluster tests it between nodes)
    verified_hardware: str = ""        # where it has run for real, in words (Buffer.transport_info, doctor)
    ran_on_hardware: bool = False      # it has run on real hardware at all ("auto" warns when it picks one that has not)
    ran_across_machines: bool = False  # its path between machines has run over a real network (same warning)
    oracle: bool = False      # the specification the kernels are tested against: plain torch.distributed, no
                              # kernels, runs in any process (exactly one row; `oracle()` names it)
    options: Optional[str] = None      # its transport_options schema ("module:function"; None: it takes none)
    legacy_option: Optional[str] = None   # the deprecated Buffer keyword that is an alias of transport_options
    error_text: Optional[str] = None   # decoder of its own kernel error codes ("module:function")
    doctor: Optional[str] = None       # its own section of `doctor` ("module:function" -> lines)
    network_settings: Optional[str] = None   # its network settings, for doctor --cluster ("module:function")
    cluster_findings: Optional[str] = None   # its findings in doctor --cluster's report ("module:function")
    precompile: Optional[str] = None   # builds its kernels that jit.precompile cannot ("module:function")
    gpu_steps: Tuple[str, ...] = ()    # its steps in scripts/gpu_tests.sh
    sanitize_steps: Tuple[str, ...] = ()   # its suites in scripts/sanitize.sh: "name|ranks|file|-k expr|environment"


# In the order transport="auto" prefers them (nvlink first when every rank is on one node: see resolve).
BACKENDS: Tuple[Backend, ...] = (
    Backend("nvshmem", ".nvshmem.transport", "NvshmemTransport", ".nvshmem.probe:probe_nvshmem",
            spans_nodes=True, rdma=True,
            verified_hardware="one GPU shared by ranks (H200); never between machines", ran_on_hardware=True,
            options=".nvshmem.runtime:validate_options", legacy_option="nvshmem_options",
            doctor=".nvshmem.doctor:doctor", network_settings=".nvshmem.doctor:network_settings",
            cluster_findings=".nvshmem.cluster:findings", precompile=".nvshmem.transport:precompile_linked",
            gpu_steps=("llnvshmem", "internode", "benchinternode")),
    Backend("nccl_gin", ".nccl_gin.transport", "NcclGinTransport", ".nccl_gin.probe:probe_nccl_gin",
            spans_nodes=True, rdma=True,
            in_auto=False,   # run on a GPU at one rank only
            verified_hardware="one rank on a GPU (H200); GIN paths never on a NIC (mock only)", ran_on_hardware=True,
            options=".nccl_gin.options:validate_options", legacy_option="nccl_options",
            error_text=".nccl_gin.errors:describe", doctor=".nccl_gin.doctor:doctor",
            network_settings=".nccl_gin.doctor:network_settings",
            gpu_steps=("llncclgin", "llncclgin2", "llginmock", "internodeginmock"),
            sanitize_steps=(
                "ll_ncclgin|1|tests/mpi/test_low_latency_gpu_mpi.py|small or logfmt or shrink|DEEPEP_TEST_LL_TRANSPORT=nccl_gin",
                "ll_ginmock|2|tests/mpi/test_low_latency_gpu_mpi.py|small or logfmt or shrink|DEEPEP_TEST_NCCL_GIN_MOCK=1 "
                "DEEPEP_TEST_LL_TRANSPORT=nccl_gin")),
    Backend("ibgda", ".ibgda.transport", "IbgdaTransport", ".ibgda.probe:probe_ibgda",
            spans_nodes=True, rdma=True,
            verified_hardware="never on a real NIC (NIC model only)",
            options=".ibgda.roce:validate_options", legacy_option="ibgda_options", error_text=".ibgda.errors:describe",
            doctor=".ibgda.doctor:doctor", network_settings=".ibgda.doctor:network_settings",
            cluster_findings=".ibgda.cluster:findings", precompile=".ibgda.transport:precompile_kernels",
            gpu_steps=("llibgda", "internodeibgda"),
            sanitize_steps=(
                "ll_ibgda|2|tests/mpi/test_low_latency_gpu_mpi.py|small or logfmt or shrink|DEEPEP_TEST_IBGDA_MODEL=1 "
                "DEEPEP_TEST_LL_TRANSPORT=ibgda",
                "internode_ibgda|2|tests/mpi/test_internode_gpu_mpi.py|odd_shapes and (dense or no-topk)|DEEPEP_TEST_IBGDA_MODEL=1 "
                "DEEPEP_TEST_INTERNODE_TRANSPORT=ibgda")),
    Backend("nvlink", ".nvlink.transport", "NvlinkTransport", ".nvlink.probe:probe_nvlink", spans_nodes=False,
            verified_hardware="one GPU shared by ranks (H200)", ran_on_hardware=True),
    Backend("reference", ".reference", "ReferenceTransport", ".reference:probe_reference", spans_nodes=True,
            verified_hardware="CPU (gloo; torch.distributed carries it between machines)", ran_on_hardware=True,
            ran_across_machines=True, oracle=True),
)

BY_NAME: Dict[str, Backend] = {b.name: b for b in BACKENDS}
TRANSPORT_NAMES = [b.name for b in BACKENDS]


def row(name: str) -> Backend:
    """The row of backend `name`; ValueError naming the known ones otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"unknown transport {name!r}; choose one of {['auto'] + TRANSPORT_NAMES}")
    return BY_NAME[name]


def oracle() -> str:
    """The name of the oracle's row: the backend that runs in any process with a torch group (no GPU, no library),
    e.g. for a Buffer that only hosts a timing start line beside another library."""
    return next(b.name for b in BACKENDS if b.oracle)


def entry(ref: str) -> Callable:
    """The function a row points at ("module:function", the module relative to this package)."""
    module, _, function = ref.partition(":")
    return getattr(importlib.import_module(module, __package__), function)


def validate_options(name: str, options: Optional[Mapping[str, Any]], keyword: str = "transport_options") -> Any:
    """What backend `name` reads from BufferContext.options[name] for these options (its schema checks them), or
    ValueError: a bad key or value, or options for a backend that takes none. Runs before any set-up."""
    backend = row(name)
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"{keyword} must be a dict, got {type(options).__name__}")
    if backend.options is None:
        if options:
            raise ValueError(f"{keyword}: transport {name!r} takes no options, got {sorted(options)}")
        return None
    return entry(backend.options)(dict(options or {}))


def legacy_options() -> Dict[str, str]:
    """Deprecated Buffer keyword -> the backend whose transport_options it stands for."""
    return {b.legacy_option: b.name for b in BACKENDS if b.legacy_option}


def error_text(name: str) -> Optional[Callable]:
    """Backend `name`'s decoder of its own kernel error codes (errors.from_record's `describe`), or None."""
    ref = row(name).error_text
    return entry(ref) if ref else None


# The parts of one rank's findings in doctor --cluster where each row's cluster_findings is asked, in the report's
# order, with the context each gets beside the rank's facts:
#   "rank"      before the NIC checks; context {}
#   "port"      each ACTIVE port, after its RoCE v2 GID check and before the libraries' GID variables; context
#               {"where": "mlx5_0:1", "port": the port record, "routable_v2": its routable RoCE v2 GIDs}
#   "driver"    after the NVIDIA driver's parameters, when they could be read; context {"has_nic",
#               "stream_mem_ops", "peer_mapping_override": bools, "missing": the module options to add, "todo":
#               how to add them}
#   "affinity"  after the GPU-NIC distance, when the rank has a GPU, its sysfs directory and an RDMA NIC; context
#               {"gpu_dir", "nics", "infiniband": the sysfs class directory, "ranked": [{name, distance, numa, code,
#               active}] closest first, "best": the closest with an active port or None}
CLUSTER_PARTS = ("rank", "port", "driver", "affinity")


def hooks(field: str) -> list:
    """[(backend name, function)] of every row that fills `field` (a "module:function" field such as
    cluster_findings or precompile), in table order."""
    return [(b.name, entry(getattr(b, field))) for b in BACKENDS if getattr(b, field)]


def filled(field: str) -> list:
    """The names of the rows that fill `field`, in table order, importing nothing (e.g. the command line's
    `precompile --<name>` flags)."""
    return [b.name for b in BACKENDS if getattr(b, field)]


def steps(kind: str) -> list:
    """Every backend's GPU test steps (kind "gpu") or compute-sanitizer suites (kind "sanitize"), in table order."""
    field = {"gpu": "gpu_steps", "sanitize": "sanitize_steps"}[kind]
    return [step for b in BACKENDS for step in getattr(b, field)]


# Bumped by whatever changes a probe's answer inside a running process (a test installing the ibgda backend's
# NIC provider): probe.probe() caches per value, so the next call asks again.
_changes = 0


def changed() -> None:
    global _changes
    _changes += 1


def changes() -> int:
    return _changes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepep_portable.transports.registry",
                                     description="What the scripts read from the backend table, one item a line.")
    parser.add_argument("--steps", choices=("gpu", "sanitize"), help="every backend's GPU steps / sanitizer suites")
    parser.add_argument("--names", action="store_true", help="the backends' names")
    args = parser.parse_args(argv)
    lines = TRANSPORT_NAMES if args.names else steps(args.steps) if args.steps else None
    if lines is None:
        parser.error("give --steps or --names")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
