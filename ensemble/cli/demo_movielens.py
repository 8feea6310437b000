"""`ensemble demo --dataset movielens100k`: a second, real dataset through the whole chain.

MovieLens 100k (:mod:`ensemble.data.movielens`) split by time -> the NVTabular workflow, the trees,
both DLRMs and the blend, sized by the dataset's spec -> export -> tritonserver -> served scores
checked against the in-process pipeline -> AUC of every model and the ranking quality of each
user's later ratings (NDCG@10 and MRR, against ranking the same candidates by popularity).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ensemble import dataset, online, schema
from ensemble.base import machine
from ensemble.runs import training
from ensemble.base.console import framework_info_quieted
from ensemble.data import movielens
from ensemble.cli.demo import DemoOptions, finish
from ensemble.features import transforms
from ensemble.models.metrics import auc, ranking_quality
from ensemble.repository.export import TrainedArtifacts, export_repository
from ensemble.scoring.pipeline import Pipeline
from ensemble.operate.server import ServerOptions, TritonServer

RANKING_K = 10
# The DLRMs still improve on validation after the default 2 epochs here (80,000 training rows);
# each keeps its best epoch, and 4 and 8 epochs give the same models.
DLRM_EPOCHS = 4
PARITY_TOLERANCE = 1e-5


def popularity(train, spec: dataset.DatasetSpec, item: str = "movie_id"):
    """Each item's positive interactions in ``train`` (the baseline ranking's score)."""
    return train[train[spec.label] == 1].groupby(item).size()


def _inputs(frame, spec: dataset.DatasetSpec) -> tuple[np.ndarray, np.ndarray]:
    return transforms.dense_array(frame, spec.continuous), transforms.encode_categorical(frame, spec.categorical)


def _with_missing(dense: np.ndarray, cats: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A copy of the rows with a quarter of the values missing (NaN, "") and some unseen ids."""
    dense, cats = dense.copy(), cats.copy()
    dense[rng.random(dense.shape) < 0.25] = np.nan
    cats[rng.random(cats.shape) < 0.25] = b""
    unseen = rng.random(cats.shape) < 0.05
    cats[unseen] = [f"unseen-{i}".encode() for i in range(int(unseen.sum()))]
    return dense, cats


def run_movielens_demo(options: DemoOptions, log: Callable[[str], None] = print, rows: int | None = None) -> dict:
    """Run the whole chain on MovieLens 100k and return the summary (also written to the workdir).

    ``rows``: use only the earliest ``rows`` ratings (a quick check; None: all 100,000).
    """
    from clients.triton import RankerClient

    started = time.perf_counter()
    workdir = Path(options.workdir)
    spec = dataset.load_spec(movielens.SPEC)
    summary: dict = {"machine": machine.summary(), "dataset": spec.name}

    log("1/5 reading MovieLens 100k (label: rating >= 4) and splitting it by time")
    frame = movielens.load()
    if rows is not None:
        frame = frame.iloc[:rows]
    train, valid, test = movielens.time_split(frame)
    summary["rows"] = {"train": len(train), "valid": len(valid), "test": len(test)}
    log(f"    {len(train)} / {len(valid)} / {len(test)} ratings (train / valid / test); positive share "
        f"{frame[spec.label].mean():.3f}; test users {test['user_id'].nunique()}, of whom "
        f"{len(set(test['user_id']) - set(train['user_id']))} have no training rating")

    log("2/5 fitting the features and training xgb, dlrm_torch, dlrm_tf, blend")
    config = replace(options.train, spec=spec)
    report = training.train_all(train, valid, test, workdir, config, log)
    summary["accuracy"] = report["test"]
    summary["train_seconds"] = report["seconds"]
    for name, m in report["test"].items():
        log(f"    {name:<11} test AUC {m['auc']:.4f}  log loss {m['logloss']:.4f}")

    log(f"3/5 exporting the model repository to {options.repository}")
    export_repository(TrainedArtifacts.under(workdir), options.repository)
    with framework_info_quieted():
        pipeline = Pipeline.from_repository(options.repository, threads=1)
        dense, cats = _inputs(test, spec)
        local = pipeline.score(dense, cats)

    labels = test[spec.label].to_numpy()
    groups = test["user_id"].to_numpy()
    served_auc = auc(labels, local[schema.SCORE.name].ravel())
    popular = popularity(frame.iloc[:len(train) + len(valid)], spec)
    pop_scores = test["movie_id"].map(popular).fillna(0).to_numpy(np.float64)
    quality = {"blend": ranking_quality(groups, labels, local[schema.SCORE.name].ravel(), RANKING_K),
               "popularity": ranking_quality(groups, labels, pop_scores, RANKING_K)}
    for name, output in schema.MODEL_SCORES.items():
        quality[name.value] = ranking_quality(groups, labels, local[output[1].name].ravel(), RANKING_K)
    summary["ranking"] = {name: asdict(q) for name, q in quality.items()}
    log(f"    ranking each test user's later ratings ({quality['blend'].groups} users with a liked and a disliked "
        f"movie; {quality['blend'].skipped} skipped): NDCG@{RANKING_K} / MRR")
    for name, q in quality.items():
        log(f"    {name:<11} {q.ndcg:.4f} / {q.mrr:.4f}")

    server_options = options.server or ServerOptions(Path(options.repository))
    server_options = replace(server_options, repository=Path(options.repository))
    store = _local_store(frame, spec, server_options, workdir, log)
    if store is not None:
        server_options = replace(server_options, store=online.StoreSettings(store.url))
    log("4/5 starting tritonserver")
    server = TritonServer(server_options)
    try:
        server.start()
        log(f"5/5 parity: served scores vs the in-process pipeline on the {len(test)} test ratings, "
            "and the same rows with missing and unseen values")
        missing_dense, missing_cats = _with_missing(dense[:2000], cats[:2000], np.random.default_rng(5))
        diffs = {}
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            client = RankerClient(url, protocol)
            for d, c in ((dense, cats), (missing_dense, missing_cats)):
                want = pipeline.score(d, c)
                got = client.score(d, c, all_scores=True)
                for key in got:
                    gap = float(np.max(np.abs(got[key] - want[key].ravel())))
                    diffs[f"{protocol} {key}"] = max(diffs.get(f"{protocol} {key}", 0.0), gap)
        summary["parity_max_abs_diff"] = diffs
        ok = max(diffs.values()) <= PARITY_TOLERANCE
        log(f"    max |served - in-process| {max(diffs.values()):.2e}" + ("  OK" if ok else "  MISMATCH"))
        if store is not None:
            summary["ranking_by_ids"] = _check_ids(server, store.url, spec, test, log)
            ok = ok and summary["ranking_by_ids"]["max_abs_diff"] == 0.0
        summary["served_blend_auc"] = served_auc
        finish(summary, workdir, started, ok, options, server, log)
    finally:
        server.stop()
        if store is not None:
            store.stop()
    return summary


