"""Bad input raises a clear error before anything is launched, and the Buffer keeps working.

Single process (a one-rank gloo group); tests/mpi/test_validation_mpi.py covers the multi-rank cases.
"""
import dataclasses

import pytest
import torch

import deepep_portable as deep_ep
from deepep_portable import _validate as check
from deepep_portable.transports import registry

HIDDEN, TOKENS, EXPERTS, TOPK = 256, 8, 8, 2


@pytest.fixture(scope="module")
def group(one_rank_group):
    return one_rank_group


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="module")
def buffer(group):
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, 1, TOKENS)
    return deep_ep.Buffer(group, nvl, 0, transport="reference")


@pytest.fixture(scope="module")
def ll_buffer(group):
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, 1, EXPERTS)
    return deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, transport="reference")


def make_inputs(device, tokens=TOKENS, hidden=HIDDEN):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)]).to(device)
    w = torch.rand(tokens, TOPK, generator=gen).to(device)
    return x, idx.to(deep_ep.topk_idx_t), w


def round_trip(buf, device):
    """A valid dispatch + combine: proves the Buffer is still usable after a rejected call."""
    x, idx, w = make_inputs(device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)
    assert torch.equal(recv_x, x)
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    assert torch.equal(out, x)


def layout_kwargs(buf, idx, experts=EXPERTS):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


BAD_DISPATCH = {
    "x float32": (lambda x, idx, w: dict(x=x.float()), TypeError, "dtype"),
    "x 1-D": (lambda x, idx, w: dict(x=x.flatten()), ValueError, "shape"),
    "x not contiguous": (lambda x, idx, w: dict(x=x.t().contiguous().t()), ValueError, "contiguous"),
    "x list": (lambda x, idx, w: dict(x=[x]), TypeError, "torch.Tensor"),
    "hidden not multiple of 8": (lambda x, idx, w: dict(x=x[:, :100].contiguous()), ValueError, "multiple of 8"),
    "topk_idx int32": (lambda x, idx, w: dict(topk_idx=idx.int()), TypeError, "dtype"),
    "expert index too large": (lambda x, idx, w: dict(topk_idx=idx.masked_fill(idx == idx[0, 0], EXPERTS)),
                               ValueError, "outside"),
    "expert index below -1": (lambda x, idx, w: dict(topk_idx=idx.masked_fill(idx == idx[0, 0], -2)),
                              ValueError, "outside"),
    "weights missing": (lambda x, idx, w: dict(topk_weights=None), ValueError, "topk_weights"),
    "weights shape": (lambda x, idx, w: dict(topk_weights=w[:, :1].contiguous()), ValueError, "shape"),
    "weights bf16": (lambda x, idx, w: dict(topk_weights=w.bfloat16()), TypeError, "dtype"),
    "is_token_in_rank int": (lambda x, idx, w: dict(is_token_in_rank=torch.ones(TOKENS, 1, dtype=torch.int32,
                                                                                 device=x.device)), TypeError, "dtype"),
    # one node: DeepEP ignores num_tokens_per_rdma_rank, so do we, but a tensor that is not [num_nodes] is wrong
    "rdma counts shape": (lambda x, idx, w: dict(num_tokens_per_rdma_rank=torch.zeros(2, dtype=torch.int32,
                                                                                       device=x.device)),
                          ValueError, "shape"),
    "alignment zero": (lambda x, idx, w: dict(expert_alignment=0), ValueError, "expert_alignment"),
    "worst tokens negative": (lambda x, idx, w: dict(num_worst_tokens=-1), ValueError, "num_worst_tokens"),
    "config wrong type": (lambda x, idx, w: dict(config=(20, 6, 256, 6, 128)), TypeError, "Config"),
    "fp8 hidden not multiple of 128": (
        lambda x, idx, w: dict(x=(torch.zeros(TOKENS, 200, device=x.device).to(torch.float8_e4m3fn),
                                  torch.ones(TOKENS, 2, device=x.device))), ValueError, "multiple of 128"),
    "fp8 scales rows": (
        lambda x, idx, w: dict(x=(x.to(torch.float8_e4m3fn), torch.ones(TOKENS + 1, 2, device=x.device))),
        ValueError, "scales"),
    "fp8 scales dtype": (
        lambda x, idx, w: dict(x=(x.to(torch.float8_e4m3fn), torch.ones(TOKENS, 2, device=x.device).half())),
        TypeError, "dtype"),
    "async on comm stream without event": (lambda x, idx, w: dict(allocate_on_comm_stream=True), ValueError,
                                           "previous_event"),
}


