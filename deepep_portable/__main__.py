"""Command line: `python -m deepep_portable {bench,soak,model,doctor,precompile}`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepep_portable")
    sub = parser.add_subparsers(dest="command", required=True)
    from .tools import bench, model, soak

    bench.add_arguments(sub.add_parser("bench", help="dispatch/combine round trip across local ranks: check, time, ceiling"))
    soak.add_arguments(sub.add_parser("soak", help="many rounds on one Buffer: results, memory, descriptors, time"))
    model.add_arguments(sub.add_parser("model", help="normal-mode op times predicted on real NVLink"))
    sub.add_parser("doctor", help="GPUs, links, CUDA/NCCL/NVSHMEM, RDMA devices, and each transport's status")
    pre = sub.add_parser("precompile", help="compile every kernel family into the JIT cache")
    pre.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    pre.add_argument("--nvshmem", action="store_true",
                     help="also device-link the low-latency kernels for the nvshmem transport (needs NVSHMEM)")
    args = parser.parse_args(argv)

    if args.command == "bench":
        return bench.main(args)
    if args.command == "soak":
        return soak.main(args)
    if args.command == "model":
        return model.main(args)
    if args.command == "doctor":
        from .tools.doctor import run_doctor

        return run_doctor()
    from .tools import precompile

    return precompile.main(args.arch, args.nvshmem)


if __name__ == "__main__":
    sys.exit(main())
