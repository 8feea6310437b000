"""Fit the features and train the three models and the blender; report held-out accuracy.

Artifacts land in a work folder (``<workdir>/workflow``, ``<workdir>/models/<model>/``) from
which :mod:`ensemble.export` writes the model repository.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from ensemble import features, metrics, schema
from ensemble.export import TrainedArtifacts
from ensemble.models import distributed, dlrm_tf, dlrm_torch, xgb
from ensemble.models.blend import Blender
from ensemble.data.shards import ArraySource, BatchSource, ShardSource, in_order
from ensemble.models.dlrm import DLRMConfig, score_source
from ensemble.models.xgb import XGBMatrix


SCORE_BATCH = 65536  # rows per batch when scoring validation and test


@dataclass(frozen=True)
class TrainConfig:
    """Everything training needs besides the data.

    Attributes:
        xgb_matrix: how the trees hold the training rows when streaming (see ``XGBMatrix``).
        part_rows: raw rows per part (and so per shard) when features run out of core.
        shuffle_rows: the DLRMs' shuffle buffer (rows held besides one shard) when streaming.
    """

    freq_threshold: int = 3
    xgb: xgb.XGBConfig = field(default_factory=xgb.XGBConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)
    device: str = "cpu"  # "cpu" or "gpu"; see resolve_device
    xgb_matrix: XGBMatrix = XGBMatrix.QUANTILE
    part_rows: int = 250_000
    shuffle_rows: int = 1 << 20


def resolve_device(device: str) -> str:
    """``auto`` -> ``gpu`` when an NVIDIA GPU is visible, else ``cpu`` (see :mod:`ensemble.gpu`)."""
    from ensemble.gpu import resolve_device as resolve

    return resolve(device).value


@dataclass(frozen=True)
class Sources:
    """The batch sources of the three splits (:mod:`ensemble.data.shards`); valid and test are
    read in order, train is shuffled per epoch."""

    train: BatchSource
    valid: BatchSource
    test: BatchSource


def _array_source(workflow, frame: pd.DataFrame, config: TrainConfig, is_train: bool) -> ArraySource:
    dense, ids = features.nvtabular_transform(workflow, frame, config.device)
    return ArraySource(dense.astype(np.float32), ids, frame[schema.LABEL].to_numpy(np.int8),
                       config.dlrm.batch_size if is_train else SCORE_BATCH, config.dlrm.seed, shuffle=is_train)


def train_all(train: pd.DataFrame, valid: pd.DataFrame, test: pd.DataFrame, workdir: str | Path,
              config: TrainConfig = TrainConfig(), log: Callable[[str], None] = print) -> dict:
    """In memory: fit the workflow on the ``train`` frame, transform the three frames, and train
    every model from in-memory batch sources (the same trainers as :func:`train_files`).

    Returns:
        The report: per model (and the blend) AUC and log loss on ``test``, timings, sizes.
    """
    artifacts = TrainedArtifacts.under(workdir)
    start = time.perf_counter()
    features.fit_workflow(train, artifacts.workflow_dir, config.freq_threshold, config.device)
    workflow = features.load_workflow(artifacts.workflow_dir)
    sources = Sources(*(_array_source(workflow, frame, config, is_train)
                        for frame, is_train in ((train, True), (valid, False), (test, False))))
    return train_models(sources, workdir, config, {"features": time.perf_counter() - start}, log)


def train_files(paths: Sequence[str | Path], workdir: str | Path, config: TrainConfig = TrainConfig(),
                log: Callable[[str], None] = print, nrows: int | None = None, valid: float = 0.1,
                test: float = 0.1, client=None) -> dict:
    """Out of core: Criteo files -> NVTabular on Dask -> tensor shards -> every model streamed
    from the shards (memory flat in rows). ``client``: a dask client the features run on.

    Returns:
        The report of :func:`train_models`.
    """
    from ensemble.features import out_of_core

    artifacts = TrainedArtifacts.under(workdir)
    start = time.perf_counter()
    built = out_of_core.build_shards(paths, workdir, artifacts.workflow_dir, config.freq_threshold, valid, test,
                                     nrows, config.part_rows, client)
    seconds = {"features": time.perf_counter() - start}
    Split = out_of_core.Split
    if Split.VALID not in built or Split.TEST not in built:
        raise ValueError("the validation and test splits are empty: give more rows")
    batch, seed = config.dlrm.batch_size, config.dlrm.seed
    sources = Sources(built[Split.TRAIN].source(batch, seed, True, config.shuffle_rows),
                      built[Split.VALID].source(SCORE_BATCH, shuffle=False),
                      built[Split.TEST].source(SCORE_BATCH, shuffle=False))
    return train_models(sources, workdir, config, seconds, log, client)


def rss_high_water_mb() -> float:
    """This process's peak resident memory so far (VmHWM), in MiB (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def train_models(sources: Sources, workdir: str | Path, config: TrainConfig, seconds: dict[str, float],
                 log: Callable[[str], None] = print, client=None) -> dict:
    """Train the trees and both DLRMs from batch sources, fit the blend on validation scores,
    and score the test split; ``workdir`` already holds the fitted workflow.

    With a dask ``client`` and shard sources, the trees train with ``xgboost.dask`` and the
    PyTorch DLRM under ``torch.distributed``, one process per worker
    (:mod:`ensemble.models.distributed`); the Keras DLRM trains in this process either way.

    Returns:
        The report: per model (and the blend) AUC and log loss on test, seconds per stage, rows.
    """
    workdir = Path(workdir)
    artifacts = TrainedArtifacts.under(workdir)
    timings = dict(seconds)
    peak_mb = {"features": rss_high_water_mb()}  # the process's high-water mark after each stage
    cardinalities = features.LeanTransform.load(artifacts.workflow_dir).cardinalities
    log(f"features fitted in {timings['features']:.1f}s; vocabulary sizes {list(cardinalities)}")
    scores: dict[str, dict[str, np.ndarray]] = {"valid": {}, "test": {}}
    labels: dict[str, np.ndarray] = {}

    on_cluster = client is not None and isinstance(sources.train, ShardSource) and isinstance(sources.valid, ShardSource)
    start = time.perf_counter()
    if on_cluster:
        booster = distributed.train_trees(client, config.xgb, sources.train.shards, sources.valid.shards, config.device)
    else:  # the trees read big ordered batches (their iterator is walked once to build the matrix)
        booster = xgb.train_streaming(config.xgb, in_order(sources.train, 1 << 18), in_order(sources.valid, 1 << 18),
                                      config.xgb_matrix, workdir / "xgb-cache", config.device)
    (artifacts.models_dir / "xgb").mkdir(parents=True, exist_ok=True)
    xgb.save(booster, artifacts.models_dir / "xgb")
    for split in ("valid", "test"):
        scores[split]["xgb"], labels[split] = score_source(
            lambda d, i: booster.inplace_predict(xgb.design_matrix(d, i)), getattr(sources, split))
    timings["xgb"] = time.perf_counter() - start
    peak_mb["xgb"] = rss_high_water_mb()
    log(f"xgb: {booster.num_boosted_rounds()} trees in {timings['xgb']:.1f}s")

    dlrm_config = replace(config.dlrm, cardinalities=cardinalities)
    for name, module in (("dlrm_torch", dlrm_torch), ("dlrm_tf", dlrm_tf)):
        start = time.perf_counter()
        if on_cluster and module is dlrm_torch:
            model, _ = distributed.train_torch(dlrm_config, sources.train.shards, sources.valid.shards, workdir / "ddp",
                                               client, buffer_rows=config.shuffle_rows, log=log)
        else:
            model = module.train(dlrm_config, sources.train, sources.valid, config.device, log)
        (artifacts.models_dir / name).mkdir(parents=True, exist_ok=True)
        module.save(model, artifacts.models_dir / name)
        for split in ("valid", "test"):
            scores[split][name], _ = score_source(lambda d, i: module.predict(model, d, i), getattr(sources, split))
        timings[name] = time.perf_counter() - start
        peak_mb[name] = rss_high_water_mb()
        log(f"{name}: trained in {timings[name]:.1f}s")

    order = [m.value for m in schema.MODEL_SCORES]  # the blend step's input order
    blender = Blender.fit(np.stack([scores["valid"][m] for m in order], axis=1), labels["valid"])
    (artifacts.models_dir / "blend").mkdir(parents=True, exist_ok=True)
    blender.save(artifacts.models_dir / "blend")
    scores["test"]["blend"] = blender(*(scores["test"][m].reshape(-1, 1) for m in order)).ravel()

    te = labels["test"]
    report = {
        "rows": {"train": sources.train.rows, "valid": sources.valid.rows, "test": sources.test.rows},
        "test": {name: {"auc": metrics.auc(te, s), "logloss": metrics.log_loss(te, s)}
                 for name, s in scores["test"].items()},
        "blend_weights": dict(zip(order, blender.weights)),
        "seconds": timings,
        "peak_rss_mib_after": peak_mb,
        "xgb_trees": booster.num_boosted_rounds(),
        "workers": len(client.scheduler_info()["workers"]) if on_cluster else 1,
        "vocabulary_sizes": list(cardinalities),
        "config": asdict(config),
    }
    (workdir / "train_report.json").write_text(json.dumps(report, indent=1, default=str))
    return report
