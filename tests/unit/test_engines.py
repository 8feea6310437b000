"""The engine rule and the recorded engine at load, on small real DLRMs (TorchScript and TFLite)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ensemble.models import dlrm_tf, dlrm_torch, engines
from ensemble.models.dlrm import DLRMConfig

CONFIG = DLRMConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,), cardinalities=(7, 5, 9))


@pytest.fixture(scope="module")
def torch_step(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dlrm_torch")
    dlrm_torch.save(dlrm_torch.build(CONFIG).eval(), folder)
    engines.finish(folder, "dlrm_torch", lambda: dlrm_torch.TorchScorer(folder))
    return folder


def _rows(n: int = 50, seed: int = 3):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 13)).astype(np.float32),
            np.stack([rng.integers(0, c, n) for c in CONFIG.cardinalities], axis=1).astype(np.int64))


def test_the_rule_keeps_the_engine_least_slow_at_its_slowest_point():
    times = {"c": {1: 4.0, 16: 1.0, 100: 1.0, 1000: 1.0},
             "openvino-f32": {1: 8.0, 16: 0.5, 100: 0.4, 1000: 0.4},
             "openvino-bf16": {1: 5.0, 16: 0.6, 100: 0.5, 1000: 0.5}}
    chosen, worst = engines.pick(times, list(times))
    assert worst == {"c": 2.5, "openvino-f32": 2.0, "openvino-bf16": 1.25} and chosen == "openvino-bf16"
    assert engines.pick({"a": {r: 1.0 for r in engines.ROWS}, "b": {r: 1.0 for r in engines.ROWS}}, ["b", "a"])[0] == "b"


def test_export_records_a_measured_engine_that_serves_the_framework_s_scores(torch_step):
    recorded = engines.Recorded.read(torch_step)
    record = recorded.record
    assert record["step"] == "dlrm_torch" and record["machine"]["model"] == engines.cpu()["model"]
    assert recorded.name in record["us_per_row"] and set(map(int, record["us_per_row"][recorded.name])) == set(engines.ROWS)
    scorer = dlrm_torch.TorchScorer(torch_step)
    assert scorer.engine.startswith(f"{recorded.name} (recorded")
    dense, ids = _rows()
    assert np.abs(scorer(dense, ids) - scorer.framework(dense, ids)).max() <= (
        engines.BF16_TOLERANCE if recorded.precision == "bf16" else engines.F32_TOLERANCE)


@pytest.mark.skipif(engines._runtime() is None, reason="OpenVINO's C runtime is not built into this install")
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_the_openvino_engine_scores_as_the_framework_and_refuses_ids_outside_the_tables(torch_step, precision):
    if precision == "bf16" and not engines.has_bf16():
        pytest.skip("this CPU has no bfloat16 instructions")
    engine = engines.OpenVinoDLRM(torch_step, precision, np.array(CONFIG.cardinalities), 13)
    dense, ids = _rows()
    framework = dlrm_torch.TorchScorer(torch_step).framework(dense, ids)
    bound = engines.BF16_TOLERANCE if precision == "bf16" else engines.F32_TOLERANCE
    assert np.abs(engine(dense, ids) - framework).max() <= bound
    # each row alone, and the rows split in two: every row scores the same
    halves = np.concatenate([engine(dense[:17], ids[:17]), engine(dense[17:], ids[17:])])
    assert np.array_equal(halves, engine(dense, ids))
    for bad in (-1, CONFIG.cardinalities[2]):
        wrong = ids.copy()
        wrong[4, 2] = bad
        with pytest.raises(ValueError, match=f"row 4, column 2: id {bad} is outside its embedding table"):
            engine(dense, wrong)
    with pytest.raises(ValueError, match="float32"):
        engine.native(dense[:, :5].copy(), ids, np.empty(len(ids), np.float32))


def _record_engine(folder, **fields):
    path = folder / engines.ENGINE_FILE
    record = json.loads(path.read_text())
    record.update(fields)
    path.write_text(json.dumps(record))


def test_a_recorded_engine_that_cannot_run_is_said_loudly_or_refused(torch_step, tmp_path, monkeypatch, capsys):
    import shutil

    folder = tmp_path / "step"
    shutil.copytree(torch_step, folder)
    _record_engine(folder, engine="openvino", precision="int4")
    engines.SUBSTITUTED.clear()
    scorer = dlrm_torch.TorchScorer(folder)
    assert "SUBSTITUTED: this install does not know the precision 'int4'" in scorer.engine
    assert "dlrm_torch" in engines.SUBSTITUTED
    assert "ensemble: dlrm_torch scores with c (SUBSTITUTED" in capsys.readouterr().err
    dense, ids = _rows()
    assert np.abs(scorer(dense, ids) - scorer.framework(dense, ids)).max() <= engines.F32_TOLERANCE
    monkeypatch.setenv(engines.REQUIRE_ENV, "1")
    with pytest.raises(engines.EngineUnavailable, match="recorded engine openvino-int4 cannot score here"):
        dlrm_torch.TorchScorer(folder)


def test_a_release_without_engine_json_keeps_the_checked_c_pass(torch_step, tmp_path):
    import shutil

    folder = tmp_path / "old"
    shutil.copytree(torch_step, folder)
    (folder / engines.ENGINE_FILE).unlink()
    scorer = dlrm_torch.TorchScorer(folder)
    assert scorer.engine.startswith("c (no engine recorded") and scorer.kernel is scorer.kernel_c


def test_the_keras_dlrm_records_and_loads_its_engine(tmp_path):
    model = dlrm_tf.build(CONFIG)
    dlrm_tf.save(model, tmp_path)
    dlrm_tf.write_tflite(tmp_path)
    engines.finish(tmp_path, "dlrm_tf", lambda: dlrm_tf.TFScorer(tmp_path))
    recorded = engines.Recorded.read(tmp_path)
    scorer = dlrm_tf.TFScorer(tmp_path)
    assert scorer.engine.startswith(f"{recorded.name} (recorded")
    dense, ids = _rows()
    assert np.abs(scorer(dense, ids) - scorer.framework(dense, ids)).max() <= engines.BF16_TOLERANCE


def test_choose_by_hand_checks_the_name(torch_step, tmp_path):
    import shutil

    from ensemble.models import manifest
    from ensemble.schema import Model

    folder = tmp_path / "by-hand"
    shutil.copytree(torch_step, folder)
    manifest.write(folder, Model.DLRM_TORCH)
    folders = {Model.DLRM_TORCH: folder}
    for wrong in ("openvino", "c-f32", "tensorrt", "openvino-int4"):
        with pytest.raises(ValueError, match="one of c, openvino-f32"):
            engines.set_engine(folders, "dlrm_torch", wrong)
    record = engines.set_engine(folders, "dlrm_torch", "c")
    assert record["engine"] == "c" and "by hand" in record["rule"]
    manifest.verify(folder, Model.DLRM_TORCH)  # written again: the folder still loads
    assert dlrm_torch.TorchScorer(folder).engine == "c (recorded)"


def _held_out(folder, step_dir, rows=4000, seed=5):
    """Held-out rows whose labels the framework's own scores rank well (so AUC means something)."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(rows, 13)).astype(np.float32)
    ids = np.stack([rng.integers(0, c, rows) for c in CONFIG.cardinalities], axis=1).astype(np.int64)
    scores = dlrm_torch.TorchScorer(step_dir).framework(dense, ids).reshape(-1)
    labels = (scores + rng.normal(scale=scores.std(), size=rows) > np.median(scores)).astype(np.int8)
    for split in ("valid", "test"):
        engines.write_held_out(folder, split, iter([(dense, ids, labels)]), rows)


