"""The real-hardware model (deepep_portable/tools/model.py): its arithmetic, its fit to the EP 2 measurements,
and where it says the bound moves from the SMs to NVLink."""
import pytest

from deepep_portable.tools import model


def test_distinct_ranks_per_token():
    assert model.ranks_per_token(1) == pytest.approx(1.0)
    assert model.ranks_per_token(2) == pytest.approx(1.9925, abs=1e-3)   # misses a rank in 0.37 % of tokens
    assert model.ranks_per_token(8) == pytest.approx(5.295, abs=2e-3)
    assert model.ranks_per_token(256) == pytest.approx(8.0)               # one expert per rank: k ranks


def test_fit_reproduces_the_ep2_measurements():
    for (op, tokens), measured in model.EP2_MEASURED.items():
        assert model.predict(op, 2, tokens, model.EP2_BLOCKS, own_rows_staged=True).total_us == pytest.approx(
            measured, rel=1e-9)
    for op in ("dispatch", "combine"):
        f = model.fit(op)
        assert 0 < f.fixed_us < 300 and 10 < f.per_block_gbps < 40


def test_the_bound_moves_to_nvlink_with_blocks_and_ranks():
    assert model.predict("dispatch", 2, 4096, 24).bound == "SMs"          # half the bytes stay on the GPU
    assert model.predict("dispatch", 8, 4096, 16).bound == "SMs"
    assert model.predict("dispatch", 8, 4096, 24).bound == "NVLink"       # 7/8 of the bytes cross the link
    fast = model.predict("combine", 8, 16384, 64)
    assert fast.main_us == pytest.approx(model.op_bytes("combine", 8, 16384)[1] / (model.LINK_GBPS * 8 / 7) / 1e3)
    assert model.predict("dispatch", 8, 16384, 24).total_us > model.predict("dispatch", 8, 4096, 24).total_us


def test_cli(capsys):
    from deepep_portable.__main__ import main

    assert main(["model", "--ranks", "8", "--tokens", "4096", "--blocks", "24"]) == 0
    out = capsys.readouterr().out
    assert "NVLink-bound" in out and "fit from EP 2" in out


def test_zero_copy_forms_drop_only_the_staging_copy(capsys):
    from deepep_portable.__main__ import main

    for op in ("dispatch", "combine"):
        staged, zc = model.predict(op, 8, 4096, 24), model.predict(op + "_zc", 8, 4096, 24)
        assert zc.stage_us == 0 and staged.stage_us > 0
        assert (zc.fixed_us, zc.main_us, zc.bound) == (staged.fixed_us, staged.main_us, staged.bound)
    assert main(["model", "--ranks", "8", "--tokens", "4096", "--blocks", "24", "--zero-copy"]) == 0
    assert "dispatch_zc" in capsys.readouterr().out


def test_the_combine_stages_only_other_ranks_rows():
    """A rank's own rows are read in its x (intranode/combine.cu): only (R-1)/R of its received rows are staged."""
    for ranks in (2, 8):
        now, before = model.op_bytes("combine", ranks, 4096), model.op_bytes("combine", ranks, 4096, True)
        assert now[0] == pytest.approx(before[0] * (ranks - 1) / ranks) and now[1] == before[1]
    assert model.op_bytes("dispatch", 8, 4096) == model.op_bytes("dispatch", 8, 4096, True)
