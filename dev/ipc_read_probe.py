"""Are reads of a peer's memory slower than writes to it? N ranks sharing the GPU (start MPS first, as
gpu_tests.sh does) each move the same bytes per rank, every rank at once, with the same block count:

    python dev/ipc_read_probe.py [--procs 8] [--mib 160] [--blocks 8 16]

  local       one copy from a tensor to a tensor of this process
  push        my bytes written in 1/N slices into every rank's window (the bench's pattern ceiling)
  pull        the 1/N slices every rank wrote for me read back from each rank's window into a tensor
  pull_own    the same reads from my own window (same launches and sizes, no peer mapping)
  pull_vmm    `pull` over a window of VMM memory shared by file descriptor instead of legacy CUDA IPC

The intranode pulls (dispatch, combine) run at 2.0-2.75 TB/s of HBM traffic on the 8-rank emulation while
their stage kernels, which read and write local memory, reach 4.4 TB/s (per-rank profiles on the H200);
this separates the peer mapping from the kernels' access patterns. Rank 0 prints a table.
"""
import argparse
import statistics
import types

import torch
import torch.distributed as dist


def _probe(rank: int, world: int, group, cfg) -> None:
    from deepep_portable import Buffer
    from deepep_portable.engines.launch import launch
    from deepep_portable import jit
    from deepep_portable.tools import kernels
    from deepep_portable.tools.timing import slowest, start_line, timer
    from deepep_portable.windows.ipc import IpcWindow

    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = cfg.mib << 20
    piece = nbytes // world // 16 * 16
    buf = Buffer(group, 1 << 22, 0, transport="nvlink")
    ctx = buf.backend.ctx
    windows = {"legacy": IpcWindow(ctx, piece * world, 0, "probe window"),
               "vmm": IpcWindow(ctx, piece * world, 0, "probe window", shareable=True)}
    src = torch.randint(0, 255, (piece * world,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = jit.load(kernels.COPY_SOURCE, kernels.COPY_INT4, {}, dev.index)
    order = [(rank + 1 + i) % world for i in range(world)]   # every destination takes one writer at a time
    timing_cfg = types.SimpleNamespace(start_line="gpu")
    results = {}
    with start_line(buf, timing_cfg):
        for blocks in cfg.blocks:
            def local():
                kernels.copy_with_blocks(dst, src, blocks, torch.cuda.current_stream())

            push = kernels.SegmentCopy(src, [windows["legacy"].bases[d] + rank * piece for d in order],
                                       [piece] * world)

            def pull_from(bases):
                def run():
                    s = torch.cuda.current_stream().cuda_stream
                    for i, d in enumerate(order):
                        launch(copy, blocks, 256, kernels.CopyParams(bases[d] + rank * piece,
                                                                     dst.data_ptr() + i * piece, piece // 16), s)
                return run

            own = [windows["legacy"].bases[rank]] * world
            cases = [("local", local), ("push", lambda: push(blocks, torch.cuda.current_stream())),
                     ("pull", pull_from(windows["legacy"].bases)), ("pull_own", pull_from(own)),
                     ("pull_vmm", pull_from(windows["vmm"].bases))]
            for name, fn in cases:
                times = []
                for _ in range(cfg.repeats):
                    dist.barrier(group=group)
                    times.append(slowest(timer(dev, fn, 3, cfg.iters, group), group))
                results[(blocks, name)] = statistics.median(times)
    torch.cuda.synchronize()
    for w in windows.values():
        w.close()
    if rank == 0:
        print(f"{world} ranks, {piece * world / 2**20:.0f} MiB per rank, slowest rank's median (us) and HBM traffic "
              f"(read + write, all ranks, TB/s)")
        print(f"{'blocks':>6} {'case':>9} {'time_us':>9} {'TB/s':>6}")
        for (blocks, name), t in results.items():
            print(f"{blocks:>6} {name:>9} {t * 1e6:9.1f} {2 * world * piece * world / t / 1e12:6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--mib", type=int, default=160)
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    cfg = p.parse_args()
    from deepep_portable.tools.spawn import run_local

    run_local(_probe, cfg.procs, cfg)


if __name__ == "__main__":
    main()
