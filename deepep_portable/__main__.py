"""Command line: `python -m deepep_portable {bench,doctor,precompile}`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepep_portable")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import bench

    bench.add_arguments(sub.add_parser("bench", help="dispatch/combine round trip across local ranks: check, time, ceiling"))
    sub.add_parser("doctor", help="GPUs, links, CUDA/NCCL/NVSHMEM, RDMA devices, and each transport's status")
    pre = sub.add_parser("precompile", help="compile every kernel family into the JIT cache")
    pre.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    pre.add_argument("--nvshmem", action="store_true",
                     help="also device-link the low-latency kernels for the nvshmem transport (needs NVSHMEM)")
    args = parser.parse_args(argv)

    if args.command == "bench":
        return bench.main(args)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    from . import jit
    from . import low_latency  # noqa: F401  (registers the low-latency kernel families)

    for name, arch, seconds, hit in jit.precompile(tuple(args.arch)):
        print(f"{name:40s} {arch:6s} {'cached' if hit else f'{seconds:.1f} s'}")
    if args.nvshmem:
        for name, arch, seconds, hit in low_latency.precompile_nvshmem(tuple(a for a in args.arch if a != "sm_80")):
            print(f"{name:40s} {arch:6s} {'cached' if hit else f'{seconds:.1f} s'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
