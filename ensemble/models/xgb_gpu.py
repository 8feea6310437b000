"""In-process GPU tree inference for ``--local`` scoring (written for NVIDIA GPUs; not run here).

FIL through ``nvforest`` (FIL's successor) or ``cuml.fil`` when importable, else XGBoost's own
CUDA predictor on ``xgboost.json``. FIL reads the Treelite checkpoint export writes
(``checkpoint.tl``; FIL's Treelite may not parse XGBoost 3.x JSON). The Triton GPU layout
serves the trees with the FIL backend instead.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from pathlib import Path

import numpy as np

from ensemble.base.device import has_module, require, to_host

LOG = logging.getLogger(__name__)


def _positive_class(scores) -> np.ndarray:
    """[B] or [B x 1] probabilities, or [B x 2] class probabilities -> [B x 1] P(class 1)."""
    scores = to_host(scores).astype(np.float32)
    if scores.ndim == 2 and scores.shape[1] == 2:
        scores = scores[:, 1]
    return scores.reshape(-1, 1)


# FIL's model_type for the Treelite checkpoint (the same name in nvforest, cuML and the FIL backend).
FIL_MODEL_TYPE = "treelite_checkpoint"


def _load_fil(checkpoint: Path):
    """FIL from nvforest (FIL's successor) or cuML, whichever is installed, on the Treelite
    checkpoint; None if neither is installed.

    The checkpoint, not ``xgboost.json``: the Treelite inside a FIL build may be older than the
    XGBoost that wrote the JSON (Treelite 4.4 cannot parse XGBoost 3.x JSON), while a checkpoint
    written by a newer Treelite loads in 4.4 (``ensemble check --target gpu`` verifies that).
    """
    if has_module("nvforest"):
        nvforest = importlib.import_module("nvforest")
        return nvforest.load_model(str(checkpoint), model_type=FIL_MODEL_TYPE, device="gpu")
    if has_module("cuml"):
        forest = importlib.import_module("cuml.fil").ForestInference
        accepted = inspect.signature(forest.load).parameters
        # cuML renamed output_class to is_classifier when FIL was rewritten (25.x).
        flag = "is_classifier" if "is_classifier" in accepted else "output_class"
        return forest.load(str(checkpoint), model_type=FIL_MODEL_TYPE, **{flag: True})
    return None


class GpuTreeScorer:
    """In-process GPU tree inference for ``--local`` scoring; ``(dense [B x 13], ids [B x 26]) -> [B x 1]``."""

    def __init__(self, version_dir: str | Path):
        from ensemble.models import xgb

        version_dir = Path(version_dir)
        self._design_matrix = xgb.design_matrix
        self._cupy = require("cupy", "GPU tree inference")
        self._fil = None
        checkpoint = version_dir / xgb.FIL_FILE
        if checkpoint.is_file():
            try:
                self._fil = _load_fil(checkpoint)
            except Exception as exc:  # noqa: BLE001 - FIL/Treelite raise their own types; fall back, say why
                LOG.warning("xgb: FIL could not load %s (%s); predicting with XGBoost device=cuda", checkpoint, exc)
        else:
            LOG.warning("xgb: %s is missing (export writes it); predicting with XGBoost device=cuda", checkpoint)
        if self._fil is None:
            xgboost = require("xgboost", "GPU tree inference")
            LOG.info("xgb: predicting with XGBoost device=cuda (FIL not installed or not loadable)")
            self._booster = xgboost.Booster(model_file=str(version_dir / xgb.MODEL_FILE))
            self._booster.set_param({"device": "cuda"})

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        x = self._cupy.asarray(self._design_matrix(dense_features, category_ids))
        if self._fil is not None:
            predict = getattr(self._fil, "predict_proba", None) or self._fil.predict
            return _positive_class(predict(x))
        return _positive_class(self._booster.inplace_predict(x))