def _local_store(frame, spec: dataset.DatasetSpec, server: ServerOptions, workdir: Path, log):
    """A local redis-server holding every user's and movie's latest features (ranking by ids), when the
    server runs the native layout and Redis is installed; else None, said."""
    import shutil

    from ensemble.online import materialize
    from ensemble.models.registry import Layout
    from ensemble.base.machine import free_port
    from ensemble.online.local import LocalRedis

    if Layout(server.layout) is not Layout.NATIVE or server.store is not None:
        return None
    if shutil.which("redis-server") is None:
        log("    ranking by ids: not shown (redis-server is not installed; Debian: apt-get install redis-server)")
        return None
    store = LocalRedis(free_port(), workdir / "redis").start()
    report = materialize.materialize(spec, frame, store.url)
    log(f"    online store {store.url}: " + ", ".join(f"{s.entities} {s.key} rows" for s in report.sides)
        + f" materialized in {report.seconds:.2f}s")
    return store


def _check_ids(server: TritonServer, store_url: str, spec: dataset.DatasetSpec, test, log) -> dict:
    """Ranking requests by ids (the server reads the features from the store) against the same
    requests with the stored features inline, for 20 test users and the movies they rated later."""
    from clients.triton import RankerClient

    lookup = online.FeatureLookup(store_url, spec.name, cache_entries=0, timeout_s=5)
    client = RankerClient(server.grpc_url, "grpc", dataset=spec)
    gap, users = 0.0, list(test["user_id"].unique()[:20])
    try:
        for user in users:
            items = test.loc[test["user_id"] == user, "movie_id"].tolist()
            rows = lookup.rows(str(user).encode(), [str(i).encode() for i in items])
            inline = client.rank((rows.context_dense, rows.context_categorical),
                                 (rows.candidate_dense, rows.candidate_categorical))
            by_ids = client.rank_ids(user, items)
            gap = max(gap, float(np.max(np.abs(by_ids.scores - inline.scores))))
    finally:
        lookup.close()
    log(f"    ranking by ids == inline features for {len(users)} users: max |diff| {gap:.1e}"
        + ("  OK" if gap == 0.0 else "  MISMATCH"))
    return {"users": len(users), "max_abs_diff": gap, "store": online.redacted(store_url)}
