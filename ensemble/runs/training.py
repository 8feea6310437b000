"""Fit the features and train the three models and the blender; report held-out accuracy.

Artifacts land in a work folder (``<workdir>/workflow``, ``<workdir>/models/<model>/``) from
which :mod:`ensemble.repository.export` writes the model repository.

Training can run in stages on one work folder (``TrainConfig.models``): the GPU deployment trains
xgb and the torch DLRM in one image and the Keras DLRM in another, because the CUDA builds of
torch 2.13 (CUDA 13 libraries) and TensorFlow 2.21 (CUDA 12 libraries) do not belong in one
process (docs/gpu-deployment.md). A later stage reuses the first stage's workflow (and, out of
core, its shards); each stage saves its models' validation and test scores under
``<workdir>/scores``; the blend is fitted, and the report written, once all three are there.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from ensemble import schema
from ensemble.dataset import DatasetSpec
from ensemble.data.shards import ArraySource, BatchSource, ShardSet, ShardSource, in_order
from ensemble.features import transforms
from ensemble.models import distributed, dlrm_tf, dlrm_torch, metrics, slipstream, xgb
from ensemble.models.blend import Blender
from ensemble.models.dlrm import DLRMConfig, score_source
from ensemble.models.xgb import XGBMatrix
from ensemble.repository.export import TrainedArtifacts
from ensemble.tables import SMALL_ROWS
from ensemble.base.device import Device

SCORE_BATCH = 65536  # rows per batch when scoring validation and test
SCORES_DIR = "scores"  # <workdir>/scores/<model>.npz: validation and test scores of each trained model
MODEL_NAMES: tuple[str, ...] = tuple(m.value for m in schema.MODEL_SCORES)  # the blend's input order


@dataclass(frozen=True)
class TrainConfig:
    """Everything training needs besides the data.

    Attributes:
        xgb_matrix: how the trees hold the training rows when streaming (see ``XGBMatrix``).
        part_rows: raw rows per part (and so per shard) when features run out of core.
        shuffle_rows: the DLRMs' shuffle buffer (rows held besides one shard) when streaming.
        models: the models this run trains (a stage; default all three).
        reuse_features: reuse the workflow (and shards) an earlier stage left in the work folder,
            so every model sees the same ids, instead of fitting again; a stage that fits the
            features also drops the scores made with an earlier workflow.
        slipstream: train dlrm_torch with Slipstream (:mod:`ensemble.models.slipstream`); None: plainly.
        spec: the dataset's columns (:mod:`ensemble.dataset`; Criteo unless set).
        row_store: keep the DLRMs' tables out of memory (:mod:`ensemble.tables`): each step reads and updates
            its batch's rows only; None decides by the largest table.
        table_budget_gib: the touched rows' memory in a row store's training (then a file of the work folder).
        freq_threshold: one threshold for every categorical column; None: the spec's (Criteo's is 3).
    """

    freq_threshold: int | None = None
    xgb: xgb.XGBConfig = field(default_factory=xgb.XGBConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)
    device: Device = Device.CPU  # `--device auto` is resolved before (ensemble.base.device.resolve_device)
    xgb_matrix: XGBMatrix = XGBMatrix.QUANTILE
    part_rows: int = 250_000
    shuffle_rows: int = 1 << 20
    models: tuple[str, ...] = MODEL_NAMES
    reuse_features: bool = False
    slipstream: slipstream.SlipstreamConfig | None = None
    spec: DatasetSpec = schema.CRITEO
    # The DLRMs' tables in a row store (ensemble.tables): True, False, or None: when a table has
    # ensemble.tables.SMALL_ROWS rows or more. table_budget_gib: memory the touched rows may take (then disk).
    row_store: bool | None = None
    table_budget_gib: float = 8.0
    init_from: Path | None = None  # a repository whose serving release's rows a row store's training starts from

    def check_models(self) -> None:
        if not self.models or set(self.models) - set(MODEL_NAMES):
            raise ValueError(f"models to train: choose from {list(MODEL_NAMES)}, got {list(self.models)}")


@dataclass(frozen=True)
class Sources:
    """The batch sources of the three splits (:mod:`ensemble.data.shards`); valid and test are
    read in order, train is shuffled per epoch."""

    train: BatchSource
    valid: BatchSource
    test: BatchSource


def _array_source(workflow, frame: pd.DataFrame, config: TrainConfig, is_train: bool) -> ArraySource:
    dense, ids = transforms.nvtabular_transform(workflow, frame, config.device, config.spec)
    return ArraySource(dense.astype(np.float32), ids, frame[config.spec.label].to_numpy(np.int8),
                       config.dlrm.batch_size if is_train else SCORE_BATCH, config.dlrm.seed, shuffle=is_train)


def _reusing(workdir: str | Path, config: TrainConfig, log: Callable[[str], None]) -> bool:
    """Whether this stage reuses an earlier stage's workflow (which must exist)."""
    if not config.reuse_features:
        return False
    workflow_dir = TrainedArtifacts.under(workdir).workflow_dir
    if not workflow_dir.is_dir():
        raise FileNotFoundError(f"reuse_features: no fitted workflow in {workflow_dir}; run the stage that fits it "
                                "first, on the same work folder")
    log(f"features: reusing the workflow in {workflow_dir}")
    return True


