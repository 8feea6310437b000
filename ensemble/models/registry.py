"""One object per composing model: its tensors, artifacts, loader and GPU serving.

Everything that differs between the five steps of the ranker lives here; the config builder
(:mod:`ensemble.repository.configs`), export, the in-process pipeline and the serving ``model.py`` iterate
over :data:`COMPONENTS` in order (features first, blend last). Adding a model is one module
under ``ensemble/models`` (train, save, a scorer) plus one entry below.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ensemble import schema
from ensemble.base.device import Device
from ensemble.models import artifacts
from ensemble.models.triton_releases import TritonRelease
from ensemble.schema import Model

# A loader takes (version folder, threads, device) and returns the step's function:
# numpy inputs in ``step.inputs`` order -> one array or a tuple in ``step.outputs`` order.
Loader = Callable[[Path, int, Device], Callable[..., object]]


class Layout(str, enum.Enum):
    """How the ranker is laid out in Triton; each layout has its own config file per model.

    FUSED: CPU, ``ranker`` is one python-backend model running the five steps in one process.
    NATIVE: CPU, ``ranker`` is one model of the project's own backend (``libtriton_native.so``), which
        runs the same five steps inside Triton's process (:mod:`ensemble.serving.embedded`).
    GPU: the NGC container, a Triton ensemble of five models: FIL, libtorch and TensorFlow backends plus
        python features/blend.
    """

    FUSED = "fused"
    NATIVE = "native"
    GPU = "gpu"


@dataclass(frozen=True)
class GpuServing:
    """How the GPU layout serves a component.

    Attributes:
        backend / platform: Triton backend (one of the two is set).
        on_gpu: instances on the GPU (KIND_GPU) or on the CPU (KIND_CPU).
        input_names / output_names: the backend's names for the step's tensors, in step order
            (empty: the schema names).
        parameters: backend parameters for a given container release.
    """

    backend: str = ""
    platform: str = ""
    on_gpu: bool = False
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    parameters: Callable[[TritonRelease], tuple[tuple[str, str], ...]] = lambda release: ()


@dataclass(frozen=True)
class Component:
    """A composing model of the ranker.

    Attributes:
        model: its Triton name.
        artifacts: what training leaves in ``<workdir>/models/<model>/`` (for features: the
            workflow folder) and export copies into the version folder under the same names.
        load: :data:`Loader` for serving and the in-process pipeline.
        gpu: how the GPU layout serves it.
        finish: export hook run on the staged version folder (derived artifacts), or None.
        optional: what training may leave beside the artifacts, copied when it did (a row store's MLP
            weights and touched rows, :mod:`ensemble.tables`).
    """

    model: Model
    artifacts: tuple[str, ...]
    load: Loader
    gpu: GpuServing
    finish: Callable[[Path], object] | None = None
    optional: tuple[str, ...] = ()

    def step(self, layout: Layout = Layout.NATIVE) -> schema.Step:
        """The tensors this component reads and writes in a layout."""
        return (schema.GPU_STEPS if layout is Layout.GPU else schema.STEPS)[self.model]

    def adapt(self, fn: Callable[..., object], layout: Layout, n_dense: int = schema.N_DENSE) -> Callable[..., object]:
        """Wrap a loaded step so it reads/writes the layout's tensors (see ``schema.GPU_STEPS``):
        in the GPU layout features also emits the trees' design matrix and xgb reads it."""
        if layout is not Layout.GPU:
            return fn
        from ensemble.models.xgb import design_matrix

        if self.model is Model.FEATURES:
            def features(dense, categorical):
                dense_features, ids = fn(dense, categorical)
                return dense_features, ids, design_matrix(dense_features, ids)
            return features
        if self.model is Model.XGB:  # the design matrix: the dataset's dense columns, then the ids
            return lambda x: fn(x[:, :n_dense], x[:, n_dense:].astype(np.int64))
        return fn


# Loaders import their framework lazily: each python-backend process loads only its own.
def _load_features(version_dir: Path, threads: int, device: Device):
    from ensemble.features.transforms import LeanTransform

    return LeanTransform.load(version_dir / artifacts.WORKFLOW)


def _load_xgb(version_dir: Path, threads: int, device: Device):
    if device is Device.GPU:
        from ensemble.models.xgb_gpu import GpuTreeScorer

        return GpuTreeScorer(version_dir)
    from ensemble.models.xgb import TreeScorer

    return TreeScorer(version_dir, threads)


def _load_row_store(version_dir: Path, step: str, threads: int, device: Device):
    """A DLRM whose tables are a row store's (:mod:`ensemble.tables`): its rows from RAM and disk, on the CPU."""
    if device is Device.GPU:
        raise RuntimeError(f"{version_dir}: {step} keeps its tables in a row store, which serves on the CPU only "
                           "(docs/tables.md#past-one-machine-and-on-a-gpu says how a GPU cache would sit in front of it)")
    from ensemble.tables.serving import TableScorer

    return TableScorer(version_dir, step, max(threads, 2))


def _load_dlrm_torch(version_dir: Path, threads: int, device: Device):
    from ensemble.tables.files import has_tables

    if has_tables(version_dir):
        return _load_row_store(version_dir, Model.DLRM_TORCH.value, threads, device)
    from ensemble.models.dlrm_torch import TorchScorer

    return TorchScorer(version_dir, threads, device)


