"""The eager layout's spare outputs (engines/dispatch_layout.py `_spares`), on the CPU: the kernel launch, the
current stream and the capture query replaced by recorders, the outputs real (CPU) tensors. When spares start,
that a call never gets outputs another call has, that a capturing stream never takes or makes one, and the bound.
The GPU side (the kernel writing them, a real capture) is tests/gpu/test_layout_gpu.py."""
from __future__ import annotations

import pytest
import torch

from deepep_portable.engines import dispatch_layout as dl

RANKS, EXPERTS = 4, 16


@pytest.fixture
def fake_gpu(monkeypatch):
    state = {"stream": 7, "capturing": False, "launches": []}
    monkeypatch.setattr(dl, "current_stream_handle", lambda dev: state["stream"])
    monkeypatch.setattr(dl, "_launch_layout",
                        lambda idx, experts, ranks, dev, stream, *ptrs: state["launches"].append((stream, ptrs)))
    monkeypatch.setattr(dl, "_is_capturing", [lambda dev, stream: state["capturing"]])
    monkeypatch.setattr(dl, "_spares", {})
    monkeypatch.setattr(dl, "_last_key", [None])
    yield state
    HELD.clear()


HELD: list = []   # every call's outputs stay alive for the test, so their addresses cannot be reused


def call(tokens: int = 10, experts: int = EXPERTS):
    outputs = dl.dispatch_layout_current_stream(torch.zeros(tokens, 2, dtype=torch.int64), experts, RANKS, 0)
    per_rank, per_expert, in_rank = outputs
    assert per_rank.shape == (RANKS,) and per_expert.shape == (experts,) and in_rank.shape == (tokens, RANKS)
    HELD.append(outputs)
    return tuple(t.data_ptr() for t in outputs)


def test_spares_start_when_a_shape_repeats_and_every_call_gets_its_own(fake_gpu):
    kept = [call()]                       # first of its shape: allocated now, no spare
    assert dl._spares == {} and fake_gpu["launches"][-1][1] == kept[0]
    kept.append(call())                   # a repeat: allocated now, and a spare for the next call
    key = (0, 7, 10, RANKS, EXPERTS)
    spare = dl._spares[key][1]
    kept.append(call())                   # takes the spare, leaves a new one
    assert kept[-1] == spare and fake_gpu["launches"][-1][1] == spare
    assert dl._spares[key][1] not in kept
    kept.append(call())
    flat = [p for ptrs in kept for p in ptrs]
    assert len(set(flat)) == len(flat)


def test_a_capturing_stream_neither_takes_nor_makes_a_spare(fake_gpu):
    call(), call()
    key = (0, 7, 10, RANKS, EXPERTS)
    spare = dl._spares[key][1]
    fake_gpu["capturing"] = True
    captured = [call(), call()]           # fresh outputs (the graph's pool on a GPU); the spare waits
    assert dl._spares[key][1] == spare and spare not in captured
    fake_gpu["capturing"] = False
    assert call() == spare                # the eager call after the capture takes it


def test_changing_shapes_make_no_spares_and_the_spares_are_bounded(fake_gpu):
    for tokens in (3, 4, 3, 4, 3):
        call(tokens)
    assert dl._spares == {}
    for tokens in range(1, 3 * dl._MAX_SPARES):
        call(tokens), call(tokens)
        assert len(dl._spares) <= dl._MAX_SPARES
    fake_gpu["stream"] = 9                # another stream: its own key
    call(), call()
    assert (0, 9, 10, RANKS, EXPERTS) in dl._spares