def _drop_scores(workdir: str | Path) -> None:
    """Scores made with an earlier workflow are stale once the features are fitted again."""
    for stale in (Path(workdir) / SCORES_DIR).glob("*.npz"):
        stale.unlink()


def _stage_scores(workdir: Path, config: TrainConfig, scores: dict[str, dict[str, np.ndarray]],
                  labels: dict[str, np.ndarray]) -> list[str]:
    """Save this stage's scores and read the other stages'; returns the models still missing."""
    folder = workdir / SCORES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name in MODEL_NAMES:
        saved = folder / f"{name}.npz"
        if name in config.models:
            np.savez(saved, valid=scores["valid"][name], test=scores["test"][name])
        elif saved.is_file():  # trained by another stage on the same workflow
            with np.load(saved) as archive:
                scores["valid"][name], scores["test"][name] = archive["valid"], archive["test"]
            if (len(scores["valid"][name]), len(scores["test"][name])) != (len(labels["valid"]), len(labels["test"])):
                raise ValueError(f"{saved} scores {len(scores['valid'][name])}/{len(scores['test'][name])} rows, this "
                                 f"split has {len(labels['valid'])}/{len(labels['test'])}: every stage must read the "
                                 "same data")
    return [name for name in MODEL_NAMES if name not in scores["valid"]]


