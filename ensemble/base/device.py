"""Device selection and the GPU code paths' shared helpers (written for NVIDIA GPUs; none has run on one here).

``--device auto|cpu|gpu``: ``auto`` is the GPU when one is visible. Every GPU library (cudf,
cupy, cuml, nvforest, xgboost's CUDA build) is imported inside a function, only on the GPU path,
so the CPU install never needs CUDA packages. What runs where:

- NVTabular fit and transform on cuDF (:func:`fit_frame`): only when ``cudf`` imports. No cuDF
  wheel co-installs with this project's pins (pandas<1.6 for merlin-core 23.8, numpy<2 for
  nvidia-pytriton; cuDF wheels on PyPI start at 24.12 and need pandas 2), so the `gpu` extra
  cannot bring it; where it is absent the features are fitted on CPU and the log says so.
- DLRM training: torch autocast(float16) + GradScaler + TF32, Keras ``mixed_float16`` (in
  ensemble.models.dlrm_torch / dlrm_tf); XGBoost ``device=cuda``.
- In-process tree inference (:class:`ensemble.models.xgb_gpu.GpuTreeScorer`, the ``--local``
  path): FIL through ``nvforest`` (FIL's successor) or ``cuml.fil`` when importable, else
  XGBoost's own CUDA predictor.
- The features step in serving stays on CPU: its inputs are strings in host memory and the
  work is a dictionary lookup per value (0.034 ms per row measured on CPU), so a GPU hop costs
  more than it saves; the dense arithmetic is 13 floats per row.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
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