@pytest.mark.skipif(engines._runtime() is None, reason="OpenVINO's C runtime is not built into this install")
def test_with_held_out_rows_int8_is_quantized_and_the_reduced_precisions_judged_by_test_auc(torch_step, tmp_path):
    import shutil

    folder = tmp_path / "step"
    shutil.copytree(torch_step, folder)
    (folder / engines.ENGINE_FILE).unlink()
    _held_out(tmp_path / "held_out", folder)
    with engines.held_out(tmp_path / "held_out"):
        engines.finish(folder, "dlrm_torch", lambda: dlrm_torch.TorchScorer(folder))
    assert (folder / engines.OPENVINO_DIR / engines.OPENVINO_INT8).is_file()
    record = engines.Recorded.read(folder).record
    held = record["parity"]["held_out"]
    assert held["rows"] == 4000 and held["auc_framework_fp32"] > 0.7
    for name in record["parity"]["max_abs_diff_vs_framework_fp32"]:
        reduced = name.endswith(("bf16", "int8"))
        eligible = (abs(held[name]["auc"] - held["auc_framework_fp32"]) <= engines.AUC_TOLERANCE if reduced
                    else record["parity"]["max_abs_diff_vs_framework_fp32"][name] <= engines.F32_TOLERANCE)
        assert (name in record["us_per_row"]) == eligible, name
    assert "openvino-int8" in record["parity"]["max_abs_diff_vs_framework_fp32"]
    engine = engines.OpenVinoDLRM(folder, "int8", np.array(CONFIG.cardinalities), 13)
    dense, ids = _rows()
    assert np.abs(engine(dense, ids) - dlrm_torch.TorchScorer(folder).framework(dense, ids)).max() \
        <= engines.INT8_LOAD_TOLERANCE


def test_int8_leaves_the_interaction_and_the_layer_reading_it_alone(torch_step):
    import openvino as ov

    model = ov.Core().read_model(str(torch_step / engines.OPENVINO_DIR / engines.OPENVINO_MODEL))
    ignored = engines._int8_ignored(model)
    matmuls = [op for op in model.get_ops() if op.get_type_name() == "MatMul"]
    # the pairwise products and the top MLP's first layer (it reads the concatenation); the other layers quantized
    assert len(ignored) == 2 and len(matmuls) > len(ignored)
    assert any("bmm" in name for name in ignored)


def test_without_held_out_rows_int8_is_not_measured(torch_step):
    record = engines.Recorded.read(torch_step).record
    assert "openvino-int8" not in record["parity"]["max_abs_diff_vs_framework_fp32"]
    assert record["parity"]["held_out"].startswith("none at hand")


def test_openvino_is_imported_with_its_usage_telemetry_off():
    """The converter and nncf fall back to their telemetry stubs: an export sends nothing to Google
    Analytics (checked in a fresh interpreter, where nothing imported the telemetry package first)."""
    import subprocess
    import sys

    probe = ("from ensemble.models.engines import openvino_module\n"
             "openvino_module()\n"
             "import openvino.tools.ovc.convert_impl as convert\n"
             "import nncf.telemetry.wrapper as nncf_telemetry\n"
             "print(convert.tm.__name__, type(nncf_telemetry.telemetry).__name__)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "CI": "", "PYTEST_CURRENT_TEST": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    converter, nncf_kind = out.stdout.split()[-2:]
    assert converter == "openvino.tools.ovc.telemetry_stub", out.stdout
    assert nncf_kind != "NNCFTelemetry", out.stdout
