"""At export, a row store DLRM step's release: its tables written (:mod:`ensemble.tables.export`), then its
MLPs' engine chosen by measurement (:mod:`ensemble.tables.mlp`), both recorded in the version folder."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ensemble.tables import export
from ensemble.tables.files import TablesManifest
from ensemble.tables.mlp import MlpWeights, OpenVinoMlp, choose, write_int8, write_openvino

LOG = logging.getLogger(__name__)
OPENVINO_DIR = "openvino"


def _held_out(split: str, rows: int, weights: MlpWeights):
    from ensemble.models import engines

    return engines._held_out_rows(split, rows, weights.n_dense, weights.n_tables)


def pooled_rows(version_dir: Path, manifest: TablesManifest, ids: np.ndarray) -> np.ndarray:
    """Rows of ``ids`` [B x F] as the server reads them: float32 [B x F*dim]."""
    from ensemble.tables.serving import Settings, open_store
    from ensemble.native import _tables

    settings = Settings(0, "none", "uring" if _tables.has_uring() else "pread", 32, 0.0)
    store = open_store(version_dir, manifest, 0, settings)
    out = np.empty((len(ids), len(manifest.tables), manifest.dim), np.float32)
    for start in range(0, len(ids), 4096):
        store.gather(np.ascontiguousarray(ids[start:start + 4096], np.int64), out[start:start + 4096])
    return out.reshape(len(ids), -1)


def finish(staging: Path, step: str, budget: float | None = None, log=LOG.info) -> None:
    """Write the step's tables and choose its MLPs' engine (``engine.json``)."""
    from ensemble.models import engines, metrics

    staging = Path(staging)
    weights = MlpWeights.load(staging)
    manifest = export.export_tables(staging, step, _held_out("test", engines.HELD_OUT_ROWS, weights), log)
    candidates = {"c": weights.c_engine()}
    aucs: dict[str, float] = {}
    test = _held_out("test", engines.HELD_OUT_ROWS, weights)
    width = weights.n_tables * weights.dim
    try:
        framework = staging / ("model.pt" if step == "dlrm_torch" else "model.tflite")
        ir = write_openvino(framework, staging / OPENVINO_DIR / "model.xml", "torch" if step == "dlrm_torch" else "tf",
                            weights.n_dense, width)
        candidates["openvino-f32"] = OpenVinoMlp(ir, "f32", weights.n_tables, weights.dim, weights.n_dense)
        valid = _held_out("valid", engines.CALIBRATION_ROWS, weights)
        if valid is not None:
            int8 = write_int8(ir, staging / OPENVINO_DIR / "model-int8.xml",
                              (valid[0], pooled_rows(staging, manifest, valid[1])))
            candidates["openvino-int8"] = OpenVinoMlp(int8, "int8", weights.n_tables, weights.dim, weights.n_dense)
    except Exception as exc:  # noqa: BLE001 - OpenVINO missing or failing: the C pass alone is measured
        LOG.warning("%s: no OpenVINO engine for the MLPs (%s)", step, exc)
    if test is not None:
        pooled = pooled_rows(staging, manifest, test[1])
        for name, engine in candidates.items():
            aucs[name] = metrics.auc(test[2], engine(test[0], pooled))
    record = choose(staging, step, weights, candidates, aucs,
                     budget or float(os.environ.get(engines.BUDGET_ENV) or 0.02))
    log(f"{step}: MLPs on {record['engine']}-{record['precision']} (held-out AUC {aucs or 'not measured'})")


def describe(folder: Path) -> str:
    manifest = TablesManifest.load(folder)
    return (f"{len(manifest.tables)} tables, {sum(t.rows for t in manifest.tables):,} rows in {manifest.format}, "
            f"{manifest.disk_bytes() / 1e9:.2f} GB ({sum(1 for t in manifest.tables if t.delta)} with a delta)")

