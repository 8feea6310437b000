"""`ensemble check --target gpu`: passes on a freshly exported repository and fails, saying why,
on deliberately broken ones. The Treelite of the pinned release is installed on first use into
~/.cache/ensemble (or $ENSEMBLE_CACHE_DIR) from the package index; later runs are offline."""

import re
import shutil
from pathlib import Path

import pytest

from ensemble import cli
from ensemble.repository import configs
from ensemble.models import triton_releases
from ensemble.check.compat import CheckOptions, run_check


@pytest.fixture()
def repo(trained, tmp_path) -> Path:
    """A private copy of the freshly exported repository, safe to break."""
    copy = tmp_path / "model_repository"
    shutil.copytree(trained.repository, copy)
    return copy


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def _failures(repository: Path, release: triton_releases.TritonRelease = triton_releases.PINNED) -> list[str]:
    return [f.line() for f in run_check(CheckOptions(repository, "gpu", release)) if not f.ok]


def test_fresh_repository_passes(trained):
    findings = run_check(CheckOptions(trained.repository))
    assert [f.line() for f in findings if not f.ok] == []
    checked = {(f.check, f.subject) for f in findings}
    assert {("fil", "xgb"), ("artifacts", "xgb"), ("artifacts", "dlrm_torch"), ("artifacts", "dlrm_tf"),
            ("backends", "dlrm_tf"), ("agreement", "features")} <= checked
    tree = next(f for f in findings if (f.check, f.subject) == ("artifacts", "xgb"))
    assert f"Treelite {triton_releases.PINNED.treelite}" in tree.message
    saved = next(f for f in findings if (f.check, f.subject) == ("artifacts", "dlrm_tf"))
    assert re.search(r"TensorFlow \d+\.\d+\.\d+'s session-based loader runs it", saved.message), saved.message


