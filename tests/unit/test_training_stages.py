"""Training in stages on one work folder, as the GPU deployment does (torch models in one image,
the Keras model in another): the second stage reuses the first stage's workflow and fits the
blend from both stages' scores; the result exports like a one-run training."""

from __future__ import annotations

import json

import pytest

from ensemble.runs import training
from ensemble.data import criteo
from ensemble.models.dlrm import DLRMConfig
from ensemble.models.xgb import XGBConfig

SMALL = training.TrainConfig(xgb=XGBConfig(rounds=8, max_depth=3),
                             dlrm=DLRMConfig(epochs=1, embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,)))


def _read(rows: int, seed: int, folder):
    """Synthetic rows through the real TSV writer and reader, as `ensemble train` reads them."""
    path = criteo.write_criteo(criteo.synthesize(criteo.SynthConfig(rows=rows, scale=0.001, seed=seed)).frame,
                             folder / f"rows-{seed}.tsv")
    return criteo.split(criteo.read_criteo([path]))


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    return _read(6_000, 5, tmp_path_factory.mktemp("stages"))


def _stage(splits, workdir, **changes):
    from dataclasses import replace

    return training.train_all(*splits, workdir, replace(SMALL, **changes), log=lambda _: None)


def test_two_stages_make_a_complete_exportable_training(splits, tmp_path):
    from ensemble.repository.export import TrainedArtifacts, export_repository

    workdir = tmp_path / "work"
    first = _stage(splits, workdir, models=("xgb", "dlrm_torch"))
    assert first["waiting_for"] == ["dlrm_tf"] and not (workdir / "train_report.json").exists()
    assert not (workdir / "models" / "blend").exists()
    workflow = {p.relative_to(workdir): p.read_bytes() for p in (workdir / "workflow").rglob("*") if p.is_file()}
    torch_model = (workdir / "models" / "dlrm_torch" / "model.pt").read_bytes()

    second = _stage(splits, workdir, models=("dlrm_tf",), reuse_features=True)
    assert set(second["test"]) == {"xgb", "dlrm_torch", "dlrm_tf", "blend"}
    assert json.loads((workdir / "train_report.json").read_text())["test"] == \
        json.loads(json.dumps(second["test"]))
    # The second stage read the first stage's workflow and left the first stage's models alone.
    assert {p.relative_to(workdir): p.read_bytes() for p in (workdir / "workflow").rglob("*") if p.is_file()} == workflow
    assert (workdir / "models" / "dlrm_torch" / "model.pt").read_bytes() == torch_model
    export_repository(TrainedArtifacts.under(workdir), tmp_path / "repository")
    assert (tmp_path / "repository" / "blend" / "1" / "blend.json").is_file()


def test_a_stage_that_fits_features_drops_scores_of_an_earlier_workflow(splits, tmp_path):
    workdir = tmp_path / "work"
    _stage(splits, workdir, models=("dlrm_tf",))
    assert (workdir / training.SCORES_DIR / "dlrm_tf.npz").is_file()
    _stage(splits, workdir, models=("xgb",))  # fits the workflow again: dlrm_tf's ids changed
    assert not (workdir / training.SCORES_DIR / "dlrm_tf.npz").exists()


def test_stage_errors_are_clear(splits, tmp_path):
    with pytest.raises(FileNotFoundError, match="no fitted workflow"):
        _stage(splits, tmp_path / "empty", models=("dlrm_tf",), reuse_features=True)
    with pytest.raises(ValueError, match="choose from"):
        _stage(splits, tmp_path / "w", models=("lightgbm",))
    workdir = tmp_path / "mixed"
    _stage(splits, workdir, models=("xgb",))
    other = _read(3_000, 6, tmp_path)
    with pytest.raises(ValueError, match="every stage must read the same data"):
        _stage(other, workdir, models=("dlrm_torch",), reuse_features=True)


def test_train_with_slipstream_from_the_cli_flags_reports_what_it_skipped(splits, tmp_path):
    """`ensemble train --slipstream ...` -> TrainConfig.slipstream -> the torch DLRM trained with
    Slipstream (its statistics in the report), the other models as usual."""
    from dataclasses import replace

    from ensemble.cli import _train_config, build_parser

    args = build_parser().parse_args(["train", "unused.tsv", "--slipstream", "--slip-hot-share", "0.001",
                                      "--slip-drop-share", "0.25", "--slip-alpha", "0.5", "--slip-window", "3",
                                      "--slip-warmup-steps", "2"])
    slip = _train_config(args).slipstream
    assert (slip.hot_share, slip.drop_share, slip.alpha, slip.window, slip.warmup_steps) == (0.001, 0.25, 0.5, 3, 2)
    assert _train_config(build_parser().parse_args(["train", "unused.tsv"])).slipstream is None
    small = replace(SMALL, slipstream=slip, models=("dlrm_torch",), dlrm=replace(SMALL.dlrm, batch_size=128))
    report = training.train_all(*splits, tmp_path / "work", small, log=lambda _: None)
    stats = report["slipstream"]
    assert stats["rows_per_epoch"] == [len(splits[0])] and 0 < stats["skipped_share"] < 0.5
    assert (tmp_path / "work" / "models" / "dlrm_torch" / "model.pt").is_file()
