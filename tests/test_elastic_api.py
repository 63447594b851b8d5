"""DeepEP V2's public surface (`deep_ep.ElasticBuffer`, `deep_ep.utils`, `import deep_ep`), single process.

The tables below are DeepEP V2's signatures as its deep_ep/buffers/elastic.py declares them: parameter
names in order, with their defaults. Calls run on a one-rank gloo group over the reference transport;
tests/mpi/test_elastic_mpi.py checks the results on several ranks against the oracle.
"""
from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deepep_portable.buffers.elastic import UNSUPPORTED, ElasticBuffer
from deepep_portable.elastic_handle import EPHandle
from deepep_portable.event import EventOverlap as BufferEventOverlap
from deepep_portable.layout import normal_buffer_bytes
from deepep_portable.utils import EventHandle, EventOverlap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_DEFAULT = inspect.Parameter.empty

V2_SIGNATURES = {
    "__init__": [("self", NO_DEFAULT), ("group", NO_DEFAULT), ("num_bytes", None), ("num_cpu_bytes", 0),
                 ("num_max_tokens_per_rank", 0), ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False),
                 ("deterministic", False), ("allow_hybrid_mode", True), ("allow_multiple_reduction", True),
                 ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                 ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
    "dispatch": [("self", NO_DEFAULT), ("x", NO_DEFAULT), ("topk_idx", None), ("topk_weights", None),
                 ("cumulative_local_expert_recv_stats", None), ("num_experts", None),
                 ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0), ("num_qps", 0),
                 ("previous_event", None), ("previous_event_before_epilogue", None),
                 ("async_with_compute_stream", False), ("allocate_on_comm_stream", False), ("handle", None),
                 ("do_handle_copy", True), ("do_cpu_sync", None), ("do_expand", False), ("do_zero_padding", False),
                 ("use_tma_aligned_col_major_sf", False)],
    "combine": [("self", NO_DEFAULT), ("x", NO_DEFAULT), ("handle", NO_DEFAULT), ("topk_weights", None),
                ("bias", None), ("num_sms", 0), ("num_qps", 0), ("previous_event", None),
                ("previous_event_before_epilogue", None), ("async_with_compute_stream", False),
                ("allocate_on_comm_stream", False)],
    "get_buffer_size_hint": [("group", NO_DEFAULT), ("num_max_tokens_per_rank", NO_DEFAULT), ("hidden", NO_DEFAULT),
                             ("num_topk", 0), ("use_fp8_dispatch", False), ("allow_hybrid_mode", True),
                             ("allow_multiple_reduction", True)],
    "get_theoretical_num_sms": [("self", NO_DEFAULT), ("num_experts", NO_DEFAULT), ("num_topk", NO_DEFAULT),
                                ("num_scaleout_topk", 0), ("rdma_gbs", 0), ("nvlink_gbs", 0), ("sm_read_gbs", 200),
                                ("sm_write_gbs", 50)],
    "get_theoretical_num_qps": [("self", NO_DEFAULT), ("num_sms", NO_DEFAULT)],
    "barrier": [("self", NO_DEFAULT), ("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)],
    "capture": [],
    "get_comm_stream": [("self", NO_DEFAULT)],
    "get_physical_domain_size": [("self", NO_DEFAULT)],
    "get_logical_domain_size": [("self", NO_DEFAULT)],
    "destroy": [("self", NO_DEFAULT)],
}
V2_STATIC = {"get_buffer_size_hint", "capture"}
OURS_KEYWORD_ONLY = {"transport", "ranks_per_node", "transport_options", "nvshmem_options", "ibgda_options", "nccl_options"}
V2_HANDLE_FIELDS = ["do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx",
                    "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list",
                    "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                    "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
                    "token_metadata_at_forward", "channel_linked_list"]
V2_ATTRIBUTES = ["group", "rank_idx", "num_ranks", "allow_hybrid_mode", "allow_multiple_reduction",
                 "prefer_overlap_with_compute", "deterministic", "num_bytes", "num_max_tokens_per_rank",
                 "num_scaleout_ranks", "num_scaleup_ranks", "scaleout_rank_idx", "scaleup_rank_idx", "num_rdma_ranks",
                 "num_nvlink_ranks", "num_allocated_qps", "explicitly_destroy", "runtime"]
V2_UNSUPPORTED = ["get_engram_storage_size_hint", "get_pp_buffer_size_hint", "get_agrs_num_max_session_bytes",
                  "get_agrs_buffer_size_hint", "engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv",
                  "create_agrs_session", "destroy_agrs_session", "agrs_new_session", "agrs_set_config",
                  "agrs_get_inplace_tensor", "all_gather"]
HIDDEN, TOKENS, EXPERTS, TOPK = 256, 12, 8, 3


@pytest.fixture(scope="module")
def buf(one_rank_group):
    buffer = ElasticBuffer(one_rank_group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, transport="reference",
                           explicitly_destroy=True)
    yield buffer
    buffer.destroy()


def inputs(num_tokens=TOKENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(num_tokens, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK].contiguous()
    return x, idx, torch.rand(num_tokens, TOPK, generator=gen)


# ---- signatures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(V2_SIGNATURES))
def test_signature_is_v2s(name):
    params = list(inspect.signature(getattr(ElasticBuffer, name)).parameters.values())
    v2 = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert v2 == V2_SIGNATURES[name]
    ours = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
    assert ours == (OURS_KEYWORD_ONLY if name == "__init__" else set())
    assert isinstance(inspect.getattr_static(ElasticBuffer, name), staticmethod) == (name in V2_STATIC)


def test_handle_fields_in_v2s_order():
    params = list(inspect.signature(EPHandle.__init__).parameters.values())[1:]
    assert [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD] == V2_HANDLE_FIELDS


def test_attributes_v2_callers_read(buf):
    missing = [a for a in V2_ATTRIBUTES if not hasattr(buf, a)]
    assert missing == []
    assert (buf.rank_idx, buf.num_ranks, buf.scaleout_rank_idx, buf.scaleup_rank_idx) == (0, 1, 0, 0)
    assert buf.get_logical_domain_size() == (1, 1) == buf.get_physical_domain_size()
    assert buf.num_allocated_qps == 129 and buf.num_max_tokens_per_rank == TOKENS
    assert buf.get_comm_stream() is None or isinstance(buf.get_comm_stream(), torch.cuda.Stream)


def test_sized_by_moe_settings_or_bytes(one_rank_group):
    hint = ElasticBuffer.get_buffer_size_hint(one_rank_group, TOKENS, HIDDEN)
    assert hint % (2 << 20) == 0 and hint >= normal_buffer_bytes(TOKENS, HIDDEN * 2, 1)
    assert ElasticBuffer.get_buffer_size_hint(one_rank_group, TOKENS, HIDDEN, num_topk=2) <= hint
    by_settings = ElasticBuffer(one_rank_group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, transport="reference",
                                explicitly_destroy=True)
    by_bytes = ElasticBuffer(one_rank_group, hint, transport="reference", explicitly_destroy=True)
    assert by_settings.num_bytes == hint == by_bytes.num_bytes and by_settings.runtime.num_nvl_bytes == hint
    assert by_bytes.num_max_tokens_per_rank == 0
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):   # no default bound to fall back on
        by_bytes.dispatch(*inputs()[:2], num_experts=EXPERTS)
    by_settings.destroy()
    by_bytes.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        by_bytes.dispatch(*inputs()[:2], num_experts=EXPERTS, num_max_tokens_per_rank=TOKENS)
    with pytest.raises(ValueError, match="num_bytes, or num_max_tokens_per_rank and hidden"):
        ElasticBuffer(one_rank_group, transport="reference")


def test_destroy_needs_explicitly_destroy(one_rank_group):
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        ElasticBuffer(one_rank_group, 2 << 20, transport="reference").destroy()


# ---- out of scope ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", V2_UNSUPPORTED)
def test_unsupported_features_raise_naming_them(buf, name):
    feature = next(f for f, names in UNSUPPORTED.items() if name in names)
    with pytest.raises(NotImplementedError, match=f"{feature.split(' ')[0]}.*{name}"):
        getattr(buf, name)(1, 2)
    with pytest.raises(NotImplementedError, match=f"{feature.split(' ')[0]}.*{name}"):
        getattr(ElasticBuffer, name)(1, 2)


def test_engram_cpu_storage_refused_before_setup(one_rank_group):
    with pytest.raises(NotImplementedError, match="Engram"):
        ElasticBuffer(one_rank_group, 2 << 20, num_cpu_bytes=2 << 20, transport="reference")


# ---- bad input: a clear error before any work ------------------------------------------------------------
@pytest.fixture
def spied(buf):
    """Record every call ElasticBuffer makes on its V1 Buffer."""
    calls = []
    for name in ("get_dispatch_layout", "dispatch", "combine"):
        real = getattr(buf.runtime, name)
        setattr(buf.runtime, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    yield calls
    for name in ("get_dispatch_layout", "dispatch", "combine"):
        delattr(buf.runtime, name)


def _bad_dispatches(h):
    x, idx, w = inputs()
    return [
        (dict(x=x, num_experts=EXPERTS), ValueError, "needs topk_idx"),
        (dict(x=x, topk_idx=idx), ValueError, "needs num_experts"),
        (dict(x=x, topk_idx=idx, num_experts=0), ValueError, "num_experts must be >= 1"),
        (dict(x=x, topk_idx=idx.to(torch.int32), num_experts=EXPERTS), TypeError, "topk_idx must have dtype"),
        (dict(x=x, topk_idx=idx[:-1], num_experts=EXPERTS), ValueError, "topk_idx must have shape"),
        (dict(x=x.float(), topk_idx=idx, num_experts=EXPERTS), TypeError, "x must have dtype"),
        (dict(x=x, topk_idx=idx, topk_weights=w[:, :2], num_experts=EXPERTS), ValueError, "topk_weights"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, num_max_tokens_per_rank=TOKENS - 1), ValueError,
         "more than num_max_tokens_per_rank"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, expert_alignment=0), ValueError, "expert_alignment"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, do_zero_padding=True), ValueError, "do_expand"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, num_qps=10_000), ValueError, "num_allocated_qps"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, num_sms=-1), ValueError, "num_sms"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, previous_event=object()), TypeError, "EventHandle"),
        (dict(x=x, topk_idx=idx, num_experts=EXPERTS, cumulative_local_expert_recv_stats=torch.zeros(3)),
         TypeError, "cumulative_local_expert_recv_stats"),
        (dict(x=x, handle=object()), TypeError, "EPHandle"),
        (dict(x=x, topk_idx=idx, handle=h), ValueError, "takes no topk_idx"),
        (dict(x=x, handle=h, do_cpu_sync=True), ValueError, "CPU sync"),
        (dict(x=x, handle=h, expert_alignment=4), ValueError, "expert_alignment=4 differs"),
        (dict(x=x, handle=h, num_experts=2 * EXPERTS), ValueError, "num_experts=16 differs"),
        (dict(x=x, handle=h, do_expand=True), ValueError, "do_expand"),
        (dict(x=x[:-1], handle=h), ValueError, "tokens"),
    ]