def test_cli_exit_codes(trained, repo, capsys):
    assert cli.main(["check", "--repository", str(trained.repository)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\d+ passed, 0 failed$", out, re.M) and "not verified here" in out
    _edit(repo / "dlrm_tf" / configs.GPU_CONFIG_FILE, 'platform: "tensorflow_savedmodel"', 'backend: "tensorflw"')
    assert cli.main(["check", "--repository", str(repo)]) == 1
    assert "FAIL  backends   dlrm_tf     backend 'tensorflw' does not exist" in capsys.readouterr().out


def test_cpu_target_checks_both_cpu_layouts_of_the_ranker(trained, repo):
    findings = run_check(CheckOptions(trained.repository, target="cpu"))
    assert [(f.check, f.ok) for f in findings] == [("configs", True), ("backends", True)] * 2, findings
    _edit(repo / "ranker" / configs.config_file(configs.Layout.NATIVE), f'backend: "{configs.NATIVE_BACKEND}"',
          'backend: "python"')
    failed = [f.line() for f in run_check(CheckOptions(repo, target="cpu")) if not f.ok]
    assert failed == ["FAIL  backends   ranker      backend 'python' does not exist in the native layout (it has: native)"]


def test_wrong_backend_name(repo):
    _edit(repo / "xgb" / configs.GPU_CONFIG_FILE, 'backend: "fil"', 'backend: "forest"')
    failures = _failures(repo)
    assert any("backends" in f and "backend 'forest' does not exist in nvcr.io/nvidia/tritonserver:25.02-py3" in f
               for f in failures), failures


def test_backend_missing_from_another_release(trained):
    """The TensorFlow backend left the container in 25.03."""
    failures = _failures(trained.repository, triton_releases.RELEASES["25.03"])
    assert any("dlrm_tf" in f and "backend 'tensorflow' does not exist in nvcr.io/nvidia/tritonserver:25.03-py3" in f
               for f in failures), failures


def test_wrong_tensor_dtype(repo):
    path = repo / "dlrm_torch" / configs.GPU_CONFIG_FILE
    _edit(path, 'name: "category_ids__1"\n  data_type: TYPE_INT64', 'name: "category_ids__1"\n  data_type: TYPE_INT32')
    failures = _failures(repo)
    assert any("agreement" in f and "dlrm_torch" in f and
               "input 'category_ids': GPU 'category_ids__1' is TYPE_INT32 [26], the step's is TYPE_INT64 [26]" in f
               for f in failures), failures


def test_wrong_output_shape_in_savedmodel_config(repo):
    _edit(repo / "dlrm_tf" / configs.GPU_CONFIG_FILE, 'name: "output_0"\n  data_type: TYPE_FP32\n  dims: 1',
          'name: "output_0"\n  data_type: TYPE_FP32\n  dims: 2')
    failures = _failures(repo)
    assert any("artifacts" in f and "dlrm_tf" in f and "output 'output_0': signature has float32 [None, 1]" in f
               for f in failures), failures


def test_xgboost_file_the_pinned_treelite_cannot_read(repo):
    """FIL loading XGBoost 3.x JSON directly: Treelite 4.4.1 cannot parse it (fil_backend #311/#378)."""
    _edit(repo / "xgb" / configs.GPU_CONFIG_FILE, '"treelite_checkpoint"', '"xgboost_json"')
    failures = _failures(repo)
    assert any("artifacts" in f and "xgboost.json cannot be read by Treelite 4.4.1" in f and
               "could not be parsed as XGBoost model" in f for f in failures), failures


def test_unreadable_checkpoint(repo):
    """A checkpoint the pinned Treelite cannot read (manifest rewritten so only Treelite can object)."""
    from ensemble.models import manifest
    from ensemble.schema import Model

    version = repo / "xgb" / "1"
    (version / "checkpoint.tl").write_bytes(b"not a treelite checkpoint" * 10)
    manifest.write(version, Model.XGB)
    failures = _failures(repo)
    assert any("checkpoint.tl cannot be read by Treelite 4.4.1" in f for f in failures), failures


def test_fil_parameter_invalid_for_release(repo):
    _edit(repo / "xgb" / configs.GPU_CONFIG_FILE, 'key: "predict_proba"', 'key: "layout"')
    failures = _failures(repo)
    assert any("fil" in f and "parameter 'layout' is not read by the FIL backend of 25.02" in f
               for f in failures), failures


def test_tampered_artifact_and_missing_config(repo):
    (repo / "dlrm_torch" / "1" / "model.pt").write_bytes(b"\0" * 64)
    (repo / "blend" / configs.GPU_CONFIG_FILE).unlink()
    failures = _failures(repo)
    assert any("dlrm_torch" in f and "checksum mismatch for model.pt" in f for f in failures), failures
    assert any("blend" in f and "configs/gpu.pbtxt is missing" in f for f in failures), failures


def _keras_in_tf_module(trained, path: Path) -> None:
    """Write the Keras DLRM the way tensorflow#72963 does: a tf.Module holding the Keras model,
    saved with tf.saved_model.save and an explicit signature. TensorFlow 2's loader runs it; the
    session loader (Triton's TensorFlow backend) fails with FAILED_PRECONDITION on every run."""
    import tensorflow as tf

    from ensemble import schema
    from ensemble.features.transforms import LeanTransform
    from ensemble.models import dlrm_tf
    from ensemble.models.dlrm import DLRMConfig

    cardinalities = LeanTransform.load(trained.repository / "features" / "1" / "workflow").cardinalities
    model = dlrm_tf.build(DLRMConfig(embedding_dim=8, bottom_mlp=(32,), top_mlp=(32,), cardinalities=cardinalities))

    class Wrapped(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        @tf.function(input_signature=[
            tf.TensorSpec((None, schema.N_DENSE), tf.float32, name=schema.DENSE_FEATURES.name),
            tf.TensorSpec((None, schema.N_CATEGORICAL), tf.int64, name=schema.CATEGORY_IDS.name)])
        def serve(self, dense_features, category_ids):
            return {dlrm_tf.SIGNATURE_OUTPUT: self.model([dense_features, category_ids])}

    wrapped = Wrapped()
    shutil.rmtree(path)
    tf.saved_model.save(wrapped, str(path), signatures={"serving_default": wrapped.serve})


def test_savedmodel_the_session_loader_cannot_run(trained, repo):
    """server#7456 / tensorflow#72963: loads, signature right, fails at the first run."""
    from ensemble.models import manifest
    from ensemble.schema import Model

    version = repo / "dlrm_tf" / "1"
    _keras_in_tf_module(trained, version / "model.savedmodel")
    manifest.write(version, Model.DLRM_TF)  # only the loaders may object
    failures = _failures(repo)
    [failure] = [f for f in failures if "dlrm_tf" in f]
    assert "artifacts" in failure and "session-based loader" in failure, failures
    assert "Could not find variable" in failure, failure


def test_session_loader_outputs_are_compared(trained):
    """The session run must reproduce TensorFlow 2's outputs, not merely finish."""
    import numpy as np

    from ensemble.check.loading import session_problems

    model_dir = trained.repository / "dlrm_tf" / "1" / "model.savedmodel"
    rng = np.random.default_rng(3)
    feeds = {"dense_features": rng.normal(size=(4, 13)).astype(np.float32),
             "category_ids": np.ones((4, 26), np.int64)}
    problems = session_problems(model_dir, feeds, {"output_0": np.full((4, 1), 2.0, np.float32)})
    assert len(problems) == 1 and "differs from TensorFlow 2's loader" in problems[0], problems
