"""Peer-to-peer copy bandwidth between every pair of local GPUs: the NVLink ceiling.

    python scripts/p2p_bandwidth.py [--mib 1024] [--iters 20]

For each ordered pair (src, dst) a device-to-device copy of --mib MiB, timed with CUDA events on
the destination's stream (median of --iters), printed as a matrix of GB/s (bytes copied / time),
plus the local copy on the diagonal (bytes read + written would be twice that).
"""
import argparse
import statistics

import torch


def copy_gbps(src_dev: int, dst_dev: int, nbytes: int, iters: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    with torch.cuda.device(dst_dev):
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    n = torch.cuda.device_count()
    nbytes = args.mib << 20
    print(f"{n} GPUs ({torch.cuda.get_device_name(0)}); GB/s of a {args.mib} MiB copy src(row) -> dst(column)")
    for i in range(n):
        for j in range(n):
            if i != j and not torch.cuda.can_device_access_peer(j, i):
                print(f"note: GPU {j} cannot access GPU {i} directly (copies go through the host)")
    print("src\\dst " + " ".join(f"{j:>8d}" for j in range(n)))
    for i in range(n):
        print(f"{i:>7d} " + " ".join(f"{copy_gbps(i, j, nbytes, args.iters):8.1f}" for j in range(n)), flush=True)


if __name__ == "__main__":
    main()
