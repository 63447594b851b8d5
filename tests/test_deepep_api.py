"""DeepEP V1's public `Buffer` surface, as callers of `deep_ep` (V1, commit 567632d) use it.

Single process (a one-rank gloo group, reference transport): signatures, positional order, return
shapes, and the calls added for drop-in parity (get_local_buffer_tensor, FP8 scales of any strides).
"""
import inspect

import pytest
import torch

import deepep_portable as deep_ep

HIDDEN, TOKENS, EXPERTS, TOPK = 256, 8, 8, 2

# DeepEP V1's Buffer.__init__ parameters, in order (deep_ep/buffer.py at 567632d).
DEEPEP_INIT = ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
               "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
               "enable_shrink", "comm"]


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def test_constructor_positional_order_is_deepeps():
    params = list(inspect.signature(deep_ep.Buffer.__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == DEEPEP_INIT
    # ours come after, keyword-only
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} == {"transport", "timeout_s", "nvshmem_options", "transport_options",
                                                                 "ranks_per_node", "ibgda_options", "nccl_options"}


def test_constructor_positional_call(one_rank_group):
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, 1, TOKENS)
    # DeepEP's order: ..., allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink
    buf = deep_ep.Buffer(one_rank_group, nvl, 0, False, 1, True, False, False, True, False, transport="reference")
    assert buf.explicitly_destroy and not buf.enable_shrink and not buf.use_fabric
    buf.destroy()


def test_use_fabric_refused_before_setup(one_rank_group):
    with pytest.raises(ValueError, match="use_fabric"):
        deep_ep.Buffer(one_rank_group, 1 << 20, 0, use_fabric=True, transport="reference")


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_default_configs_match_deepep(num_ranks):
    # DeepEP V1's tables for one NVLink domain (Buffer.num_sms left at its default, 20)
    dispatch = {2: (24, 256), 4: (6, 256), 8: (6, 256)}[num_ranks]
    combine = {2: (10, 256), 4: (9, 256), 8: (4, 256)}[num_ranks]
    d, c = deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)
    assert (d.num_sms, d.num_max_nvl_chunked_send_tokens, d.num_max_nvl_chunked_recv_tokens) == (20, *dispatch)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (20, *combine)


@pytest.mark.parametrize("use_rdma_buffer", [False, True])
def test_get_local_buffer_tensor(one_rank_group, use_rdma_buffer):
    nvl, rdma = 1 << 16, 1 << 15
    buf = deep_ep.Buffer(one_rank_group, nvl, rdma, low_latency_mode=use_rdma_buffer, transport="reference",
                         explicitly_destroy=True)
    nbytes = rdma if use_rdma_buffer else nvl
    whole = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=use_rdma_buffer)
    assert whole.dtype == torch.uint8 and whole.dim() == 1 and whole.numel() == nbytes
    as_int = buf.get_local_buffer_tensor(torch.int32, offset=64, use_rdma_buffer=use_rdma_buffer)
    assert as_int.numel() == (nbytes - 64) // 4
    shaped = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size([16, 8]), offset=128,
                                         use_rdma_buffer=use_rdma_buffer)
    assert shaped.shape == (16, 8) and shaped.dtype == torch.bfloat16
    # views of the same memory: a write through one shows through the other
    shaped.fill_(1.0)
    assert torch.equal(whole[128:128 + 2 * 128].view(torch.bfloat16), torch.ones(128, dtype=torch.bfloat16,
                                                                                 device=whole.device))
    with pytest.raises(ValueError, match="multiple of 4"):
        buf.get_local_buffer_tensor(torch.int32, offset=2, use_rdma_buffer=use_rdma_buffer)
    with pytest.raises(ValueError, match="elements"):
        buf.get_local_buffer_tensor(torch.int32, torch.Size([nbytes]), use_rdma_buffer=use_rdma_buffer)
    buf.destroy()


