"""Host cost of the steps an op takes before its first kernel, with N processes sharing the GPU.

    python dev/host_costs.py [--procs 8] [--iters 300]

The intranode dispatch spends 140-180 us of host time before its stage kernel on the H200 with 8
ranks under MPS (docs/PERFORMANCE.md), and the GPU idles through it when the op starts on an idle
stream. This times the candidate steps one by one, each the median over --iters of a tight loop,
in --procs processes at once (as the ranks run; start MPS first to match gpu_tests.sh), and rank 0
prints a table (microseconds). Steps: allocations on the current stream and under
`torch.cuda.stream(side)`, the context manager alone, record_stream, stream/event ordering, the
ctypes params copy, an empty kernel launch through the library's launch path, and get_dispatch_layout's
eager path in two parts (the Buffer's checks, the op body).
"""
import argparse
import ctypes
import os
import statistics
import time

import torch
import torch.multiprocessing as mp


def _median_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _steps(side: torch.cuda.Stream):
    from deepep_portable import jit
    from deepep_portable.engines import intranode
    from deepep_portable.engines.launch import launch
    from deepep_portable.tools import kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    keep = []
    copy = jit.load(kernels.COPY_SOURCE, kernels.COPY_INT4, {}, dev.index)
    params = kernels.CopyParams(0, 0, 0)   # zero words: the kernel does nothing
    template = intranode.DispatchParams()
    handle = int(side.cuda_stream)

    def alloc_current():
        keep.append(torch.empty(65537, dtype=torch.int32, device=dev))
        keep.clear()

    def alloc_side():
        with torch.cuda.stream(side):
            keep.append(torch.empty(65537, dtype=torch.int32, device=dev))
        keep.clear()

    def stream_context():
        with torch.cuda.stream(side):
            pass

    def alloc_record_stream():
        t = torch.empty(65537, dtype=torch.int32, device=dev)
        t.record_stream(side)

    def wait_stream():
        side.wait_stream(torch.cuda.current_stream())

    def wait_stream_by_handle():   # what Buffer._op does instead (an event record and a wait by stream handle)
        from deepep_portable.engines.launch import current_stream_handle, stream_wait_stream

        stream_wait_stream(dev.index, handle, current_stream_handle(dev.index))

    def event_record():
        torch.cuda.Event().record(side)

    def params_copy():
        p = intranode.DispatchParams.from_buffer_copy(template)
        p.x = 1

    def launch_empty():
        launch(copy, 1, 256, params, handle)

    # get_dispatch_layout's eager path in its parts (4096 tokens, top-8 of 256 experts, 8 ranks): the Buffer's
    # argument checks (the range check hits its cache: same tensor, as in the bench), then the op body
    from deepep_portable import _validate as check
    from deepep_portable.engines.dispatch_layout import dispatch_layout_current_stream
    topk_idx = torch.randint(0, 256, (4096, 8), device=dev)

    def layout_checks():
        check.layout_args(topk_idx, torch.int64, 256, 8, dev)

    def layout_body():
        keep.append(dispatch_layout_current_stream(topk_idx, 256, 8, dev.index))
        keep.clear()

    return [("torch.empty (current stream)", alloc_current), ("torch.empty under stream(side)", alloc_side),
            ("stream(side) context alone", stream_context), ("empty + record_stream(side)", alloc_record_stream),
            ("side.wait_stream(current)", wait_stream), ("_C.stream_wait_stream (by handle)", wait_stream_by_handle),
            ("Event().record(side)", event_record),
            ("params from_buffer_copy", params_copy), ("empty kernel launch", launch_empty),
            ("current_stream().cuda_stream", lambda: torch.cuda.current_stream(dev.index).cuda_stream),
            ("layout: Buffer's argument checks", layout_checks), ("layout: op body (alloc, launch)", layout_body),
            ("ctypes sizeof (baseline)", lambda: ctypes.sizeof(template))]


def _worker(rank: int, procs: int, iters: int, barrier) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    side = torch.cuda.Stream()
    steps = _steps(side)
    barrier.wait()   # every process times at once, as the ranks of an op do
    rows = [(name, _median_us(fn, iters)) for name, fn in steps]
    if rank == 0:
        print(f"host cost per step, rank 0 of {procs} processes, median of {iters} (us):")
        for name, us in rows:
            print(f"  {name:34s} {us:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("host_costs: no CUDA device; nothing to time")
        return
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs)
    ps = [ctx.Process(target=_worker, args=(r, args.procs, args.iters, barrier)) for r in range(args.procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()


if __name__ == "__main__":
    main()
