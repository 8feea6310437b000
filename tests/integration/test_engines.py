"""A release at the DLRM seed's widths (small vocabularies keep it quick) served in the native layout by
a real tritonserver: each DLRM step records the engine its export measured fastest here, the server
scores with it (its log says so) and answers as the in-process pipeline on the same engines does; a
recorded engine that cannot run here is said loudly, or refused with --require-engine."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from clients.triton import RankerClient
from ensemble import schema
from ensemble.base import model_size
from ensemble.models import engines
from ensemble.models.dlrm import DLRMConfig
from ensemble.models.xgb import XGBConfig
from ensemble.models import manifest
from ensemble.repository.export import TrainedArtifacts, export_repository
from ensemble.schema import Model
from ensemble.scoring.pipeline import Pipeline, release_versions
from ensemble.operate.server import ServerError, ServerOptions, TritonServer
from ensemble.base.machine import free_port
from ensemble.features import transforms
from tests.helpers import ADMIN_KEY


@pytest.fixture(scope="module")
def seed_release(trained, tmp_path_factory):
    from ensemble.runs import training

    root = tmp_path_factory.mktemp("seed-size")
    size = model_size.SIZES["seed"]
    config = training.TrainConfig(xgb=XGBConfig(rounds=20, max_depth=6),
                                  dlrm=DLRMConfig(epochs=1, embedding_dim=size.embedding_dim,
                                                  bottom_mlp=size.bottom_mlp, top_mlp=size.top_mlp))
    training.train_all(trained.train, trained.valid, trained.test, root / "work", config, log=lambda _: None)
    repository = root / "model_repository"
    export_repository(TrainedArtifacts.under(root / "work"), repository)
    return root, repository


def _server(repository, log_file, **options) -> TritonServer:
    return TritonServer(ServerOptions(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                      log_file=log_file, admin_key=ADMIN_KEY, startup_timeout=240, **options))


def _engine_metrics(server) -> dict:
    """The ranker's engine series on the metrics endpoint: (family, step) -> (engine, recorded, value) for
    ensemble_engine_info (whose former label `declared` repeats `recorded` for one release), the value for
    ensemble_engine_substituted (which its former name, ensemble_engine_undeclared, repeats for one release)."""
    import urllib.request

    from ensemble.operate.monitoring import parse_exposition

    with urllib.request.urlopen(f"http://{server.metrics_url.split('//')[-1]}", timeout=10) as answer:
        families = parse_exposition(answer.read().decode())
    found = {}
    for labels, value in families.get("ensemble_engine_info", []):
        assert labels["model"] == "ranker"
        assert labels["declared"] == labels["recorded"], labels
        found["ensemble_engine_info", labels["step"]] = (labels["engine"], labels["recorded"], value)
    for labels, value in families.get("ensemble_engine_substituted", []):
        found["ensemble_engine_substituted", labels["step"]] = value
    former = {labels["step"]: value for labels, value in families.get("ensemble_engine_undeclared", [])}
    assert former == {step: v for (family, step), v in found.items() if family == "ensemble_engine_substituted"}
    return found


def _rows(trained, n: int = 100):
    frame = trained.test.head(n)
    return transforms.dense_array(frame), transforms.encode_categorical(frame)


def test_each_dlrm_step_records_the_engine_its_measurement_picked(seed_release):
    _, repository = seed_release
    folders = release_versions(repository)
    for step in engines.STEPS:
        recorded = engines.Recorded.read(folders[Model(step)])
        record = recorded.record
        assert record["machine"] == engines.cpu() and record["step"] == step
        times = record["us_per_row"]
        # every eligible engine measured at every point; the recorded one is what the rule picks from them
        assert times and all(set(points) == {str(r) for r in engines.ROWS} for points in times.values())
        as_ints = {e: {int(r): t for r, t in points.items()} for e, points in times.items()}
        assert engines.pick(as_ints, list(times))[0] == recorded.name
        parity = record["parity"]["max_abs_diff_vs_framework_fp32"]
        if engines._runtime() is not None:  # OpenVINO built: f32 always, bf16 where the CPU has it, int8 (held out)
            assert "openvino-f32" in parity and ("openvino-bf16" in parity) == engines.has_bf16()
            assert "openvino-int8" in parity
        held = record["parity"]["held_out"]  # the training run's test rows judged the reduced precisions
        assert held["rows"] > 1000
        for name in parity:  # measured exactly when eligible
            eligible = (abs(held[name]["auc"] - held["auc_framework_fp32"]) <= engines.AUC_TOLERANCE
                        if name.endswith(("bf16", "int8")) else parity[name] <= engines.F32_TOLERANCE)
            assert (name in times) == eligible, name
    lines = engines.describe(folders)
    assert len(lines) == 2 and all(" chosen on " in line and "measured: " in line for line in lines)


def test_the_native_layout_scores_with_the_recorded_engines(trained, seed_release):
    root, repository = seed_release
    folders = release_versions(repository)
    names = {step: engines.Recorded.read(folders[Model(step)]).name for step in engines.STEPS}
    dense, categorical = _rows(trained)
    pipeline = Pipeline.from_repository(repository)
    expected = pipeline.score(dense, categorical)
    server = _server(repository, root / "native.log")
    server.start()
    try:
        got = RankerClient(server.http_url, "http").score(dense, categorical, all_scores=True)
        metrics = _engine_metrics(server)
    finally:
        server.stop()
    for step, name in names.items():
        assert metrics["ensemble_engine_info", step] == (name, name, 1.0)
        assert metrics["ensemble_engine_substituted", step] == 0.0
    log = (root / "native.log").read_text(errors="replace")
    for step, name in names.items():
        assert f"ensemble: {step} scores with {name} (recorded" in log, log[-3000:]
    assert "SUBSTITUTED" not in log
    for tensor in schema.RANKER_OUTPUTS:
        gap = np.abs(np.asarray(got[tensor.name]).reshape(-1) - expected[tensor.name].reshape(-1)).max()
        assert gap <= 1e-5, (tensor.name, gap)


def _record_unknown_precision(repository):
    """A release whose torch DLRM records OpenVINO in a precision this install does not know (as a release
    written by a newer version would), its manifest written again as an operator's tool would."""
    folder = release_versions(repository)[Model.DLRM_TORCH]
    path = folder / engines.ENGINE_FILE
    record = json.loads(path.read_text())
    record.update(engine="openvino", precision="int4")
    path.write_text(json.dumps(record))
    manifest.write(folder, Model.DLRM_TORCH)


