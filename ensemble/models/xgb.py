"""Gradient-boosted trees (XGBoost) on the 13 normalized dense features + 26 category ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_FILE = "xgboost.json"
# What the GPU configuration's FIL backend loads (model_type "treelite_checkpoint"): the FIL
# backend of the pinned container links Treelite 4.4.1, which cannot parse the JSON that
# XGBoost 3.x writes (an unknown "cats" key, then base_score written as a vector "[2.5E-1]"),
# the failure users report in fil_backend issues #311 and #378 for earlier version pairs.
FIL_FILE = "checkpoint.tl"


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


def train(config: XGBConfig, train_x: np.ndarray, train_y: np.ndarray,
          valid_x: np.ndarray, valid_y: np.ndarray, device: str = "cpu"):
    """Train with early stopping on the validation split; return the booster cut at its best round."""
    import xgboost as xgb

    params = {
        "objective": "binary:logistic", "eval_metric": "logloss", "tree_method": "hist",
        "max_depth": config.max_depth, "eta": config.learning_rate, "subsample": config.subsample,
        "min_child_weight": config.min_child_weight, "seed": config.seed, "nthread": config.threads,
        "device": "cuda" if device == "gpu" else "cpu",
    }
    dtrain = xgb.DMatrix(train_x, label=train_y)
    dvalid = xgb.DMatrix(valid_x, label=valid_y)
    booster = xgb.train(params, dtrain, num_boost_round=config.rounds, evals=[(dvalid, "valid")],
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


class XGBScorer:
    """Loads ``xgboost.json``; ``(dense_features, category_ids) -> [B x 1] float32``."""

    def __init__(self, model_dir: str | Path, threads: int = 1):
        import xgboost as xgb

        self.booster = xgb.Booster(model_file=str(Path(model_dir) / MODEL_FILE))
        self.booster.set_param({"nthread": threads})

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        x = design_matrix(dense_features, category_ids)
        return self.booster.inplace_predict(x).astype(np.float32).reshape(-1, 1)
