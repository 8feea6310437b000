"""Gradient-boosted trees (XGBoost) on the 13 normalized dense features + 26 category ids."""

from __future__ import annotations

import logging

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.models.artifacts import FIL_CHECKPOINT, XGB_JSON
from ensemble.base.device import Device

LOG = logging.getLogger(__name__)

MODEL_FILE = XGB_JSON
FIL_FILE = FIL_CHECKPOINT
N_FEATURES = schema.N_DENSE + schema.N_CATEGORICAL  # the design matrix: dense features, then category ids


@dataclass(frozen=True)
class XGBConfig:
    """Boosting settings; training stops early when validation log loss stops improving."""

    max_depth: int = 8
    learning_rate: float = 0.1
    rounds: int = 400
    early_stopping: int = 20
    min_child_weight: float = 5.0
    subsample: float = 0.9
    seed: int = 0
    threads: int = 2


def design_matrix(dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
    """[B x 13] float32 + [B x 26] int64 -> [B x 39] float32 (ids used as ordinal values)."""
    return np.concatenate([dense_features, category_ids.astype(np.float32)], axis=1)


def _params(config: XGBConfig, device: Device) -> dict:
    return {
        "objective": "binary:logistic", "eval_metric": "logloss", "tree_method": "hist",
        "max_depth": config.max_depth, "eta": config.learning_rate, "subsample": config.subsample,
        "min_child_weight": config.min_child_weight, "seed": config.seed, "nthread": config.threads,
        "device": "cuda" if device is Device.GPU else "cpu",
    }


def train(config: XGBConfig, train_x: np.ndarray, train_y: np.ndarray,
          valid_x: np.ndarray, valid_y: np.ndarray, device: Device = Device.CPU):
    """Train with early stopping on the validation split; return the booster cut at its best round."""
    import xgboost as xgb

    params = _params(config, device)
    dtrain = xgb.DMatrix(train_x, label=train_y)
    dvalid = xgb.DMatrix(valid_x, label=valid_y)
    booster = xgb.train(params, dtrain, num_boost_round=config.rounds, evals=[(dvalid, "valid")],
                        early_stopping_rounds=config.early_stopping, verbose_eval=False)
    return booster[: booster.best_iteration + 1]


class XGBMatrix(str, Enum):
    """How :func:`train_streaming` holds the training rows.

    QUANTILE: ``QuantileDMatrix`` built from the batch iterator: the raw rows are never held,
    only their histogram bin indexes (one byte per feature and row, ~40 B a row: 0.4 GB for
    10M rows). EXTERNAL: ``ExtMemQuantileDMatrix``: those pages are cached on disk and streamed
    each round, so memory stays flat in rows, at the cost of reading the cache every round.
    """

    QUANTILE = "quantile"
    EXTERNAL = "external"


def _batch_iterator(source, cache_prefix: str | None):
    """An ``xgboost.DataIter`` over one ordered epoch of a batch source (design matrices)."""
    import xgboost as xgb

    class SourceIter(xgb.DataIter):
        def __init__(self) -> None:
            super().__init__(cache_prefix=cache_prefix, release_data=True)
            self._batches = None

        def reset(self) -> None:
            self._batches = None

        def next(self, input_data) -> bool:
            if self._batches is None:
                self._batches = source.epoch(0)
            batch = next(self._batches, None)
            if batch is None:
                return False
            dense, ids, labels = batch
            input_data(data=design_matrix(dense, ids), label=labels.astype(np.float32))
            return True

    return SourceIter()


def train_streaming(config: XGBConfig, train_source, valid_source, matrix: XGBMatrix = XGBMatrix.QUANTILE,
                    cache_dir: str | Path | None = None, device: Device = Device.CPU):
    """Train from batch sources (:mod:`ensemble.data.shards`, read in order) without holding the raw
    rows: the quantile sketch and bin indexes are built batch by batch (see :class:`XGBMatrix`).

    Returns:
        The booster cut at its best validation round (early stopping as :func:`train`).
    """
    import xgboost as xgb

    if matrix is XGBMatrix.EXTERNAL:
        if cache_dir is None:
            raise ValueError("the external-memory matrix needs a cache_dir")
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        dtrain = xgb.ExtMemQuantileDMatrix(_batch_iterator(train_source, str(Path(cache_dir) / "train")),
                                           max_bin=256, nthread=config.threads)
    else:
        dtrain = xgb.QuantileDMatrix(_batch_iterator(train_source, None), max_bin=256, nthread=config.threads)
    dvalid = xgb.QuantileDMatrix(_batch_iterator(valid_source, None), ref=dtrain, nthread=config.threads)
    booster = xgb.train(_params(config, device), dtrain, num_boost_round=config.rounds, evals=[(dvalid, "valid")],
                        early_stopping_rounds=config.early_stopping, verbose_eval=False)
    return booster[: booster.best_iteration + 1]


def save(booster, out_dir: str | Path) -> Path:
    path = Path(out_dir) / MODEL_FILE
    booster.save_model(str(path))
    return path


def write_fil_checkpoint(model_dir: str | Path) -> Path:
    """Convert ``xgboost.json`` in ``model_dir`` to a Treelite checkpoint next to it.

    Uses the Treelite of this environment (requirements.txt), which reads XGBoost 3.x JSON;
    ``ensemble check --target gpu`` then loads the checkpoint with the pinned FIL backend's
    Treelite and compares its predictions with XGBoost's.
    """
    import treelite

    model_dir = Path(model_dir)
    model = treelite.frontend.load_xgboost_model(str(model_dir / MODEL_FILE))
    path = model_dir / FIL_FILE
    model.serialize(str(path))
    return path


# The trees are scored by TreeArrays (the C evaluator in ``ensemble/native/_trees.c``) when that module
# was built and takes the model, else by XGBoost's own predictor; export compiles nothing for them
# (the evaluators measured against each other: docs/results/trees-evaluators.md).


try:
    from ensemble.native import _trees
except ImportError:  # built without a C compiler: XGBoost scores the trees
    _trees = None


class TreeArrays:
    """The trees of ``xgboost.json`` as arrays for ``ensemble.native._trees`` (``_trees.c`` says how
    they are laid out and evaluated): every tree a complete binary tree of the model's depth,
    blocks of 64 rows through one tree before the next.

    Only the shape this project trains: one ``gbtree`` booster, ``binary:logistic``, one target,
    numerical splits; :meth:`from_json` returns None for anything else (the other scorers remain).
    """

    MAX_DEPTH = 14  # 2^14 nodes a tree: beyond it the arrays outgrow the caches they are for

    def __init__(self, node_column: np.ndarray, node_threshold: np.ndarray, leaves: np.ndarray, depth: int,
                 base_margin: float, n_features: int):
        """``node_column``: 2 f + 1 for a split on feature f whose missing values go right, else 2 f
        (``_trees.c`` reads a missing value as +inf in the first, -inf in the second); thresholds finite."""
        if int(node_column.max(initial=0)) >= 2 * n_features:
            raise ValueError(f"a node reads a feature beyond the model's {n_features}")
        if not np.isfinite(node_threshold).all():
            raise ValueError("a split threshold is not finite")
        self.node_column, self.node_threshold, self.leaves = node_column, node_threshold, leaves
        self.depth, self.base_margin, self.n_features = depth, float(base_margin), n_features

    @classmethod
    def from_json(cls, path: str | Path) -> "TreeArrays | None":
        import json

        learner = json.loads(Path(path).read_text())["learner"]
        booster, params = learner["gradient_booster"], learner["learner_model_param"]
        trees = booster.get("model", {}).get("trees", [])
        reason = (f"booster {booster.get('name')!r}, not gbtree" if booster.get("name") != "gbtree" else
                  f"objective {learner['objective']['name']!r}, not binary:logistic"
                  if learner["objective"]["name"] != "binary:logistic" else
                  "more than one target or class"
                  if int(params.get("num_target", "1")) != 1 or int(params.get("num_class", "0")) > 1 else
                  "no trees" if not trees else
                  "categorical splits" if any(int(t) for tree in trees for t in tree.get("split_type", [])) else None)
        if reason is None:
            depth = max(1, max(_depth(tree) for tree in trees))
            if depth > cls.MAX_DEPTH:
                reason = f"depth {depth} > {cls.MAX_DEPTH}"
        if reason is not None:
            LOG.warning("xgb: the C trees decline this model (%s); XGBoost scores it", reason)
            return None
        n_internal, n_leaves = (1 << depth) - 1, 1 << depth
        column = np.zeros((len(trees), n_internal), np.uint32)
        threshold = np.zeros((len(trees), n_internal), np.float32)
        leaves = np.zeros((len(trees), n_leaves), np.float32)
        for t, tree in enumerate(trees):
            left, right = tree["left_children"], tree["right_children"]
            split, cond, default_left = tree["split_indices"], tree["split_conditions"], tree["default_left"]
            stack = [(0, 0, 0)]  # (node, its position in the complete tree, its depth)
            while stack:
                node, pos, level = stack.pop()
                if left[node] == -1:  # a leaf: every complete-tree leaf below pos takes its value
                    first = pos
                    for _ in range(depth - level):
                        first = 2 * first + 1
                    leaves[t, first - n_internal:first - n_internal + (1 << (depth - level))] = cond[node]
                    continue
                column[t, pos] = 2 * int(split[node]) + (0 if int(default_left[node]) else 1)
                threshold[t, pos] = cond[node]
                stack += [(left[node], 2 * pos + 1, level + 1), (right[node], 2 * pos + 2, level + 1)]
        base_score = float(str(params["base_score"]).strip("[]"))
        base_margin = float(np.log(base_score) - np.log1p(-base_score))
        if not np.isfinite(threshold).all():  # the missing-value columns need finite thresholds
            LOG.warning("xgb: the C trees decline this model (a split threshold is not finite); XGBoost scores it")
            return None
        return cls(column.ravel(), threshold.ravel(), leaves.ravel(), depth, base_margin, int(params["num_feature"]))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[B x n_features] float32 -> [B] P(click)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"expected [rows x {self.n_features}] features, got {list(x.shape)}")
        out = np.empty(len(x), dtype=np.float32)
        self.into(x, out)
        return out

    def into(self, x: np.ndarray, out: np.ndarray) -> None:
        """:meth:`__call__` into ``out`` (B float32), for a C-contiguous float32 ``x`` as it is."""
        _trees.predict(x, self.n_features, self.node_column, self.node_threshold, self.leaves, self.depth,
                       self.base_margin, out)


