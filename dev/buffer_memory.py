"""Where a Buffer's GPU memory goes: N ranks sharing the GPU (start MPS first, as gpu_tests.sh does) each take one
step at a time, and after each step rank 0 reads the memory used on the device from nvidia-smi (which makes no CUDA
context of its own), so a step's cost is the growth over every rank, printed per rank. Outside PyTorch's allocator =
that growth less the growth of torch's reserved memory.

    python dev/buffer_memory.py [--procs 16] [--transport nvshmem] [--ranks-per-node 8]
                                [--nvl-bytes 2e9] [--rdma-bytes 1e9] [--tokens 4096] [--hidden 7168]

  rows: the processes as started (their CUDA contexts: the process group sets the device), the Buffer (its windows and
  its transport's runtime), then one dispatch and combine of `tokens` BF16 tokens, top-8 of 256 experts, inputs
  included (the kernels' modules, the outputs).
The defaults are DeepEP V1's tests/test_internode.py at 2 x 8 logical nodes, whose 16 ranks outgrew an H100.
"""
import argparse
import subprocess

import torch
import torch.distributed as dist


def _used_bytes(gpu: int) -> int:
    """Memory in use on GPU `gpu` (nvidia-smi's index), all processes (no CUDA context is made to ask)."""
    out = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) << 20


def _probe(rank: int, world: int, group, cfg) -> None:
    import deepep_portable as deep_ep

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    torch.cuda.synchronize()
    dist.barrier(group=group)
    used = _used_bytes(cfg.gpu) if rank == 0 else 0
    rows.append(("processes as started", used - cfg.used_before, 0))

    def step(name, fn):
        nonlocal used
        reserved = torch.cuda.memory_reserved(dev)
        dist.barrier(group=group)
        out = fn()
        torch.cuda.synchronize()
        grown = [0] * world
        dist.all_gather_object(grown, torch.cuda.memory_reserved(dev) - reserved, group=group)
        if rank == 0:
            now = _used_bytes(cfg.gpu)
            rows.append((name, now - used, sum(grown)))
            used = now
        return out

    buf = step("Buffer", lambda: deep_ep.Buffer(group, int(cfg.nvl_bytes), int(cfg.rdma_bytes),
                                                transport=cfg.transport, ranks_per_node=cfg.ranks_per_node))
    experts, topk = 256, 8

    def op():
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(cfg.tokens)]).to(dev)
        weights = torch.rand(cfg.tokens, topk, generator=gen).to(dev)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx,
                                                       topk_weights=weights)
        return x, buf.combine(recv_x, handle, recv_w)
    kept = step(f"dispatch + combine of {cfg.tokens} tokens", op)
    if rank == 0:
        total = torch.cuda.get_device_properties(dev).total_memory
        print(f"{world} ranks sharing {torch.cuda.get_device_name(dev)}, transport {buf.transport}, "
              f"num_nvl_bytes {int(cfg.nvl_bytes)}, num_rdma_bytes {int(cfg.rdma_bytes)}, ranks per node "
              f"{cfg.ranks_per_node}; MiB per rank (the device's growth over all ranks / {world})")
        print(f"{'step':>34} {'device':>8} {'torch':>8} {'outside':>8}")
        for name, drop, grown in rows:
            print(f"{name:>34} {drop / world / 2**20:8.0f} {grown / world / 2**20:8.0f} "
                  f"{(drop - grown) / world / 2**20:8.0f}")
        print(f"device: {used / 2**30:.1f} GiB used of {total / 2**30:.1f}")
    del kept
    dist.barrier(group=group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=16)
    p.add_argument("--transport", default="nvshmem")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--nvl-bytes", type=float, default=2e9)
    p.add_argument("--rdma-bytes", type=float, default=1e9)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--gpu", type=int, default=0, help="the shared GPU's index as nvidia-smi numbers it")
    cfg = p.parse_args()
    cfg.used_before = _used_bytes(cfg.gpu)
    from deepep_portable.tools.spawn import run_local

    run_local(_probe, cfg.procs, cfg)


if __name__ == "__main__":
    main()
