"""V2's handle kernel (engines/handle_kernel.py) vs. the torch it replaces (elastic_handle.handle_fields_torch, on
the CPU), bit for bit, on random V1 dispatch results: padding rows, empty sources, no rows, no tokens, scale-up
groups, alignments, rows that chose no local expert, and more rows than one sweep of the grid. The outputs are allocated inside the call, so the allocator's free blocks of their sizes are
poisoned first: an element the kernel leaves unwritten shows as 0xABABABAB."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepep_portable import _C  # noqa: E402
from deepep_portable.elastic_handle import HandleFields, handle_fields_torch  # noqa: E402
from deepep_portable.engines.handle_kernel import handle_fields  # noqa: E402

_ok, _reason = _C.driver_status()
if not _ok:
    pytest.skip(f"CUDA driver unusable from _C: {_reason}", allow_module_level=True)


def dispatch_result(gen: torch.Generator, num_ranks: int, rank: int, num_topk: int, num_local: int, num_max: int,
                    num_tokens: int, padding: int, empty_sources: bool):
    """What a V1 dispatch leaves on `rank`: the prefix matrix, each received row's source token and local top-k
    (at least one choice per real row, -1 elsewhere and on the padding rows), and my tokens' send rows and
    global top-k."""
    sent = torch.randint(0, num_max + 1, (num_ranks, num_ranks), generator=gen, dtype=torch.int32)
    if empty_sources:
        sent[torch.rand(num_ranks, num_ranks, generator=gen) < 0.3] = 0
    prefix = sent.cumsum(0).to(torch.int32)
    real = int(prefix[-1, rank])
    rows = real + padding
    src_idx = torch.full((rows,), -1, dtype=torch.int32)
    start = 0
    for s in range(num_ranks):
        c = int(sent[s, rank])
        src_idx[start:start + c] = torch.randperm(num_max, generator=gen)[:c].sort().values.to(torch.int32)
        start += c
    recv_topk = torch.full((rows, num_topk), -1, dtype=torch.int64)
    for i in range(real):
        k = int(torch.randint(1, min(num_topk, num_local) + 1, (1,), generator=gen))
        where = torch.randperm(num_topk, generator=gen)[:k]
        recv_topk[i, where] = torch.randperm(num_local, generator=gen)[:k]
    send_rows = torch.randint(-1, 4 * num_max, (num_tokens, num_ranks), generator=gen, dtype=torch.int32)
    experts = num_local * num_ranks
    topk = torch.stack([torch.randperm(experts, generator=gen)[:num_topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty((0, num_topk), dtype=torch.int64)
    if num_tokens:
        topk[torch.rand(num_tokens, num_topk, generator=gen) < 0.2] = -1
    return prefix, src_idx, recv_topk, send_rows, topk.to(torch.int64)


def poison_free_blocks(*shapes) -> None:
    held = [torch.empty(s, dtype=torch.int32, device="cuda") for s in shapes for _ in range(4)]
    for t in held:
        t.view(torch.uint8).fill_(0xAB)
    del held


CASES = [
    # ranks, rank, top-k, local experts, max tokens, my tokens, padding rows, scale-up, alignment, empty sources
    (8, 3, 8, 32, 512, 512, 0, 8, 1, False),
    (8, 0, 8, 32, 512, 300, 700, 8, 128, True),
    (16, 9, 8, 16, 256, 256, 0, 8, 4, True),
    (16, 15, 4, 2, 128, 100, 50, 4, 64, False),
    (2, 1, 1, 1, 64, 64, 0, 1, 1, False),
    (1, 0, 6, 40, 100, 90, 10, 1, 8, False),
    (4, 2, 8, 8, 64, 0, 0, 2, 1, True),
    (32, 31, 9, 8, 64, 64, 64, 8, 16, True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"R{c[0]}-K{c[2]}-L{c[3]}-pad{c[6]}-S{c[7]}-a{c[8]}" for c in CASES])
def test_handle_kernel_matches_torch(case):
    num_ranks, rank, num_topk, num_local, num_max, num_tokens, padding, scaleup, alignment, empty = case
    gen = torch.Generator().manual_seed(hash(case) % (1 << 31))
    inputs = dispatch_result(gen, num_ranks, rank, num_topk, num_local, num_max, num_tokens, padding, empty)
    kwargs = dict(rank=rank, num_scaleup_ranks=scaleup, num_local_experts=num_local, num_max_tokens_per_rank=num_max,
                  expert_alignment=alignment)
    want = handle_fields_torch(*inputs, **kwargs, do_expand=False)
    rows = inputs[2].size(0)
    poison_free_blocks((rows, num_topk + 2), (num_tokens, num_topk), (2 * num_local + scaleup + 1,))
    got = HandleFields(*handle_fields(*(t.cuda() for t in inputs), **kwargs))
    torch.cuda.synchronize()
    for name, w, g in zip(want._fields, want, got):
        assert g.dtype == torch.int32 and g.is_cuda, name
        assert torch.equal(g.cpu(), w.to(torch.int32)), f"{name} differs from the torch path"


def test_handle_kernel_all_rows_empty_of_choices():
    """Rows that chose nothing here (and a zero-row receive) still get their prefix sums and -1 slots."""
    prefix = torch.zeros((4, 4), dtype=torch.int32)
    inputs = (prefix, torch.empty(0, dtype=torch.int32), torch.empty((0, 8), dtype=torch.int64),
              torch.full((5, 4), -1, dtype=torch.int32), torch.full((5, 8), -1, dtype=torch.int64))
    kwargs = dict(rank=1, num_scaleup_ranks=4, num_local_experts=3, num_max_tokens_per_rank=16, expert_alignment=32)
    want = handle_fields_torch(*inputs, **kwargs, do_expand=False)
    got = HandleFields(*handle_fields(*(t.cuda() for t in inputs), **kwargs))
    for name, w, g in zip(want._fields, want, got):
        assert torch.equal(g.cpu(), w.to(torch.int32)), name


def large_dispatch_result(gen: torch.Generator, num_ranks: int, rank: int, num_topk: int, num_local: int,
                          num_max: int, padding: int):
    """dispatch_result's tensors built without a loop per row: as many rows as 16 ranks x 8192 tokens leave a
    rank without a CPU sync, and a fifth of the real rows with no local choice at all."""
    sent = torch.randint(num_max // 2, num_max + 1, (num_ranks, num_ranks), generator=gen, dtype=torch.int32)
    prefix = sent.cumsum(0).to(torch.int32)
    real = int(prefix[-1, rank])
    ends = prefix[:, rank].to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    row_ids = torch.arange(real)
    src_rank = torch.searchsorted(ends, row_ids, right=True)
    src_idx = torch.cat([(row_ids - starts[src_rank]).to(torch.int32), torch.full((padding,), -1, dtype=torch.int32)])
    recv_topk = torch.randint(0, num_local, (real, num_topk), generator=gen)
    recv_topk[torch.rand(real, num_topk, generator=gen) < 0.6] = -1
    recv_topk[torch.rand(real, generator=gen) < 0.2] = -1
    recv_topk = torch.cat([recv_topk, torch.full((padding, num_topk), -1, dtype=torch.int64)])
    send_rows = torch.randint(-1, num_ranks * num_max, (num_max, num_ranks), generator=gen, dtype=torch.int32)
    topk = torch.randint(-1, num_local * num_ranks, (num_max, num_topk), generator=gen)
    return prefix, src_idx, recv_topk, send_rows, topk


def test_handle_kernel_past_one_grid_sweep():
    """More rows than MAX_BLOCKS x THREADS (every thread takes several rows), rows with no local choice."""
    from deepep_portable.engines.handle_kernel import MAX_BLOCKS, THREADS

    gen = torch.Generator().manual_seed(7)
    inputs = large_dispatch_result(gen, 16, 5, 8, 16, 8192, 1000)
    assert inputs[2].size(0) > MAX_BLOCKS * THREADS
    kwargs = dict(rank=5, num_scaleup_ranks=8, num_local_experts=16, num_max_tokens_per_rank=8192, expert_alignment=128)
    want = handle_fields_torch(*inputs, **kwargs, do_expand=False)
    got = HandleFields(*handle_fields(*(t.cuda() for t in inputs), **kwargs))
    for name, w, g in zip(want._fields, want, got):
        assert torch.equal(g.cpu(), w.to(torch.int32)), f"{name} differs from the torch path"
