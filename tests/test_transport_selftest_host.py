"""The host side of the transport conformance kernel, without a GPU: its verdict names every broken
promise (so the GPU test can fail), and it refuses a window too small for its layout."""
from types import SimpleNamespace

import pytest

from deepep_portable import layout as L
from deepep_portable.engines import transport_selftest as st

R, ROUNDS = 3, 4


def _test() -> st.TransportSelftest:
    t = st.TransportSelftest.__new__(st.TransportSelftest)
    t.rounds = ROUNDS
    return t


def _good():
    """What every rank reports from a conforming run: each counter got R * ROUNDS distinct old values."""
    results = []
    for r in range(R):
        fetched = [[(r * ROUNDS + k) for k in range(ROUNDS)] for _ in range(R)]
        results.append(dict(rank=r, mismatches=0, get_value_errors=0, waits=2 * R * ROUNDS, peer_ptr=[1] * R,
                            peer_ptr_expected=[1] * R, fetched=fetched, counter=R * ROUNDS, error=None))
    return results


def test_a_conforming_run_has_no_verdict():
    assert _test().verdict(_good()) == {}


@pytest.mark.parametrize("field,value,key", [
    ("mismatches", 5, "rank 1: data"),
    ("get_value_errors", 1, "rank 1: get_value"),
    ("waits", 2 * R * ROUNDS - 1, "rank 1: waits"),
    ("error", (1, 5, 1, 2, 0, 1), "rank 1: error record"),
    ("peer_ptr", [1, 0, 1], "rank 1: peer_ptr"),
    ("counter", R * ROUNDS - 1, "counter of rank 1"),
])
def test_each_broken_promise_is_named(field, value, key):
    results = _good()
    results[1][field] = value
    assert key in _test().verdict(results)


def test_fetch_add_results_must_be_distinct():
    results = _good()
    results[2]["fetched"][0][1] = results[0]["fetched"][0][0]   # two adds saw the same old value
    assert "fetch_add on rank 0" in _test().verdict(results)


def test_window_must_hold_the_layout():
    window = SimpleNamespace(size=st.window_bytes(R) - 1)
    ctx = SimpleNamespace(num_ranks=R)
    with pytest.raises(ValueError, match="window holds"):
        st.TransportSelftest(ctx, window)
    with pytest.raises(ValueError, match="multiple of 32"):
        st.TransportSelftest(ctx, window, bytes_per_put=48)


def test_layout_regions_are_disjoint_and_in_order():
    lay = L.SelftestLayout(8, 4096)
    ends = [(lay.sig_a_offset, 8 * 8), (lay.sig_b_offset, 8 * 8), (lay.value_offset, 8 * 8),
            (lay.zone_a_offset, 8 * 4096), (lay.zone_b_offset, 8 * 4096), (lay.zone_c0_offset, 8 * 2048),
            (lay.zone_c1_offset, 8 * 2048), (lay.stage_offset, 8 * 4096)]
    assert lay.silent_offset + 8 <= lay.sig_a_offset
    for (a, n), (b, _) in zip(ends, ends[1:]):
        assert a + n <= b and b % 8 == 0
    assert ends[-1][0] + ends[-1][1] == lay.total_bytes and lay.zone_a_offset % 16 == 0


def test_fetch_add_is_left_out_only_where_the_backend_has_no_atomic():
    """nccl_gin over GIN has no fetching atomic: the kernel asks none of a GIN peer (-1 results), the counter
    counts the others; a rank that skips a peer it should have asked is named."""
    results = _good()
    for res in results:   # rank 2 is behind a network without atomics for everyone
        res["atomics_expected"] = [1, 1, 0]
        res["fetched"][2] = [-1] * ROUNDS
    rest = sorted(v for res in results for v in res["fetched"][2] if v != -1)
    assert rest == []
    results[2]["counter"] = 0
    assert _test().verdict(results) == {}
    results[0]["fetched"][1] = [-1] * ROUNDS
    verdict = _test().verdict(results)
    assert "rank 0: fetch_add asked" in verdict