@pytest.mark.parametrize("case", sorted(BAD_DISPATCH))
def test_bad_dispatch_rejected_then_buffer_works(buffer, device, case):
    make_bad, exc, words = BAD_DISPATCH[case]
    x, idx, w = make_inputs(device)
    kwargs = dict(x=x, topk_idx=idx, topk_weights=w, **layout_kwargs(buffer, idx))
    kwargs.update(make_bad(x, idx, w))
    with pytest.raises(exc, match=words):
        buffer.dispatch(**kwargs)
    round_trip(buffer, device)


def test_too_many_tokens_for_buffer(buffer, device):
    x, idx, w = make_inputs(device, tokens=TOKENS * 64)
    with pytest.raises(ValueError, match="needs a larger buffer"):
        buffer.dispatch(x, topk_idx=idx, topk_weights=w, **layout_kwargs(buffer, idx))
    round_trip(buffer, device)


def test_buffer_without_nvl_bytes_rejects_dispatch(group, device):
    buf = deep_ep.Buffer(group, 0, 0, transport="reference")
    x, idx, w = make_inputs(device)
    with pytest.raises(ValueError, match="num_nvl_bytes=0"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout_kwargs(buf, idx))


def test_layout_rejects_bad_experts(buffer, device):
    _, idx, _ = make_inputs(device)
    with pytest.raises(ValueError, match="outside"):
        buffer.get_dispatch_layout(idx, EXPERTS - 1)
    with pytest.raises(TypeError, match="int"):
        buffer.get_dispatch_layout(idx, float(EXPERTS))
    with pytest.raises(ValueError, match="top-k"):
        buffer.get_dispatch_layout(idx[:, :0].contiguous(), EXPERTS)
    with pytest.raises(ValueError, match="2\\^31"):
        buffer.get_dispatch_layout(idx, 1 << 31)
    round_trip(buffer, device)