def train_all(train: pd.DataFrame, valid: pd.DataFrame, test: pd.DataFrame, workdir: str | Path,
              config: TrainConfig = TrainConfig(), log: Callable[[str], None] = print) -> dict:
    """In memory: fit the workflow on the ``train`` frame, transform the three frames, and train
    every model from in-memory batch sources (the same trainers as :func:`train_files`).

    Returns:
        The report: per model (and the blend) AUC and log loss on ``test``, timings, sizes.
    """
    config.check_models()
    artifacts = TrainedArtifacts.under(workdir)
    start = time.perf_counter()
    if _reusing(workdir, config, log):
        workflow = transforms.load_workflow(artifacts.workflow_dir)
    else:
        transforms.fit_workflow(train, artifacts.workflow_dir, config.freq_threshold, config.device, config.spec)
        workflow = transforms.load_workflow(artifacts.workflow_dir)
        _drop_scores(workdir)
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

    config.check_models()
    artifacts = TrainedArtifacts.under(workdir)
    start = time.perf_counter()
    Split = out_of_core.Split
    if _reusing(workdir, config, log):
        built = {split: ShardSet.load(folder) for split in Split
                 if (folder := Path(workdir) / "shards" / split.value).is_dir()}
    else:
        built = out_of_core.build_shards(paths, workdir, artifacts.workflow_dir, config.freq_threshold, valid, test,
                                         nrows, config.part_rows, client, spec=config.spec)
        _drop_scores(workdir)
    seconds = {"features": time.perf_counter() - start}
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
    lean = transforms.LeanTransform.load(artifacts.workflow_dir)
    cardinalities = lean.cardinalities
    log(f"features fitted in {timings['features']:.1f}s; vocabulary sizes {list(cardinalities)}")
    scores: dict[str, dict[str, np.ndarray]] = {"valid": {}, "test": {}}
    labels: dict[str, np.ndarray] = {}

    on_cluster = client is not None and isinstance(sources.train, ShardSource) and isinstance(sources.valid, ShardSource)
    for split in ("valid", "test"):  # labels in scoring order (these splits' sources do not shuffle)
        labels[split] = np.concatenate([y for _, _, y in getattr(sources, split).epoch(0)] or [np.zeros(0, np.int8)])
    # the export's held-out rows: int8 calibrates on validation rows, reduced precisions are judged on test rows
    from ensemble.models import engines

    for split, rows in (("valid", engines.CALIBRATION_ROWS), ("test", engines.HELD_OUT_ROWS)):
        engines.write_held_out(workdir / engines.HELD_OUT_DIR, split, getattr(sources, split).epoch(0), rows)
    trees = None
    if "xgb" in config.models:
        start = time.perf_counter()
        trees = _train_trees(sources, workdir, config, on_cluster, client, scores, log)
        timings["xgb"] = time.perf_counter() - start
        peak_mb["xgb"] = rss_high_water_mb()

    dlrm_config = replace(config.dlrm, cardinalities=cardinalities, n_dense=len(lean.dense_columns))
    extra: dict[str, dict] = {}  # per-trainer details for the report (Slipstream's statistics)
    row_store = config.row_store if config.row_store is not None else max(cardinalities, default=0) >= SMALL_ROWS
    for name, module in (("dlrm_torch", dlrm_torch), ("dlrm_tf", dlrm_tf)):
        if name not in config.models:
            continue
        start = time.perf_counter()
        if row_store:  # tables larger than memory: a step touches its batch's rows only (ensemble.tables)
            extra[f"{name}_tables"] = _train_row_store(name, module, dlrm_config, lean.id_columns or lean.categorical_columns,
                                                       sources, artifacts.models_dir / name, config, scores, log)
            timings[name] = time.perf_counter() - start
            peak_mb[name] = rss_high_water_mb()
            log(f"{name}: trained in {timings[name]:.1f}s (row store)")
            continue
        if on_cluster and module is dlrm_torch:
            model, _ = distributed.train_torch(dlrm_config, sources.train.shards, sources.valid.shards, workdir / "ddp",
                                               client, buffer_rows=config.shuffle_rows, log=log)
        elif module is dlrm_torch and config.slipstream is not None:  # Slipstream (docs/training.md)
            model, slip_stats = slipstream.train(dlrm_config, config.slipstream, sources.train, sources.valid,
                                                 config.device, log)
            extra["slipstream"] = asdict(slip_stats) | {"skipped_share": slip_stats.skipped_share}
        else:
            model = module.train(dlrm_config, sources.train, sources.valid, config.device, log)
        (artifacts.models_dir / name).mkdir(parents=True, exist_ok=True)
        module.save(model, artifacts.models_dir / name)
        for split in ("valid", "test"):
            scores[split][name], _ = score_source(lambda d, i: module.predict(model, d, i), getattr(sources, split))
        timings[name] = time.perf_counter() - start
        peak_mb[name] = rss_high_water_mb()
        log(f"{name}: trained in {timings[name]:.1f}s")

    waiting = _stage_scores(workdir, config, scores, labels)
    if waiting:
        log(f"trained {list(config.models)}; the blend waits for {waiting} (another stage, same work folder)")
        return {"trained": list(config.models), "waiting_for": waiting, "seconds": timings, **extra}
    order = list(MODEL_NAMES)
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
        "xgb_trees": trees,  # None when an earlier stage trained them
        "workers": len(client.scheduler_info()["workers"]) if on_cluster else 1,
        "vocabulary_sizes": list(cardinalities),
        "config": asdict(config),
        **extra,
    }
    (workdir / "train_report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def _train_row_store(name: str, module, dlrm_config: DLRMConfig, columns: tuple[str, ...], sources: Sources,
                     out: Path, config: TrainConfig, scores: dict[str, dict[str, np.ndarray]],
                     log: Callable[[str], None]) -> dict:
    """Train a DLRM whose tables are a row store's (:mod:`ensemble.tables.training`), save its pooled
    model, its MLP weights and the rows it touched under ``out``, and score the held-out splits."""
    from ensemble.tables import files, training as tables_training

    shapes = [tables_training.TableShape(column, int(rows), files.table_seed(name, column))
              for column, rows in zip(columns, dlrm_config.cardinalities)]
    source = _starting_release(config.init_from, name) if config.init_from else None
    rows = tables_training.TrainingRows(shapes, dlrm_config.embedding_dim, dlrm_config.table_learning_rate,
                                        int(config.table_budget_gib * 2**30), out / "spill",
                                        init=tables_training.rows_of_release(source) if source else None)
    fit = module.PooledFit(dlrm_config, len(shapes))
    if source is not None:  # continued training: the MLPs start from that release's too
        from ensemble.tables.mlp import MlpWeights

        fit.load_mlp(MlpWeights.load(source))
    report = tables_training.train(name, fit, rows, sources.train, sources.valid, dlrm_config.epochs, log)
    out.mkdir(parents=True, exist_ok=True)
    fit.save(out)
    rows.save(out, source)
    for split in ("valid", "test"):
        scores[split][name], _ = score_source(lambda d, i: fit.predict(d, rows.rows_of(i)), getattr(sources, split))
    import shutil

    shutil.rmtree(out / "spill", ignore_errors=True)
    return {**report, "tables": len(shapes), "rows": sum(s.rows for s in shapes), "touched": rows.touched}