@pytest.mark.parametrize("hidden", [HIDDEN, 128])   # 128: one scale column, whose [N, 1] strides are odd
def test_fp8_dispatch_accepts_column_major_scales(one_rank_group, device, hidden):
    """`(x_fp8, scales.T.contiguous().T)` (DeepGEMM's layout, DeepEP's test input) is accepted and moved
    exactly; received scales are row-major [rows, S] as DeepEP returns them."""
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(hidden + hidden // 128 * 4 + 64, 1, TOKENS)
    buf = deep_ep.Buffer(one_rank_group, nvl, 0, transport="reference")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, hidden, generator=gen).to(torch.float8_e4m3fn).to(device)
    scales = torch.rand(hidden // 128, TOKENS, generator=gen).to(device).T   # column-major, like .T.contiguous().T
    assert scales.stride() == (1, TOKENS)   # (with one column torch calls it contiguous: odd strides all the same)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(TOKENS)]).to(device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    (recv_x, recv_s), _, _, _, handle, _ = buf.dispatch((x, scales), num_tokens_per_rank=per_rank,
                                                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert torch.equal(recv_x.view(torch.uint8), x.view(torch.uint8))
    assert recv_s.is_contiguous() and torch.equal(recv_s, scales)
    (again_x, again_s), *_ = buf.dispatch((x, scales), handle=handle)
    assert torch.equal(again_s, scales) and again_s.is_contiguous()


def _demangled(symbol: str) -> str:
    """ns::...::name of a kernel symbol made by jit.kernel_symbol (_ZN<len><part>...E<params>)."""
    assert symbol.startswith("_ZN"), symbol
    parts, i = [], 3
    while symbol[i] != "E":
        n = 0
        while symbol[i].isdigit():
            n, i = 10 * n + int(symbol[i]), i + 1
        parts.append(symbol[i:i + n])
        i += n
    return "::".join(parts)


def test_kernel_names_in_a_profile():
    """DeepEP's tests (and users) find an op's kernel in a torch profiler table by 'dispatch' / 'combine':
    every kernel of ours is under deepep_portable::, and only the kernels that move an op's data carry
    those words (one per op in low-latency mode; staging, layout, copies and clean do not)."""
    from deepep_portable.tools.precompile import load_families

    names = {_demangled(k): fam.name for fam in load_families().values() for k in fam.kernels}
    assert names and all(n.startswith("deepep_portable::") for n in names), sorted(names)
    with_op_words = sorted(n for n in names if "dispatch" in n or "combine" in n)
    assert with_op_words == ["deepep_portable::intranode::combine", "deepep_portable::intranode::dispatch",
                             "deepep_portable::low_latency::combine", "deepep_portable::low_latency::dispatch"]


def test_logfmt_shapes_checked():
    from deepep_portable.logfmt import chunk_channels

    assert chunk_channels(7168) == 1024 and chunk_channels(7680) == 512
    for bad in (7296, 8704):   # not a multiple of 512; more divisions than the decoder's warp reads
        with pytest.raises(ValueError, match="use_logfmt"):
            chunk_channels(bad)


def test_low_latency_token_bound(one_rank_group, device):
    """A signal's count field is 24 bits (low_latency/protocol.cuh): more tokens per rank are refused up front."""
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 256, 1, 8)
    buf = deep_ep.Buffer(one_rank_group, 0, rdma, low_latency_mode=True, transport="reference")
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="must be < 16777216"):
        buf.low_latency_dispatch(x, idx, 1 << 24, 8)


def test_an_op_that_raises_leaves_the_callers_stream_after_the_comm_stream(monkeypatch):
    """Buffer._op orders the comm stream after the caller's before the op's body; when the body raises (an output
    that cannot be allocated after the kernels were enqueued), the caller's stream waits for the comm stream before
    the error leaves, so memory those kernels read or write is not handed to the caller's next work meanwhile."""
    import types

    from deepep_portable import buffer as buffer_mod

    log = []
    monkeypatch.setattr(buffer_mod, "current_stream_handle", lambda dev: 555)
    monkeypatch.setattr(buffer_mod, "stream_wait_stream", lambda dev, waiter, waited: log.append((waiter, waited)))
    fake = types.SimpleNamespace(_comm_stream=object(), _comm_handle=777, _device_index=0)
    with pytest.raises(MemoryError, match="forced"):
        with deep_ep.Buffer._op(fake, None, False, False, []):
            assert log == [(777, 555)]   # the comm stream after the caller's
            raise MemoryError("forced")
    assert log == [(777, 555), (555, 777)]   # and the caller's after the comm stream, on the way out