def test_handle_checks(buffer, group, device):
    x, idx, w = make_inputs(device)
    _, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, **layout_kwargs(buffer, idx))
    other = deep_ep.Buffer(group, buffer.num_nvl_bytes, 0, transport="reference")
    with pytest.raises(ValueError, match="another Buffer"):
        other.combine(x, handle)
    with pytest.raises(ValueError, match="another Buffer"):
        other.dispatch(x, handle=handle)
    with pytest.raises(TypeError, match="DispatchHandle"):
        buffer.combine(x, tuple(handle)[:6])
    with pytest.raises(ValueError, match="tokens"):
        buffer.dispatch(x[:-1].contiguous(), handle=handle)
    with pytest.raises(ValueError, match="no topk_idx"):
        buffer.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(ValueError, match="shape"):
        buffer.combine(x[:-1].contiguous(), handle)
    with pytest.raises(ValueError, match="shape"):
        buffer.combine(x, handle, bias=torch.zeros(TOKENS, HIDDEN + 8, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="bias"):
        buffer.combine(x, handle, bias=[x])
    round_trip(buffer, device)


def test_zero_copy_input_checks(buffer, device):
    """get_next_dispatch_buffer: its arguments are checked before anything runs; the reference transport gives
    a fresh tensor of the asked shape, which dispatches as any x."""
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        buffer.get_next_dispatch_buffer(2.0, HIDDEN)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        buffer.get_next_dispatch_buffer(-1, HIDDEN)
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16"):
        buffer.get_next_dispatch_buffer(TOKENS, HIDDEN, torch.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        buffer.get_next_dispatch_buffer(TOKENS, HIDDEN + 8, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 8"):
        buffer.get_next_dispatch_buffer(TOKENS, HIDDEN + 4)
    x, idx, w = make_inputs(device)
    rows = buffer.get_next_dispatch_buffer(TOKENS, HIDDEN)
    assert rows.shape == x.shape and rows.dtype == torch.bfloat16 and rows.is_contiguous()
    rows.copy_(x)
    recv_x, *_ = buffer.dispatch(rows, topk_idx=idx, topk_weights=w, **layout_kwargs(buffer, idx))
    assert torch.equal(recv_x, x)
    assert buffer.get_next_dispatch_buffer(0, 128, torch.float8_e4m3fn).shape == (0, 128)
    round_trip(buffer, device)


def test_low_latency_checks(ll_buffer, buffer, device):
    x, idx, w = make_inputs(device)
    with pytest.raises(ValueError, match="low_latency_mode=True"):
        buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS)
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
        ll_buffer.low_latency_dispatch(x, idx, TOKENS - 1, EXPERTS)
    with pytest.raises(ValueError, match="too small"):
        ll_buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS * 4)
    with pytest.raises(ValueError, match="multiple of 128"):
        ll_buffer.low_latency_dispatch(x[:, :200].contiguous(), idx, TOKENS, EXPERTS)
    with pytest.raises(ValueError, match="use_ue8m0"):
        ll_buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=True, round_scale=False, use_ue8m0=True)
    with pytest.raises(ValueError, match="outside"):
        ll_buffer.low_latency_dispatch(x, idx + EXPERTS, TOKENS, EXPERTS)
    with pytest.raises(ValueError, match="shape"):
        ll_buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS,
                                       cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32, device=device))
    recv_x, count, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=False)
    with pytest.raises(ValueError, match="shape"):
        ll_buffer.low_latency_combine(recv_x[:, :-1].contiguous(), idx, w, handle)
    with pytest.raises(ValueError, match="use_logfmt"):
        ll_buffer.low_latency_combine(recv_x, idx, w, handle, use_logfmt=True)
    with pytest.raises(ValueError, match="shape"):
        ll_buffer.low_latency_combine(recv_x, idx, w, handle, out=torch.empty(1, HIDDEN, dtype=torch.bfloat16,
                                                                                 device=device))
    with pytest.raises(TypeError, match="handle"):
        ll_buffer.low_latency_combine(recv_x, idx, w, handle[:3])
    out, _, _ = ll_buffer.low_latency_combine(recv_x, idx, w, handle)
    expected = (w.sum(1, keepdim=True) * x.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_config_and_hints():
    cfg = deep_ep.Buffer.get_dispatch_config(6)          # any rank count, no whitelist
    assert isinstance(cfg, deep_ep.Config)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8, 4096) >= 8 * 4096 * 7168 * 2
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    with pytest.raises(ValueError):
        deep_ep.Config(20, 300, 256, 6, 128)
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(7)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint >= 2 * 256 * 128 * 7168 * 2     # two halves of at least the combine receive area


def test_unavailable_transport_raises_reason(group):
    status = deep_ep.available_transports()
    for name in ("nvshmem", "ibgda", "nccl_gin"):
        if not status[name].usable:
            with pytest.raises(RuntimeError, match=name):
                deep_ep.Buffer(group, 1 << 20, 0, transport=name)
    with pytest.raises(ValueError, match="unknown transport"):
        deep_ep.Buffer(group, 1 << 20, 0, transport="carrier_pigeon")


def test_group_type_checked():
    with pytest.raises(TypeError, match="ProcessGroup"):
        deep_ep.Buffer(object(), 1 << 20, 0, transport="reference")
    with pytest.raises(ValueError, match="group"):
        deep_ep.Buffer(None, 1 << 20, 0, transport="reference")


def test_range_check_runs_again_for_new_or_modified_tensors(buffer, device):
    _, idx, _ = make_inputs(device)
    buffer.get_dispatch_layout(idx, EXPERTS)            # checked once, then remembered
    idx[0, 0] = EXPERTS                                 # in-place change bumps the version
    with pytest.raises(ValueError, match="outside"):
        buffer.get_dispatch_layout(idx, EXPERTS)
    fresh = idx.clone()                                 # a new object is checked too
    with pytest.raises(ValueError, match="outside"):
        buffer.get_dispatch_layout(fresh, EXPERTS)


