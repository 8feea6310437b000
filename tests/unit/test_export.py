"""Repository layout, atomic versions, manifests."""

import json
import shutil

import pytest

from ensemble.models import manifest
from ensemble.repository.export import TrainedArtifacts, export_repository
from ensemble.scoring.pipeline import latest_version, load_step
from ensemble.schema import Model


def test_repository_layout(trained):
    repo = trained.repository
    for model in Model:
        assert (repo / model.value / "configs" / "gpu.pbtxt").is_file()
        assert not (repo / model.value / "config.pbtxt").exists()  # no layout is the default one
    assert (repo / "ranker" / "configs" / "native.pbtxt").is_file() and (repo / "rank" / "configs" / "fused.pbtxt").is_file()
    assert (repo / "features" / "1" / "workflow" / "workflow.pkl").is_file()  # NVTabular's own format
    assert (repo / "xgb" / "1" / "xgboost.json").is_file()
    assert (repo / "dlrm_torch" / "1" / "model.pt").is_file()
    assert (repo / "dlrm_tf" / "1" / "model.savedmodel" / "saved_model.pb").is_file()
    body = json.loads((repo / "xgb" / "1" / "manifest.json").read_text())
    assert "xgboost.json" in body["files"] and "numpy" in body["libraries"]


def test_new_versions_are_published_whole_and_old_ones_pruned(trained, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(trained.repository, repo)
    artifacts = TrainedArtifacts.under(trained.workdir)
    retired = repo / "xgb" / "config.pbtxt"  # an earlier export's config of the retired CPU ensemble layout
    retired.write_text("# kept\n")
    said: list[str] = []
    export_repository(artifacts, repo, keep=2, log=said.append)
    export_repository(artifacts, repo, keep=2)
    versions = sorted(p.name for p in (repo / "xgb").iterdir())
    assert versions == ["2", "3", "config.pbtxt", "configs"]  # no staging folder left behind
    assert retired.read_text() == "# kept\n" and any("left in place: config.pbtxt of xgb" in line for line in said)
    assert latest_version(repo / "xgb").name == "3"


def test_tampered_artifact_fails_loudly(trained, tmp_path):
    version = tmp_path / "1"
    shutil.copytree(trained.repository / "blend" / "1", version)
    load_step(Model.BLEND, version)  # intact: loads
    (version / "blend.json").write_text('{"weights": [9, 9, 9], "bias": 0}')
    with pytest.raises(manifest.ManifestError, match="checksum mismatch"):
        load_step(Model.BLEND, version)
    (version / "blend.json").unlink()
    with pytest.raises(manifest.ManifestError, match="missing artifact"):
        load_step(Model.BLEND, version)
    with pytest.raises(manifest.ManifestError, match="written for model"):
        load_step(Model.XGB, version)


def test_pipeline_scores_are_probabilities(pipeline):
    from tests.helpers import fresh_rows

    dense, cats = fresh_rows(500, seed=9)
    out = pipeline.score(dense, cats)
    for name, values in out.items():
        assert values.shape == (len(dense), 1), name
        assert ((values > 0) & (values < 1)).all(), name


def test_training_report_has_every_model(trained):
    assert set(trained.report["test"]) == {"xgb", "dlrm_torch", "dlrm_tf", "blend"}
    assert trained.report["test"]["xgb"]["auc"] > 0.55


def test_a_release_kept_to_roll_back_to_keeps_its_steps_when_an_export_stopped_part_way(trained, tmp_path):
    """An export that stopped after some steps leaves their versions with no release naming them; the next
    export's pruning by count must still keep the steps of the release before (the one to roll back to)."""
    repo = tmp_path / "repo"
    shutil.copytree(trained.repository, repo)
    shutil.copytree(repo / "features" / "1", repo / "features" / "2")  # what a stopped export left
    shutil.copytree(repo / "xgb" / "1", repo / "xgb" / "2")
    logged = []
    export_repository(TrainedArtifacts.under(trained.workdir), repo, keep=2, log=logged.append)
    steps = json.loads((repo / "ranker" / "1" / "release.json").read_text())["versions"]
    for model, version in steps.items():
        assert (repo / model / str(version)).is_dir(), (model, version)
    assert any("kept features 1: a step of release 1, kept to roll back to" in line for line in logged), logged

