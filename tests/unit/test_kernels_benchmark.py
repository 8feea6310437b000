"""benchmarks.kernels on a small exported DLRM and small trees: every point timed for the builds this
CPU runs, the two builds' floats compared, and the table says which build did not run."""

import numpy as np
import pytest

from benchmarks import kernels
from ensemble.models import dlrm_kernel, dlrm_torch, xgb
from ensemble.models.dlrm import DLRMConfig


@pytest.fixture()
def small_dlrm(tmp_path):
    """The C forward pass of a small exported TorchScript DLRM (26 columns of 7 ids)."""
    config = DLRMConfig(embedding_dim=16, bottom_mlp=(32,), top_mlp=(48, 16), cardinalities=(7,) * 26)
    (tmp_path / "1").mkdir()
    dlrm_torch.save(dlrm_torch.build(config).eval(), tmp_path / "1")
    return dlrm_torch.TorchScorer(tmp_path / "1").kernel


@pytest.mark.skipif(not dlrm_kernel.available(), reason="ensemble.native._dlrm not built, or this CPU lacks AVX2+FMA")
def test_every_point_is_timed_and_the_builds_give_the_same_floats(small_dlrm):
    from ensemble.native import _dlrm

    results = kernels.run({"dlrm_torch": small_dlrm}, rows=(1, 17), repetitions=2, budget_rows=40)
    assert [(r["model"], r["rows"]) for r in results] == [("dlrm_torch", 1), ("dlrm_torch", 17)]
    assert all(r["narrow_us_per_row"] > 0 for r in results)
    lines = kernels.table(results).splitlines()
    if _dlrm.wide():
        assert all(r["same_floats"] and r["wide_us_per_row"] > 0 for r in results)
        assert lines[2].endswith("| yes |")
    else:
        assert "not on this CPU" in lines[2]
    assert _dlrm.wide() == _dlrm.wide(True)  # the benchmark leaves the wide build on where it runs


@pytest.mark.skipif(not dlrm_kernel.available(), reason="ensemble.native._dlrm not built, or this CPU lacks AVX2+FMA")
def test_another_build_is_timed_on_the_same_weights_and_its_floats_compared(small_dlrm):
    """--against: a second copy of the module loaded from its shared object (here this very build, so
    the floats must be the same) runs in the same alternation, and the table gains its columns."""
    from ensemble.native import _dlrm

    other = kernels.load_build(_dlrm.__file__)
    assert other is not _dlrm
    results = kernels.run({"dlrm_torch": small_dlrm}, rows=(3, 40), repetitions=2, budget_rows=80, against=[other])
    assert all(r["against_same_floats"] and r["against_us_per_row"] > 0 and r["against_over_this"] > 0
               for r in results)
    lines = kernels.table(results).splitlines()
    assert "--against us/row" in lines[0] and lines[2].endswith("| yes |")


@pytest.mark.skipif(xgb._trees is None, reason="ensemble.native._trees was not built (no C compiler at install)")
def test_the_trees_are_timed_in_both_walks_and_against_another_build():
    """Random complete trees of depth 6 at 3 and 40 rows (the 16-lane walk takes 16 rows or more on
    AVX-512): both walks' floats the same, and --against a second copy of the module (this build, so the
    same floats) timed beside them; a DLRM module given as --against does not apply to the trees."""
    from ensemble.native import _trees

    rng = np.random.default_rng(3)
    trees = xgb.TreeArrays(rng.integers(0, 10, 20 * 63).astype(np.uint32), rng.normal(size=20 * 63).astype(np.float32),
                           rng.normal(size=20 * 64).astype(np.float32), 6, 0.1, 5)
    other = kernels.load_build(_trees.__file__)
    assert other is not _trees and other.__name__ == "against._trees"
    results = kernels.run({"xgb": trees}, rows=(3, 40), repetitions=2, budget_rows=80, against=[other])
    assert [(r["model"], r["rows"]) for r in results] == [("xgb", 3), ("xgb", 40)]
    assert all(r["against_same_floats"] and r["against_us_per_row"] > 0 for r in results)
    if _trees.wide():
        assert all(r["same_floats"] for r in results)
    lines = kernels.table(results).splitlines()
    assert "--against us/row" in lines[0] and lines[3].endswith("| yes |")
    with pytest.raises(SystemExit, match="not a build of"):
        kernels.load_build(xgb.__file__)