def _depth(tree: dict) -> int:
    left, right = tree["left_children"], tree["right_children"]
    deepest, stack = 0, [(0, 0)]
    while stack:
        node, level = stack.pop()
        if left[node] == -1:
            deepest = max(deepest, level)
        else:
            stack += [(left[node], level + 1), (right[node], level + 1)]
    return deepest


class TreeScorer:
    """``(dense_features, category_ids) -> [B x 1]`` P(click) from the trees: :class:`TreeArrays` when
    ``_trees`` was built and takes the model, else XGBoost's predictor. Both evaluate the same trees in
    float32 and differ by <= 5e-7 (the sum's order)."""

    def __init__(self, model_dir: str | Path, threads: int = 1):
        import xgboost as xgb

        model_dir = Path(model_dir)
        self.booster = xgb.Booster(model_file=str(model_dir / MODEL_FILE))
        self.booster.set_param({"nthread": threads})
        self._arrays = TreeArrays.from_json(model_dir / MODEL_FILE) if _trees is not None else None

    @property
    def kernel(self) -> "TreeArrays | None":
        """The trees as arrays for the C evaluator, when it was built (what scores every batch then)."""
        return self._arrays

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        x = design_matrix(dense_features, category_ids)
        out = self._arrays(x) if self._arrays is not None else self.booster.inplace_predict(x)
        return np.asarray(out, dtype=np.float32).reshape(-1, 1)