def test_inference_mode_tensors_are_checked_every_time(buffer, device, monkeypatch):
    """They have no version counter to remember a check by: every call checks them (and the skip still works)."""
    _, idx, _ = make_inputs(device)
    with torch.inference_mode():
        good, bad = idx.clone(), idx.clone()
        bad[0, 0] = EXPERTS
        for _ in range(2):
            buffer.get_dispatch_layout(good, EXPERTS)
            with pytest.raises(ValueError, match="outside"):
                buffer.get_dispatch_layout(bad, EXPERTS)
        monkeypatch.setenv("DEEPEP_PORTABLE_SKIP_RANGE_CHECK", "1")
        check.expert_indices("topk_idx", bad, EXPERTS)   # skipped: no error, no version counter read


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_unknown_nvshmem_option_rejected(group):
    with pytest.raises(ValueError, match="unknown NVSHMEM option 'ib_gid'"):
        deep_ep.Buffer(group, 1 << 20, 0, transport="reference", nvshmem_options={"ib_gid": 3})
    buf = deep_ep.Buffer(group, 1 << 20, 0, transport="reference", nvshmem_options={"ib_gid_index": 3, "ibgda": True})
    assert buf._ctx.options["nvshmem"] == {"ib_gid_index": 3, "ibgda": True}


@pytest.mark.parametrize("kwargs,match", [
    (dict(ibgda_options={"traffic_clas": 106}), "unknown ibgda option"),
    (dict(ibgda_options={"service_level": 16}), "service_level"),
    (dict(nccl_options={"ib_gid": 3}), "unknown nccl option 'ib_gid'"),
    (dict(nccl_options={"ib_sl": 99}), r"nccl_options\['ib_sl'\] must be an integer in \[0, 15\]"),
    (dict(nccl_options={"gin": "yes"}), r"nccl_options\['gin'\] must be True, False or None"),
    (dict(nccl_options={"hca_list": ""}), "non-empty string")])
def test_bad_backend_options_rejected_before_set_up(group, kwargs, match):
    (keyword, options), = kwargs.items()
    with pytest.warns(DeprecationWarning, match=f"{keyword}=...\\) is deprecated"):
        with pytest.raises(ValueError, match=match):
            deep_ep.Buffer(group, 1 << 20, 0, transport="reference", **kwargs)
    # The same options through transport_options, for the backend the deprecated keyword stands for: the same error.
    name = registry.legacy_options()[keyword]
    with pytest.raises(ValueError, match=match):
        registry.validate_options(name, options, keyword)
    with pytest.raises(ValueError, match="unknown transport 'nope'"):   # before anything is set up
        deep_ep.Buffer(group, 1 << 20, 0, transport="nope", transport_options=options)


def test_backend_options_reach_the_backend(group):
    with pytest.warns(DeprecationWarning):
        buf = deep_ep.Buffer(group, 1 << 20, 0, transport="reference", ibgda_options={"traffic_class": 106},
                             nccl_options={"ib_sl": 3, "gin": False})
    assert buf._ctx.options["ibgda"].traffic_class == 106
    assert buf._ctx.options["nccl_gin"] == {"ib_sl": 3, "gin": False}
    from deepep_portable.transports.nccl_gin.options import nccl_environment

    assert nccl_environment({"ib_sl": 3, "hca_list": "mlx5_0:1", "gin": True}) == {
        "NCCL_NVLS_ENABLE": "0", "NCCL_IB_SL": "3", "NCCL_IB_HCA": "mlx5_0:1"}


def test_buffer_reports_its_capabilities(buffer):
    caps = buffer.capabilities
    assert caps == deep_ep.available_transports()["reference"].capabilities
    assert caps["peer_load_store"] is False and caps["max_channels"] == 1


