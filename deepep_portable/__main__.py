"""Command line: `python -m deepep_portable {bench,soak,model,doctor,precompile,verify}`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepep_portable")
    sub = parser.add_subparsers(dest="command", required=True)
    from .tools import bench, model, soak, verify
    from .transports import registry

    bench.add_arguments(sub.add_parser("bench", help="dispatch/combine round trip across local ranks: check, time, ceiling"))
    soak.add_arguments(sub.add_parser("soak", help="many rounds on one Buffer: results, memory, descriptors, time"))
    model.add_arguments(sub.add_parser("model", help="normal-mode op times predicted on real NVLink"))
    doc = sub.add_parser("doctor", help="GPUs, links, CUDA/NCCL/NVSHMEM, RDMA devices, and each transport's status; "
                                        "--cluster: every node of a job, launched like the job")
    doc.add_argument("--cluster", action="store_true",
                     help="collective (run it under mpirun / srun / torchrun like the job): versions, NIC ports, "
                          "GPU-NIC affinity, GPUDirect and driver settings on every rank, and a round trip between "
                          "every pair of nodes over each usable network transport; rank 0 prints one report")
    doc.add_argument("--ranks-per-node", type=int, default=None,
                     help="with --cluster: K consecutive ranks of one machine make a node (default: the machines)")
    doc.add_argument("--timeout", type=float, default=30.0, help="with --cluster: bound on each round trip's waits (s)")
    doc.add_argument("--tokens", type=int, default=64, help="with --cluster: tokens each way per round trip")
    doc.add_argument("--hidden", type=int, default=2048, help="with --cluster: hidden size of the round trips' tokens "
                                                              "(a multiple of 128)")
    doc.add_argument("--root", default="/", help=argparse.SUPPRESS)   # where sysfs and procfs are read (tests)
    verify.add_arguments(sub.add_parser("verify", help="a first run on a cluster (or logical nodes on one machine): the "
                                                       "GPU suites and the bench over every usable transport, beside "
                                                       "NCCL all_to_all_single and DeepEP, in one report"))
    pre = sub.add_parser("precompile", help="compile every kernel family into the JIT cache")
    pre.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    for name in registry.filled("precompile"):   # one flag per backend whose kernels the families leave out
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        pre.add_argument(*flags, dest="linked", action="append_const", const=name,
                         help=f"also build the {name} transport's low-latency and internode kernels, which the "
                              f"kernel families leave out (its registry row's precompile hook)")
    args = parser.parse_args(argv)

    if args.command == "bench":
        return bench.main(args)
    if args.command == "soak":
        return soak.main(args)
    if args.command == "model":
        return model.main(args)
    if args.command == "verify":
        return verify.main(args)
    if args.command == "doctor" and args.cluster:
        from .tools import doctor_cluster

        return doctor_cluster.main(args)
    if args.command == "doctor":
        from .tools.doctor import run_doctor

        return run_doctor()
    from .tools import precompile

    return precompile.main(args.arch, args.linked or ())


if __name__ == "__main__":
    sys.exit(main())