def test_bad_dispatch_raises_before_any_work(buf, spied):
    x, idx, w = inputs()
    h = buf.dispatch(x, idx, w, num_experts=EXPERTS)[3]
    spied.clear()
    for kwargs, error, message in _bad_dispatches(h):
        with pytest.raises(error, match=message):
            buf.dispatch(**kwargs)
        assert spied == [], f"{sorted(kwargs)}: {spied} ran before the error"


def test_bad_combine_raises_before_any_work(buf, spied):
    x, idx, w = inputs()
    recv_x, _, recv_w, h, _ = buf.dispatch(x, idx, w, num_experts=EXPERTS)
    expanded_h = buf.dispatch(x, idx, w, num_experts=EXPERTS, do_expand=True)[3]
    spied.clear()
    bad = [
        (dict(x=recv_x, handle=None), TypeError, "EPHandle"),
        (dict(x=recv_x[:-1], handle=h), ValueError, "x must have shape"),
        (dict(x=recv_x.float(), handle=h), TypeError, "x must have dtype"),
        (dict(x=recv_x, handle=expanded_h), ValueError, "x must have shape"),
        (dict(x=recv_x, handle=h, topk_weights=recv_w[:, 0]), ValueError, "topk_weights must have shape"),
        (dict(x=recv_x, handle=h, bias=recv_x[:, :8]), ValueError, r"bias\[0\] must have shape"),
        (dict(x=recv_x, handle=h, bias=(x, x[:1])), ValueError, r"bias\[1\] must have shape"),
        (dict(x=recv_x, handle=h, num_qps=-1), ValueError, "num_qps"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            buf.combine(**kwargs)
        assert spied == [], f"{sorted(kwargs)}: {spied} ran before the error"
    combined, combined_w, _ = buf.combine(recv_x, h, recv_w)   # and the buffer still works
    assert torch.equal(combined, x) and torch.equal(combined_w, w)


# ---- models -------------------------------------------------------------------------------------------
def test_theoretical_num_sms_follows_its_documented_model():
    model = ElasticBuffer.__new__(ElasticBuffer)   # the model reads only these attributes
    model.num_ranks, model.num_nvlink_ranks, model.prefer_overlap_with_compute = 8, 8, True
    model._num_sms_estimates = {}
    distinct = 8 * (1 - math.comb(256 - 32, 8) / math.comb(256, 8))
    want = math.ceil(1.25 * 450 * max(1 / distinct / 200, 1 / 50))
    want += want % 2
    if torch.cuda.is_available():
        want = min(want, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    assert model.get_theoretical_num_sms(256, 8) == want
    model.num_nvlink_ranks = 4   # two nodes: RDMA (50 GB/s) carries half the destinations
    assert model.get_theoretical_num_sms(256, 8) == want   # cached per arguments
    # the links now move 1 / max(0.5 / 450, 0.5 / 50) = 100 GB/s: 1.25 * 100 / 50 = 2.5 SMs, raised to 4
    assert model.get_theoretical_num_sms(256, 8, rdma_gbs=50.0) == 4
    model.prefer_overlap_with_compute = False
    device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
        if torch.cuda.is_available() else 64
    assert model.get_theoretical_num_sms(256, 8, nvlink_gbs=100.0) == min(64, device_sms)
    with pytest.raises(ValueError, match="num_scaleout_topk"):
        model.get_theoretical_num_sms(256, 8, num_scaleout_topk=2)


def test_theoretical_num_qps(buf):
    assert buf.get_theoretical_num_qps(4) == 65 and buf.get_theoretical_num_qps(24) == 129
    direct = ElasticBuffer.__new__(ElasticBuffer)
    direct.allow_hybrid_mode, direct.num_allocated_qps = False, 17
    assert direct.get_theoretical_num_qps(4) == 5 and direct.get_theoretical_num_qps(24) == 9


# ---- events -------------------------------------------------------------------------------------------
def test_event_overlap_v2_additions():
    event = EventOverlap(EventHandle())
    assert isinstance(event, BufferEventOverlap)
    assert isinstance(ElasticBuffer.capture(), EventHandle)
    ran = []
    event.register_hook_after_wait(lambda: ran.append(1))
    with pytest.raises(RuntimeError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    event.current_stream_wait()
    event.current_stream_wait()
    assert ran == [1]
    handle = event.event
    with event(release_handle=True):
        pass
    assert event.event is None and handle.query()
    kept = EventOverlap(EventHandle())
    with kept:
        pass
    assert kept.event is not None
    if torch.cuda.is_available():
        assert EventHandle().event is not None


def test_v1_ops_return_v2_event_overlaps_and_accept_either(one_rank_group):
    """As in DeepEP V2, V1's Buffer returns V2's EventOverlap (a V1 EventOverlap with V2's additions), so a caller
    that checks the type against either class, or registers a hook, works with V1 ops too; a V1 EventOverlap
    made by hand is still a previous_event."""
    import deepep_portable

    event = deepep_portable.Buffer.capture()
    assert type(event) is EventOverlap and isinstance(event, BufferEventOverlap)
    assert deepep_portable.EventOverlap is EventOverlap and deepep_portable.EventHandle is EventHandle
    ran = []
    event.register_hook_after_wait(lambda: ran.append(1))
    event.current_stream_wait()
    assert ran == [1]
    v1 = deepep_portable.Buffer(one_rank_group, 1 << 20, 0, transport="reference", explicitly_destroy=True)
    try:
        _, idx, _ = inputs()
        for previous in (BufferEventOverlap(None), deepep_portable.Buffer.capture()):
            *_, done = v1.get_dispatch_layout(idx, EXPERTS, previous_event=previous, async_finish=True)
            assert type(done) is EventOverlap
        with pytest.raises(TypeError, match="previous_event"):
            v1.get_dispatch_layout(idx, EXPERTS, previous_event=object(), async_finish=True)
    finally:
        v1.destroy()


def test_top_level_names_are_deepep_v2s():
    """DeepEP V2's deep_ep/__init__.py names, all at deepep_portable's top level (`import deepep_portable as
    deep_ep`), the same objects as in their modules."""
    import deepep_portable
    from deepep_portable.buffers import elastic

    v2_top_level = ["Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "get_physical_domain_size",
                    "get_logical_domain_size", "Config", "topk_idx_t", "__version__"]
    missing = [n for n in v2_top_level if not hasattr(deepep_portable, n)]
    assert not missing, f"not at the top level: {missing}"
    assert deepep_portable.get_logical_domain_size is elastic.get_logical_domain_size
    assert deepep_portable.get_physical_domain_size is elastic.get_physical_domain_size
    assert set(v2_top_level) - {"__version__"} <= set(deepep_portable.__all__)


# ---- import deep_ep ----------------------------------------------------------------------------------
def _python(*snippets: str) -> subprocess.CompletedProcess:
    """Run the snippets, one after the other, in a fresh interpreter that sees this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    code = "".join(textwrap.dedent(s) for s in snippets)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


ALIAS_CHECKS = """
    import sys
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap
    from deep_ep.utils.event import EventOverlap as EventOverlap2
    from deep_ep.buffers.elastic import ElasticBuffer, EPHandle
    from deep_ep.buffers.legacy import Buffer
    import deepep_portable, deepep_portable.utils, deepep_portable.buffers.elastic as elastic
    assert EventOverlap is EventOverlap2 is deepep_portable.utils.EventOverlap is deep_ep.EventOverlap
    assert deep_ep.EventHandle is EventHandle and isinstance(EventOverlap(EventHandle()).event, EventHandle)
    assert deep_ep.ElasticBuffer is ElasticBuffer is elastic.ElasticBuffer and deep_ep.EPHandle is EPHandle
    assert deep_ep.Buffer is Buffer is deepep_portable.Buffer and deep_ep.topk_idx_t is deepep_portable.topk_idx_t
    assert deep_ep.Config is deepep_portable.Config
    assert deep_ep.get_logical_domain_size is elastic.get_logical_domain_size
    assert deep_ep.available_transports is deepep_portable.available_transports   # ours, by fallback
    assert deep_ep.utils is deepep_portable.utils and deep_ep.buffers.elastic is elastic
    try:
        import deep_ep.utils.math
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("deep_ep.utils.math should not exist")
    print("alias ok", sys.argv[1:])
"""


def test_alias_in_process_from_a_clean_interpreter():
    out = _python("""
        import sys
        assert not any(m == "deep_ep" or m.startswith(("deep_ep.", "deepep_portable")) for m in sys.modules)
        try:
            import deep_ep
        except ModuleNotFoundError:
            pass
        else:
            print("a real DeepEP is installed:", deep_ep.__file__)
        from deepep_portable.alias import install_deep_ep_alias, uninstall_deep_ep_alias
        top = install_deep_ep_alias()
        assert install_deep_ep_alias() is top                                  # idempotent
    """, ALIAS_CHECKS, """
        uninstall_deep_ep_alias()
        assert "deep_ep" not in sys.modules and "deep_ep.utils" not in sys.modules
    """)
    assert out.returncode == 0, out.stdout + out.stderr
    if "a real DeepEP is installed" in out.stdout:
        pytest.skip(out.stdout)
    assert "alias ok" in out.stdout


def test_alias_refuses_to_replace_an_imported_deep_ep():
    out = _python("""
        import sys, types
        sys.modules["deep_ep"] = types.ModuleType("deep_ep")
        from deepep_portable.alias import install_deep_ep_alias
        try:
            install_deep_ep_alias()
        except RuntimeError as e:
            print("refused:", e)
    """)
    assert out.returncode == 0 and "refused: a deep_ep module is imported already" in out.stdout, out.stderr


@pytest.mark.parametrize("form", ["script", "module"])
def test_alias_launcher_runs_an_unmodified_program(tmp_path, form):
    (tmp_path / "v2_program.py").write_text(textwrap.dedent(ALIAS_CHECKS))
    target = [str(tmp_path / "v2_program.py")] if form == "script" else ["-m", "v2_program"]
    env_path = str(tmp_path) if form == "module" else None
    cmd = [sys.executable, "-m", "deepep_portable.alias", *target, "--flag", "value"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, env_path, os.environ.get("PYTHONPATH")])))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "alias ok ['--flag', 'value']" in out.stdout
    usage = subprocess.run([sys.executable, "-m", "deepep_portable.alias"], capture_output=True, text=True, env=env)
    assert usage.returncode != 0 and "usage" in usage.stderr