def test_combine_eager_predicate_implies_the_full_checks(buffer, device):
    """Buffer.combine's eager path is taken only for arguments that pass every check of the full path: for a valid
    call and each variant of it, _validate.combine_eager True implies combine_args passes; the common call (with or
    without top-k weights, with a Config) is eager; anything with bias, a wrong type, dtype, shape, device or
    layout is not."""
    x, idx, w = make_inputs(device)
    _, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, **layout_kwargs(buffer, idx))
    uid, dev = buffer._ctx.uid, x.get_device()
    base = dict(x=x, handle=handle, topk_weights=recv_w, bias=None, config=None)
    eager_ok = {
        "common": {}, "no weights": dict(topk_weights=None), "a Config": dict(config=deep_ep.Config(24)),
    }
    full_only = {   # the full path takes these (and passes or raises): never eager
        "bias": dict(bias=torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)),
        "two biases": dict(bias=(x, x)),
        "config tuple": dict(config=(20, 6, 256, 6, 128)),
        "handle tuple": dict(handle=tuple(handle)),
        "handle of another Buffer": dict(handle=handle._replace(buffer_uid=uid + 1)),
        "x float32": dict(x=x.float()), "x 1-D": dict(x=x.flatten()), "x list": dict(x=[x]),
        "x rows": dict(x=x[:-1].contiguous()), "x not contiguous": dict(x=x.t().contiguous().t()),
        "x hidden 100": dict(x=x[:, :100].contiguous()), "x hidden 0": dict(x=x[:, :0].contiguous()),
        "x 3-D": dict(x=x.view(TOKENS, 1, HIDDEN)), "x 3-D, 8 wide": dict(x=x.view(TOKENS, 8, HIDDEN // 8)),
        "weights 3-D": dict(topk_weights=recv_w.unsqueeze(-1)), "weights list": dict(topk_weights=[recv_w]),
        "weights bf16": dict(topk_weights=recv_w.bfloat16()), "weights 1-D": dict(topk_weights=recv_w.flatten()),
        "weights rows": dict(topk_weights=recv_w[:-1].contiguous()),
        "weights too wide": dict(topk_weights=torch.zeros(TOKENS, check.MAX_TOPK + 1, device=device)),
        "weights empty": dict(topk_weights=recv_w[:, :0].contiguous()),
        "weights not contiguous": dict(topk_weights=torch.zeros(TOPK, TOKENS, device=device).t()),
    }
    for name, change in {**eager_ok, **full_only}.items():
        args = {**base, **change}
        eager = check.combine_eager(args["x"], args["handle"], args["topk_weights"], args["bias"], args["config"],
                                    uid, dev)
        assert eager == (name in eager_ok), name
        if eager:   # then the full checks pass
            check.combine_args(args["x"], args["handle"], args["topk_weights"], args["bias"], args["config"], uid,
                               device, 16)
    assert not check.combine_eager(x, handle, recv_w, None, None, uid, dev + 1)   # another device


def test_transport_options_are_checked_by_the_chosen_backend(group, monkeypatch):
    # A backend without options refuses any, by name, before anything is set up.
    with pytest.raises(ValueError, match="transport 'reference' takes no options"):
        deep_ep.Buffer(group, 1 << 20, 0, transport="reference", transport_options={"ib_sl": 3})
    with pytest.raises(TypeError, match="transport_options must be a dict"):
        deep_ep.Buffer(group, 1 << 20, 0, transport="reference", transport_options=[("ib_sl", 3)])
    buf = deep_ep.Buffer(group, 1 << 20, 0, transport="reference", transport_options={})
    assert buf._ctx.options.get("reference") is None
    # A backend with a schema: its validated value lands where its transport reads it (BufferContext.options[name]),
    # the same as its deprecated keyword's. Checked on the reference transport by pointing its row at nccl_gin's
    # schema (the backends with options need a GPU to be built).
    row = registry.row("reference")
    monkeypatch.setitem(registry.BY_NAME, "reference", dataclasses.replace(row, options=registry.row("nccl_gin").options,
                                                                           legacy_option="nccl_options"))
    with pytest.raises(ValueError, match="unknown nccl option 'ib_gid'"):
        deep_ep.Buffer(group, 1 << 20, 0, transport="reference", transport_options={"ib_gid": 3})
    buf = deep_ep.Buffer(group, 1 << 20, 0, transport="reference", transport_options={"ib_sl": 3, "gin": False})
    assert buf._ctx.options["reference"] == {"ib_sl": 3, "gin": False}
    # transport_options and the deprecated keyword of the same backend: refused (which one wins would be a guess).
    with pytest.raises(ValueError, match="transport_options and nccl_options both give options"):
        deep_ep.Buffer._transport_options("nccl_gin", {"ib_sl": 3}, {"nccl_gin": {"ib_sl": 3}})
