"""Gradient-boosted trees (XGBoost) on the 13 normalized dense features + 26 category ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.models.artifacts import FIL_CHECKPOINT, TREES_LIBRARY, XGB_JSON

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


# Batches up to this many rows run the compiled trees; larger ones XGBoost's own predictor.
# Measured here (222 trees, depth 8, 1 thread, one run): compiled and called per row 0.034 / 0.12
# / 0.86 ms for 1 / 8 / 64 rows, XGBoost 0.62 / 0.70 / ~0.9 ms: XGBoost's cost per call is mostly
# fixed, the compiled code's grows with the rows (branchy code, one row at a time).
COMPILED_MAX_ROWS = 64


def compile_trees(model_dir: str | Path, threads: int = 2) -> Path | None:
    """Compile ``xgboost.json`` in ``model_dir`` to a shared library with TL2cgen and gcc.

    -O1 and 16 translation units: -O3 in one file took 2-5 minutes for 222 trees here; -O1 split
    takes about a minute. Measured per 1-row call through tl2cgen's own predictor: 0.068 ms at
    -O1 against 0.040 ms at -O3 (both far below XGBoost's 0.62 ms). Returns None (and the CPU layouts use
    XGBoost alone) when no C compiler is found.
    """
    import shutil

    if shutil.which("gcc") is None:
        return None
    import tl2cgen
    import treelite

    model_dir = Path(model_dir)
    model = treelite.frontend.load_xgboost_model(str(model_dir / MODEL_FILE))
    path = model_dir / TREES_LIBRARY
    tl2cgen.export_lib(model, toolchain="gcc", libpath=str(path), params={"parallel_comp": 16, "quantize": 1},
                       nthread=threads, options=["-O1"])
    return path


class CompiledTrees:
    """The compiled library's own entry point, one call per row through ctypes.

    TL2cgen generates ``void predict(union Entry* row, int pred_margin, float* result)``: it
    quantizes the row in place, adds every tree's leaf into ``result`` (which must start at 0)
    and applies the sigmoid unless ``pred_margin``. A float32 row is a valid ``Entry`` array
    (an entry is ``missing`` only when its bits are all ones, a NaN the design matrix never
    holds: missing dense values are filled before this step). Calling it directly costs ~1 us a
    row; ``tl2cgen.Predictor.predict`` spent ~40 us per call building its own matrix.
    """

    def __init__(self, library: Path):
        import ctypes

        self._lib = ctypes.CDLL(str(library))
        self._lib.predict.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        self._lib.predict.restype = None
        if self._lib.get_num_feature() != N_FEATURES:
            raise ValueError(f"{library} takes {self._lib.get_num_feature()} features, not {N_FEATURES}")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[B x 39] float32 (overwritten: the library quantizes in place) -> [B] P(click)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros(len(x), dtype=np.float32)
        predict, base, step, result = self._lib.predict, x.ctypes.data, x.strides[0], out.ctypes.data
        for i in range(len(x)):
            predict(base + i * step, 0, result + 4 * i)
        return out


class TreeScorer:
    """``(dense_features, category_ids) -> [B x 1]`` P(click) from the trees: the compiled library
    (``trees.so``, when export could build it) for small batches, XGBoost for large ones. Both
    evaluate the same trees in float32; they differ by ~3e-7."""

    def __init__(self, model_dir: str | Path, threads: int = 1):
        import xgboost as xgb

        model_dir = Path(model_dir)
        self.booster = xgb.Booster(model_file=str(model_dir / MODEL_FILE))
        self.booster.set_param({"nthread": threads})
        library = model_dir / TREES_LIBRARY
        self._compiled = CompiledTrees(library) if library.is_file() else None

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        x = design_matrix(dense_features, category_ids)
        if self._compiled is not None and len(x) <= COMPILED_MAX_ROWS:
            out = self._compiled(x)
        else:
            out = self.booster.inplace_predict(x)
        return np.asarray(out, dtype=np.float32).reshape(-1, 1)
