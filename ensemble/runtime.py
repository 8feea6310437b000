"""Serving-time objects: one step per Triton model, and the whole chain in-process.

The Triton ``model.py`` (see :mod:`ensemble.triton_model`) and the in-process
:class:`Pipeline` load steps through :func:`load_step`, so the served ensemble and the
reference pipeline run the same code on the same artifacts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ensemble import manifest, schema
from ensemble.gpu import Device
from ensemble.schema import Model

LOG = logging.getLogger(__name__)


class BadInput(ValueError):
    """A request whose tensors do not match the step's contract."""


@dataclass(frozen=True)
class StepRunner:
    """A composing model: named numpy inputs -> named numpy outputs for one batch."""

    step: schema.Step
    fn: Callable[..., object]

    def validate(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Check names, ranks, widths and dtypes; return the batch size."""
        sizes = set()
        for tensor in self.step.inputs:
            if tensor.name not in inputs:
                raise BadInput(f"missing input '{tensor.name}'")
            array = inputs[tensor.name]
            if array.ndim != 1 + len(tensor.dims) or tuple(array.shape[1:]) != tensor.dims:
                raise BadInput(f"input '{tensor.name}' has shape {list(array.shape)}, "
                               f"expected [batch, {', '.join(map(str, tensor.dims))}]")
            if tensor.dtype is schema.DType.STRING:
                if array.dtype != object:
                    raise BadInput(f"input '{tensor.name}' must be strings (BYTES)")
            elif array.dtype != np.dtype(tensor.dtype.numpy):
                raise BadInput(f"input '{tensor.name}' has dtype {array.dtype}, "
                               f"expected {tensor.dtype.numpy}")
            sizes.add(array.shape[0])
        if len(sizes) > 1:
            raise BadInput(f"inputs have different batch sizes: {sorted(sizes)}")
        return sizes.pop()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self.fn(*(inputs[t.name] for t in self.step.inputs))
        outputs = result if isinstance(result, tuple) else (result,)
        return {t.name: np.asarray(o, dtype=t.dtype.numpy) for t, o in zip(self.step.outputs, outputs)}


# Loaders take (version folder, threads, device). Features and blend are numpy work and stay on CPU.
def _load_features(version_dir: Path, threads: int, device: Device):
    from ensemble.features import LeanTransform

    return LeanTransform.load(version_dir / "workflow")


def _load_xgb(version_dir: Path, threads: int, device: Device):
    if device is Device.GPU:
        from ensemble.gpu import GpuTreeScorer

        return GpuTreeScorer(version_dir)
    from ensemble.models.xgb import XGBScorer

    return XGBScorer(version_dir, threads)


def _load_dlrm_torch(version_dir: Path, threads: int, device: Device):
    from ensemble.models.dlrm_torch import TorchScorer

    return TorchScorer(version_dir, threads, device.value)


def _load_dlrm_tf(version_dir: Path, threads: int, device: Device):
    from ensemble.models.dlrm_tf import TFScorer

    return TFScorer(version_dir, threads)  # TensorFlow places the signature on a visible GPU itself


def _load_blend(version_dir: Path, threads: int, device: Device):
    from ensemble.models.blend import Blender

    return Blender.load(version_dir).with_inputs


def _gpu_step_set(model: Model, fn: Callable[..., object]) -> Callable[..., object]:
    """Adapt a step to ``schema.GPU_STEPS``: features also emits the trees' design matrix; xgb
    reads it (what the FIL backend takes in the GPU configuration)."""
    from ensemble.models.xgb import design_matrix

    if model is Model.FEATURES:
        def features(dense, categorical):
            dense_features, ids = fn(dense, categorical)
            return dense_features, ids, design_matrix(dense_features, ids)
        return features
    if model is Model.XGB:
        n_dense = schema.N_DENSE
        return lambda x: fn(x[:, :n_dense], x[:, n_dense:].astype(np.int64))
    return fn


LOADERS: dict[Model, Callable[[Path, int, Device], Callable[..., object]]] = {
    Model.FEATURES: _load_features,
    Model.XGB: _load_xgb,
    Model.DLRM_TORCH: _load_dlrm_torch,
    Model.DLRM_TF: _load_dlrm_tf,
    Model.BLEND: _load_blend,
}


def load_step(model: Model | str, version_dir: str | Path, threads: int = 1, steps: str = "cpu",
              device: Device | str = Device.CPU) -> StepRunner:
    """Verify a version folder against its manifest and load its step.

    Args:
        steps: "cpu" for ``schema.STEPS``, "gpu" for ``schema.GPU_STEPS`` (the tensors of the
            GPU configuration; set by its ``steps`` parameter).
        device: where the step computes (see :mod:`ensemble.gpu`).
    """
    model = Model(model)
    version_dir = Path(version_dir)
    manifest.verify(version_dir, model)
    fn = LOADERS[model](version_dir, threads, Device(device))
    if steps == "gpu":
        return StepRunner(schema.GPU_STEPS[model], _gpu_step_set(model, fn))
    if steps != "cpu":
        raise ValueError(f"steps must be 'cpu' or 'gpu', not {steps!r}")
    return StepRunner(schema.STEPS[model], fn)


def latest_version(model_dir: Path) -> Path:
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    if not versions:
        raise FileNotFoundError(f"no version folder in {model_dir}")
    return max(versions, key=lambda p: int(p.name))


class Pipeline:
    """The ensemble's chain in one process: features -> three models -> blend.

    The reference for parity tests and the ``--local`` path: it loads the latest version of
    each model from the same repository that Triton serves.
    """

    def __init__(self, steps: Mapping[Model, StepRunner]):
        self.steps = dict(steps)

    @classmethod
    def from_repository(cls, repository: str | Path, threads: int = 2,
                        device: Device | str = Device.CPU) -> "Pipeline":
        """Load the latest version of every step; ``device="gpu"`` runs the trees (FIL or XGBoost
        CUDA) and the torch DLRM on the GPU (``ensemble.gpu.resolve_device`` maps ``auto``)."""
        repository = Path(repository)
        return cls({m: load_step(m, latest_version(repository / m.value), threads, device=device)
                    for m in LOADERS})

    def score(self, dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
        """Score a batch.

        Args:
            dense: [B x 13] float32 raw integer features (NaN = missing).
            categorical: [B x 26] object array of bytes (b"" = missing).

        Returns:
            ``score`` and the per-model scores, each [B x 1] float32, keyed by tensor name.
        """
        tensors: dict[str, np.ndarray] = {schema.DENSE.name: np.asarray(dense, np.float32),
                                          schema.CATEGORICAL.name: np.asarray(categorical, object)}
        for model in (Model.FEATURES, Model.XGB, Model.DLRM_TORCH, Model.DLRM_TF, Model.BLEND):
            tensors.update(self.steps[model].run(tensors))
        return {t.name: tensors[t.name] for t in schema.RANKER_OUTPUTS}


def model_parameters(model_config_json: str) -> dict[str, str]:
    """``parameters`` of a Triton model config (as the python backend passes it) -> dict."""
    config = json.loads(model_config_json)
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