def _starting_release(repository: Path, step: str) -> Path:
    """The version folder of ``step`` in ``repository``'s serving release (declared, else newest) that a row
    store's training starts from (``ensemble train --init-from``)."""
    from ensemble.repository import declared

    from ensemble.tables import files

    ranker = Path(repository) / "ranker"
    release = declared.read(repository)
    if release is None:
        releases = sorted(int(p.name) for p in ranker.iterdir() if p.name.isdigit()) if ranker.is_dir() else []
        if not releases:
            raise FileNotFoundError(f"--init-from {repository}: no release there")
        release = releases[-1]
    versions = json.loads((ranker / str(release) / "release.json").read_text())["versions"]
    folder = Path(repository) / step / str(versions[step])
    if not files.has_tables(folder):
        raise ValueError(f"--init-from {repository}: release {release}'s {step} has no row store to start from")
    return folder


def _train_trees(sources: Sources, workdir: Path, config: TrainConfig, on_cluster: bool, client,
                 scores: dict[str, dict[str, np.ndarray]], log: Callable[[str], None]) -> int:
    """Train, save and score the trees (scores into ``scores[split]["xgb"]``); returns their count."""
    artifacts = TrainedArtifacts.under(workdir)
    start = time.perf_counter()
    if on_cluster:
        booster = distributed.train_trees(client, config.xgb, sources.train.shards, sources.valid.shards, config.device)
    else:  # the trees read big ordered batches (their iterator is walked once to build the matrix)
        booster = xgb.train_streaming(config.xgb, in_order(sources.train, 1 << 18), in_order(sources.valid, 1 << 18),
                                      config.xgb_matrix, workdir / "xgb-cache", config.device)
    (artifacts.models_dir / "xgb").mkdir(parents=True, exist_ok=True)
    xgb.save(booster, artifacts.models_dir / "xgb")
    for split in ("valid", "test"):
        scores[split]["xgb"], _ = score_source(
            lambda d, i: booster.inplace_predict(xgb.design_matrix(d, i)), getattr(sources, split))
    log(f"xgb: {booster.num_boosted_rounds()} trees in {time.perf_counter() - start:.1f}s")
    return booster.num_boosted_rounds()