def test_an_engine_that_cannot_run_here_is_said_loudly_and_refused_when_required(trained, seed_release, tmp_path):
    _, source = seed_release
    repository = tmp_path / "repo"
    shutil.copytree(source, repository)
    _record_unknown_precision(repository)
    server = _server(repository, tmp_path / "loud.log")
    server.start()
    try:
        dense, categorical = _rows(trained, 8)
        scores = RankerClient(server.http_url, "http").score(dense, categorical)
        assert np.isfinite(np.asarray(scores)).all()
        metrics = _engine_metrics(server)
    finally:
        server.stop()
    assert metrics["ensemble_engine_substituted", "dlrm_torch"] == 1.0
    assert metrics["ensemble_engine_info", "dlrm_torch"][1:] == ("openvino-int4", 1.0)
    assert metrics["ensemble_engine_substituted", "dlrm_tf"] == 0.0
    log = (tmp_path / "loud.log").read_text(errors="replace")
    assert "dlrm_torch: the recorded engine openvino-int4 cannot score here" in log
    assert "ensemble: dlrm_torch scores with" in log and "(SUBSTITUTED: this install does not know the precision" in log
    strict = _server(repository, tmp_path / "strict.log", require_engine=True)
    with pytest.raises(ServerError):
        strict.start()
    strict.stop()
    assert "ENSEMBLE_REQUIRE_ENGINE=1: refusing to load" in (tmp_path / "strict.log").read_text(errors="replace")
