"""Device selection and the GPU code paths (written for NVIDIA GPUs; none has run on one here).

``--device auto|cpu|gpu``: ``auto`` is the GPU when one is visible. Every GPU library (cudf,
cupy, cuml, nvforest, xgboost's CUDA build) is imported inside a function, only on the GPU path,
so the CPU install never needs CUDA packages. What runs where:

- NVTabular fit and transform on cuDF (:func:`fit_frame`): only when ``cudf`` imports. No cuDF
  wheel co-installs with this project's pins (pandas<1.6 for merlin-core 23.8, numpy<2 for
  nvidia-pytriton; cuDF wheels on PyPI start at 24.12 and need pandas 2), so the `gpu` extra
  cannot bring it; where it is absent the features are fitted on CPU and the log says so.
- DLRM training: torch autocast(float16) + GradScaler + TF32, Keras ``mixed_float16`` (in
  ensemble.models.dlrm_torch / dlrm_tf); XGBoost ``device=cuda``.
- In-process tree inference (:class:`GpuTreeScorer`, the ``--local`` path): FIL through
  ``nvforest`` (FIL's successor) or ``cuml.fil`` when importable, reading the Treelite checkpoint
  export writes (``checkpoint.tl``; FIL's Treelite may not parse XGBoost 3.x JSON), else XGBoost's
  own CUDA predictor on ``xgboost.json``.
- The features step in serving stays on CPU: its inputs are strings in host memory and the
  work is a dictionary lookup per value (0.034 ms per row measured on CPU), so a GPU hop costs
  more than it saves; the dense arithmetic is 13 floats per row.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

LOG = logging.getLogger(__name__)
INSTALL_HINT = "install the GPU extra: pip install 'ensemble[gpu]' (see docs/gpu-deployment.md)"


class Device(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


class GpuUnavailable(RuntimeError):
    """``--device gpu`` was asked for and this machine or install cannot provide it."""


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible to this process, without importing any CUDA library."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "void"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU " in listed.stdout


def resolve_device(requested: str | Device) -> Device:
    """``auto`` -> GPU when one is visible, else CPU; an explicit ``gpu`` without one is an error."""
    if requested == "auto":
        device = Device.GPU if gpu_visible() else Device.CPU
        LOG.info("--device auto: using %s", device.value)
        return device
    device = Device(requested)
    if device is Device.GPU and not gpu_visible():
        raise GpuUnavailable("--device gpu: no NVIDIA GPU is visible (no /proc/driver/nvidia/gpus entry, "
                             "nvidia-smi absent or failing, or CUDA_VISIBLE_DEVICES hides them)")
    return device


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported (finds it without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str):
    """Import a GPU library or raise :class:`GpuUnavailable` saying what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise GpuUnavailable(f"{purpose} needs '{module}' ({exc}); {INSTALL_HINT}") from exc


def fit_frame(frame, device: Device | str):
    """The frame NVTabular should fit and transform: cuDF on the GPU path when cuDF imports.

    Returns:
        (frame, on_gpu): a ``cudf.DataFrame`` and True, or the pandas frame and False.
    """
    if Device(device) is Device.GPU:
        if has_module("cudf"):
            cudf = importlib.import_module("cudf")
            return cudf.from_pandas(frame), True
        LOG.warning("features: cudf is not installed, fitting NVTabular on CPU (pandas). %s", INSTALL_HINT)
    return frame, False


def to_host(array) -> np.ndarray:
    """A cupy / cuDF / numpy array -> numpy."""
    if hasattr(array, "values_host"):  # cudf Series / DataFrame
        return np.asarray(array.values_host)
    if hasattr(array, "get") and type(array).__module__.startswith("cupy"):
        return array.get()
    return np.asarray(array)


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
