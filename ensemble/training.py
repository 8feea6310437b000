"""Fit the features and train the three models and the blender; report held-out accuracy.

Artifacts land in a work folder (``<workdir>/workflow``, ``<workdir>/models/<model>/``) from
which :mod:`ensemble.repository.export` writes the model repository.

Training can run in stages on one work folder (``TrainConfig.models``): the GPU deployment trains
xgb and the torch DLRM in one image and the Keras DLRM in another, because the CUDA builds of
torch 2.13 (CUDA 13 libraries) and TensorFlow 2.21 (CUDA 12 libraries) do not belong in one
process (docs/gpu-deployment.md). Each stage saves its models' validation and test scores under
``<workdir>/scores``; the blend is fitted, and the report written, once all three are there.
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
    # The models this run trains (a stage; default all). Names from schema.MODEL_SCORES.
    models: tuple[str, ...] = tuple(m.value for m in schema.MODEL_SCORES)
    # Reuse the workflow an earlier stage fitted in the same work folder (so every model sees
    # the same ids) instead of fitting it again; a stage that fits it also clears old scores.
    reuse_features: bool = False


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


SCORES_DIR = "scores"  # <workdir>/scores/<model>.npz: validation and test scores of each trained model


def _train_xgb(config: TrainConfig, artifacts: TrainedArtifacts, tr: Tensors, va: Tensors, te: Tensors,
               scores: dict[str, dict[str, np.ndarray]], timings: dict[str, float],
               log: Callable[[str], None]) -> None:
    start = time.perf_counter()
    booster = xgb.train(config.xgb, xgb.design_matrix(tr.dense, tr.ids), tr.labels,
                        xgb.design_matrix(va.dense, va.ids), va.labels, config.device)
    (artifacts.models_dir / "xgb").mkdir(parents=True, exist_ok=True)
    xgb.save(booster, artifacts.models_dir / "xgb")
    for split, t in (("valid", va), ("test", te)):
        scores[split]["xgb"] = booster.inplace_predict(xgb.design_matrix(t.dense, t.ids))
    timings["xgb"] = time.perf_counter() - start
    log(f"xgb: {booster.num_boosted_rounds()} trees in {timings['xgb']:.1f}s")


def _features(train: pd.DataFrame, workdir: Path, config: TrainConfig, log: Callable[[str], None]):
    """Fit the workflow (and drop scores made with an earlier one), or reuse a fitted one."""
    artifacts = TrainedArtifacts.under(workdir)
    if config.reuse_features:
        if not artifacts.workflow_dir.is_dir():
            raise FileNotFoundError(f"reuse_features: no fitted workflow in {artifacts.workflow_dir}; run the "
                                    f"stage that fits it first, on the same work folder")
        log(f"features: reusing the workflow in {artifacts.workflow_dir}")
    else:
        transforms.fit_workflow(train, artifacts.workflow_dir, config.freq_threshold, config.device)
        for stale in (workdir / SCORES_DIR).glob("*.npz"):
            stale.unlink()
    return transforms.load_workflow(artifacts.workflow_dir)


def train_all(train: pd.DataFrame, valid: pd.DataFrame, test: pd.DataFrame, workdir: str | Path,
              config: TrainConfig = TrainConfig(), log: Callable[[str], None] = print) -> dict:
    """Fit the workflow on ``train``, train ``config.models``, fit the blend on ``valid`` once
    every model's scores exist (this stage's or an earlier stage's in the same ``workdir``).

    Returns:
        The report: per model (and the blend) AUC and log loss on ``test``, timings, sizes; for a
        stage that leaves models to another, ``{"trained", "waiting_for", "seconds"}``.
    """
    workdir = Path(workdir)
    artifacts = TrainedArtifacts.under(workdir)
    order = [m.value for m in schema.MODEL_SCORES]  # the blend step's input order
    if not config.models or set(config.models) - set(order):
        raise ValueError(f"models to train: choose from {order}, got {list(config.models)}")
    timings: dict[str, float] = {}

    start = time.perf_counter()
    workflow = _features(train, workdir, config, log)
    splits = {name: _to_tensors(workflow, frame, config.device)
              for name, frame in (("train", train), ("valid", valid), ("test", test))}
    cardinalities = transforms.LeanTransform.load(artifacts.workflow_dir).cardinalities
    timings["features"] = time.perf_counter() - start
    log(f"features ready in {timings['features']:.1f}s; vocabulary sizes {list(cardinalities)}")

    tr, va, te = splits["train"], splits["valid"], splits["test"]
    scores: dict[str, dict[str, np.ndarray]] = {"valid": {}, "test": {}}
    if "xgb" in config.models:
        _train_xgb(config, artifacts, tr, va, te, scores, timings, log)
    dlrm_config = replace(config.dlrm, cardinalities=cardinalities)
    for name, module in (("dlrm_torch", dlrm_torch), ("dlrm_tf", dlrm_tf)):
        if name not in config.models:
            continue
        start = time.perf_counter()
        model = module.train(dlrm_config, (tr.dense, tr.ids, tr.labels), (va.dense, va.ids, va.labels),
                             config.device, log)
        (artifacts.models_dir / name).mkdir(parents=True, exist_ok=True)
        module.save(model, artifacts.models_dir / name)
        for split, t in (("valid", va), ("test", te)):
            scores[split][name] = module.predict(model, t.dense, t.ids)
        timings[name] = time.perf_counter() - start
        log(f"{name}: trained in {timings[name]:.1f}s")

    scores_dir = workdir / SCORES_DIR
    scores_dir.mkdir(parents=True, exist_ok=True)
    for name in order:
        saved = scores_dir / f"{name}.npz"
        if name in config.models:
            np.savez(saved, valid=scores["valid"][name], test=scores["test"][name])
        elif saved.is_file():  # trained by another stage on the same workflow
            with np.load(saved) as archive:
                scores["valid"][name], scores["test"][name] = archive["valid"], archive["test"]
            if (len(scores["valid"][name]), len(scores["test"][name])) != (len(va.labels), len(te.labels)):
                raise ValueError(f"{saved} scores {len(scores['valid'][name])}/{len(scores['test'][name])} rows, this "
                                 f"split has {len(va.labels)}/{len(te.labels)}: every stage must read the same data")
    waiting = [name for name in order if name not in scores["valid"]]
    if waiting:
        log(f"trained {list(config.models)}; the blend waits for {waiting} (another stage, same work folder)")
        return {"trained": list(config.models), "waiting_for": waiting, "seconds": timings}

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