def _load_dlrm_tf(version_dir: Path, threads: int, device: Device):
    from ensemble.tables.files import has_tables

    if has_tables(version_dir):
        return _load_row_store(version_dir, Model.DLRM_TF.value, threads, device)
    from ensemble.models.dlrm_tf import TFScorer

    # TensorFlow Lite on the CPU in every in-process path, --device gpu included (its per-call cost
    # is below a GPU round trip's); the GPU layout serves the SavedModel on Triton's TF backend.
    return TFScorer(version_dir, threads)


def _load_blend(version_dir: Path, threads: int, device: Device):
    from ensemble.models.blend import Blender

    return Blender.load(version_dir).with_inputs


def _finish_xgb(staging: Path) -> None:
    from ensemble.models import xgb

    xgb.write_fil_checkpoint(staging)  # what the GPU layout's FIL backend loads


def _finish_dlrm_tf(staging: Path) -> None:
    from ensemble.models import dlrm_tf, engines
    from ensemble.tables import training

    if training.has_touched(staging):  # a row store's DLRM: its tables written, its MLPs' engine chosen
        from ensemble.tables import release

        release.finish(staging, Model.DLRM_TF.value)
        return
    dlrm_tf.write_tflite(staging)  # what the CPU layouts run; the GPU layout serves the SavedModel
    engines.finish(staging, Model.DLRM_TF.value, lambda: dlrm_tf.TFScorer(staging))  # the CPU engine, by measurement


def _finish_dlrm_torch(staging: Path) -> None:
    from ensemble.models import dlrm_torch, engines
    from ensemble.tables import training

    if training.has_touched(staging):  # a row store's DLRM: its tables written, its MLPs' engine chosen
        from ensemble.tables import release

        release.finish(staging, Model.DLRM_TORCH.value)
        return
    engines.finish(staging, Model.DLRM_TORCH.value, lambda: dlrm_torch.TorchScorer(staging))  # the CPU engine, by measurement


def _fil_parameters(release: TritonRelease) -> tuple[tuple[str, str], ...]:
    """FIL settings for a binary:logistic booster returning P(click) as one float per row.

    Not a classifier and no predict_proba: FIL then returns the model's transformed output
    (sigmoid of the margin), shape [1]; predict_proba would return [2] (1 - p, p) and
    output_class without it the thresholded class (fil_backend src/tl_model.h, qa/L0_e2e).
    """
    return (("model_type", "treelite_checkpoint"), (release.fil_classifier_key, "false"),
            ("predict_proba", "false"))


def _indexed(tensors: tuple[schema.Tensor, ...]) -> tuple[str, ...]:
    """libtorch's ``<name>__<index>`` convention: the index is the forward() argument position."""
    return tuple(f"{t.name}__{i}" for i, t in enumerate(tensors))


_TORCH_STEP = schema.STEPS[Model.DLRM_TORCH]

COMPONENTS: tuple[Component, ...] = (
    Component(Model.FEATURES, (artifacts.WORKFLOW,), _load_features,
              GpuServing(backend="python", parameters=lambda r: (("layout", Layout.GPU.value), ("threads", "1")))),
    Component(Model.XGB, (artifacts.XGB_JSON,), _load_xgb,
              GpuServing(backend="fil", on_gpu=True, input_names=("input__0",), output_names=("output__0",),
                         parameters=_fil_parameters),
              finish=_finish_xgb),
    Component(Model.DLRM_TORCH, (artifacts.TORCHSCRIPT,), _load_dlrm_torch,
              GpuServing(platform="pytorch_libtorch", on_gpu=True, input_names=_indexed(_TORCH_STEP.inputs),
                         output_names=_indexed(_TORCH_STEP.outputs),
                         parameters=lambda r: (("INFERENCE_MODE", "true"),)),
              finish=_finish_dlrm_torch, optional=(artifacts.MLP_WEIGHTS, artifacts.TOUCHED_ROWS)),
    # Keras `model.export` names the signature inputs after the keras.Input names (the schema
    # names) and its single output `output_0`.
    Component(Model.DLRM_TF, (artifacts.SAVEDMODEL,), _load_dlrm_tf,
              GpuServing(platform="tensorflow_savedmodel", on_gpu=True, output_names=(artifacts.SAVEDMODEL_OUTPUT,)),
              finish=_finish_dlrm_tf, optional=(artifacts.TFLITE, artifacts.MLP_WEIGHTS, artifacts.TOUCHED_ROWS)),
    Component(Model.BLEND, (artifacts.BLEND_JSON,), _load_blend,
              GpuServing(backend="python", parameters=lambda r: (("layout", Layout.GPU.value), ("threads", "1")))),
)

BY_MODEL: dict[Model, Component] = {c.model: c for c in COMPONENTS}
# Steps run in this order inside the ranker (features first, blend last).
ORDER: tuple[Model, ...] = tuple(c.model for c in COMPONENTS)


def choose_engines_again(folders: dict, budget: float | None = None) -> list[dict]:
    """Measure again on this machine and rewrite each DLRM step's ``engine.json`` (and its manifest):
    ``ensemble engines --measure``; within :func:`ensemble.models.engines.held_out` the reduced precisions
    are judged on its test rows and int8 is quantized anew. A running server takes the new choice when it
    loads the release again."""
    from ensemble.models import dlrm_tf, dlrm_torch, engines, manifest

    records = []
    for model, folder in folders.items():
        if model.value not in engines.STEPS:
            continue
        manifest.verify(folder, model)
        scorer = dlrm_torch.TorchScorer if model.value == "dlrm_torch" else dlrm_tf.TFScorer
        engines.finish(folder, model.value, lambda: scorer(folder), budget)  # as an export measures it
        manifest.write(folder, model)
        records.append(engines.Recorded.read(folder).record)
    return records
