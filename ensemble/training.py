"""Fit the features and train the three models and the blender; report held-out accuracy.

Artifacts land in a work folder (``<workdir>/workflow``, ``<workdir>/models/<model>/``) from
which :mod:`ensemble.repository.export` writes the model repository.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from ensemble import schema
from ensemble.features import transforms
from ensemble.models import metrics
from ensemble.repository.export import TrainedArtifacts
from ensemble.models import dlrm_tf, dlrm_torch, xgb
from ensemble.models.blend import Blender
from ensemble.models.dlrm import DLRMConfig


@dataclass(frozen=True)
class TrainConfig:
    """Everything training needs besides the data."""

    freq_threshold: int = 3
    xgb: xgb.XGBConfig = field(default_factory=xgb.XGBConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)
    device: str = "cpu"  # "cpu" or "gpu"; see resolve_device


def resolve_device(device: str) -> str:
    """``auto`` -> ``gpu`` when an NVIDIA GPU is visible, else ``cpu`` (see :mod:`ensemble.device`)."""
    from ensemble.device import resolve_device as resolve

    return resolve(device).value


@dataclass(frozen=True)
class Tensors:
    dense: np.ndarray  # [B x 13] float32
    ids: np.ndarray  # [B x 26] int64
    labels: np.ndarray  # [B] int8


def _to_tensors(workflow, frame: pd.DataFrame, device: str = "cpu") -> Tensors:
    dense, ids = transforms.nvtabular_transform(workflow, frame, device)
    return Tensors(dense.astype(np.float32), ids, frame[schema.LABEL].to_numpy(np.int8))


def train_all(train: pd.DataFrame, valid: pd.DataFrame, test: pd.DataFrame, workdir: str | Path,
              config: TrainConfig = TrainConfig(), log: Callable[[str], None] = print) -> dict:
    """Fit the workflow on ``train``, train every model, fit the blend on ``valid``.

    Returns:
        The report: per model (and the blend) AUC and log loss on ``test``, timings, sizes.
    """
    workdir = Path(workdir)
    artifacts = TrainedArtifacts.under(workdir)
    timings: dict[str, float] = {}

    start = time.perf_counter()
    transforms.fit_workflow(train, artifacts.workflow_dir, config.freq_threshold, config.device)
    workflow = transforms.load_workflow(artifacts.workflow_dir)
    splits = {name: _to_tensors(workflow, frame, config.device)
              for name, frame in (("train", train), ("valid", valid), ("test", test))}
    cardinalities = transforms.LeanTransform.load(artifacts.workflow_dir).cardinalities
    timings["features"] = time.perf_counter() - start
    log(f"features fitted in {timings['features']:.1f}s; vocabulary sizes {list(cardinalities)}")

    tr, va, te = splits["train"], splits["valid"], splits["test"]
    scores: dict[str, dict[str, np.ndarray]] = {"valid": {}, "test": {}}

    start = time.perf_counter()
    booster = xgb.train(config.xgb, xgb.design_matrix(tr.dense, tr.ids), tr.labels,
                        xgb.design_matrix(va.dense, va.ids), va.labels, config.device)
    (artifacts.models_dir / "xgb").mkdir(parents=True, exist_ok=True)
    xgb.save(booster, artifacts.models_dir / "xgb")
    for split, t in (("valid", va), ("test", te)):
        scores[split]["xgb"] = booster.inplace_predict(xgb.design_matrix(t.dense, t.ids))
    timings["xgb"] = time.perf_counter() - start
    log(f"xgb: {booster.num_boosted_rounds()} trees in {timings['xgb']:.1f}s")

    dlrm_config = replace(config.dlrm, cardinalities=cardinalities)
    for name, module in (("dlrm_torch", dlrm_torch), ("dlrm_tf", dlrm_tf)):
        start = time.perf_counter()
        model = module.train(dlrm_config, (tr.dense, tr.ids, tr.labels), (va.dense, va.ids, va.labels),
                             config.device, log)
        (artifacts.models_dir / name).mkdir(parents=True, exist_ok=True)
        module.save(model, artifacts.models_dir / name)
        for split, t in (("valid", va), ("test", te)):
            scores[split][name] = module.predict(model, t.dense, t.ids)
        timings[name] = time.perf_counter() - start
        log(f"{name}: trained in {timings[name]:.1f}s")

    order = [m.value for m in schema.MODEL_SCORES]  # the blend step's input order
    blender = Blender.fit(np.stack([scores["valid"][m] for m in order], axis=1), va.labels)
    (artifacts.models_dir / "blend").mkdir(parents=True, exist_ok=True)
    blender.save(artifacts.models_dir / "blend")
    scores["test"]["blend"] = blender(*(scores["test"][m].reshape(-1, 1) for m in order)).ravel()

    report = {
        "rows": {"train": len(train), "valid": len(valid), "test": len(test)},
        "test": {name: {"auc": metrics.auc(te.labels, s), "logloss": metrics.log_loss(te.labels, s)}
                 for name, s in scores["test"].items()},
        "blend_weights": dict(zip(order, blender.weights)),
        "seconds": timings,
        "vocabulary_sizes": list(cardinalities),
        "config": asdict(config),
    }
    (workdir / "train_report.json").write_text(json.dumps(report, indent=1, default=str))
    return report
