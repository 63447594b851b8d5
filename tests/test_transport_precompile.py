"""transports/precompile.py: a backend's kernels built ahead of use, through the backend's own compile step."""
from __future__ import annotations

import threading

import pytest

from deepep_portable import jit
from deepep_portable.engines import internode, low_latency
from deepep_portable.transports import precompile


class _Result:
    def __init__(self, hit: bool) -> None:
        self.seconds, self.cache_hit = (0.0 if hit else 1.5), hit


def test_suite_variants_cover_the_ll_and_internode_suites():
    variants = precompile.suite_variants()
    sources = {s for s, _ in variants}
    assert {low_latency.DISPATCH_SOURCE, low_latency.COMBINE_SOURCE, low_latency.CLEAN_SOURCE,
            internode.DISPATCH_SOURCE, internode.COMBINE_SOURCE} <= sources
    for ranks, per_node in internode.PRECOMPILE_NODES:   # every node shape the GPU suites compile
        assert any(d.get("NUM_RANKS") == ranks and d.get("RANKS_PER_NODE") == per_node for _, d in variants)
    assert (low_latency.COMBINE_SOURCE, low_latency.kernel_defines(7168, 8, True, low_latency.PHASE_RECV)) in variants


def test_build_variants_compiles_each_variant_per_arch_and_labels_it(monkeypatch):
    monkeypatch.setattr(jit, "find_nvcc", lambda: "nvcc")
    seen, lock = [], threading.Lock()

    def compile_one(source, defines, arch):
        with lock:
            seen.append((source, tuple(sorted(defines.items())), arch))
        return _Result(hit=arch == "sm_80")

    variants = [("a/dispatch.cu", {"HIDDEN": 7168, "NUM_TOPK": 8}), ("a/clean.cu", {})]
    out = precompile.build_variants("fake", compile_one, ("sm_80", "sm_90"), jobs=2, variants=variants)
    assert sorted(seen) == sorted((s, tuple(sorted(d.items())), a) for s, d in variants for a in ("sm_80", "sm_90"))
    assert ("dispatch.cu[fake,HIDDEN=7168,NUM_TOPK=8]", "sm_90", 1.5, False) in out
    assert ("clean.cu[fake]", "sm_80", 0.0, True) in out


def test_build_variants_raises_the_first_failure_after_the_others(monkeypatch):
    monkeypatch.setattr(jit, "find_nvcc", lambda: "nvcc")
    done = []

    def compile_one(source, defines, arch):
        if source == "bad.cu":
            raise jit.JitCompileError("bad.cu: error")
        done.append(source)
        return _Result(hit=False)

    with pytest.raises(jit.JitCompileError, match="bad.cu"):
        precompile.build_variants("fake", compile_one, ("sm_90",), jobs=1,
                                  variants=[("bad.cu", {}), ("good1.cu", {}), ("good2.cu", {})])
    assert sorted(done) == ["good1.cu", "good2.cu"]


def test_build_variants_names_a_missing_compiler(monkeypatch):
    def no_nvcc():
        raise jit.JitCompileError("nvcc not found (looked in CUDA_HOME)")
    monkeypatch.setattr(jit, "find_nvcc", no_nvcc)
    with pytest.raises(jit.JitCompileError, match="nvcc not found"):
        precompile.build_variants("fake", lambda *a: _Result(False), ("sm_90",), variants=[("x.cu", {})])
