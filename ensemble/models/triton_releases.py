"""What each NGC Triton container release ships, as far as the GPU configuration depends on it.

The GPU deployment pins one release (:data:`PINNED`); ``ensemble check --target gpu`` verifies
the repository against that release's row. Every fact below was read from the named source; the
sources are the release branches (``rNN.MM``) of the triton-inference-server repositories.

Backends per release (``backends``):
    server ``build.py``, ``enable_all()``: r25.02 lists ensemble, identity, square, repeat,
    tensorflow, onnxruntime, python, dali, pytorch, openvino, fil, tensorrt; r25.03 drops
    tensorflow (commit 1f6aed23f "merge kmcgill-remove-tf (#8113)"), and no later branch adds it
    back. The ``-py3`` container is built with ``build.py --enable-all``.
Python in the container:
    server ``docs/introduction/compatibility.md`` ("Python 3.12.3" from 24.12 on); build.py
    r25.02 installs ``numpy<2`` into that Python for the python backend and sets
    ``PIP_BREAK_SYSTEM_PACKAGES=1``.
Treelite linked into the FIL backend:
    fil_backend ``cmake/thirdparty/get_treelite.cmake`` ``find_and_configure_treelite(VERSION ...)``:
    4.4.0 in r24.11-r24.12, 4.4.1 in r25.01-r25.12, 4.6.1 in r26.01-r26.05, 4.7.0 in r26.06.
FIL parameters:
    fil_backend ``src/shared_state.h`` ``RapidsSharedState::load()`` and ``src/fil_config.h``:
    up to r25.08 ``output_class`` is required (read without a default), ``algo`` is one of
    ALGO_AUTO/NAIVE/TREE_REORG/BATCH_TREE_REORG, ``storage_type`` one of AUTO/DENSE/SPARSE/SPARSE8;
    from r25.09 ``algo``, ``threads_per_tree``, ``output_class``, ``storage_type`` and
    ``blocks_per_sm`` are removed (warned about and ignored; output_class still honoured) and
    ``is_classifier`` (required), ``layout`` and ``chunk_size`` replace them.
    ``model_type`` (src/serialization.h): xgboost, xgboost_json, xgboost_ubj, lightgbm,
    treelite_checkpoint; default file names (src/model.h ``model_file()``): xgboost.model,
    xgboost.json, xgboost.ubj, model.txt, checkpoint.tl.
libtorch in the PyTorch backend:
    server build.py r25.02 builds it from ``nvcr.io/nvidia/pytorch:25.02-py3``, which NVIDIA's
    PyTorch version table lists as PyTorch 2.7.0a0+6c54963f75; TorchScript archives with file
    format version up to ``kMaxSupportedFileFormatVersion = 0xA`` load
    (caffe2/serialize/versions.h).
TensorFlow in the TensorFlow backend:
    server build.py r25.02 builds it from ``nvcr.io/nvidia/tensorflow:25.02-tf2-py3``
    (TensorFlow 2.17 according to users of that image; NVIDIA's release notes were not read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# FIL parameter -> allowed values (None: any value of the stated kind).
_BOOL = ("true", "false")
_FIL_COMMON: dict[str, tuple[str, ...] | None] = {
    "model_type": ("xgboost", "xgboost_json", "xgboost_ubj", "lightgbm", "treelite_checkpoint"),
    "predict_proba": _BOOL,
    "threshold": None,
    "xgboost_allow_unknown_field": _BOOL,
    "transfer_threshold": None,
    "cpu_nthread": None,
    "use_experimental_optimizations": _BOOL,
}
FIL_PARAMETERS_BEFORE_25_09: dict[str, tuple[str, ...] | None] = {
    **_FIL_COMMON,
    "output_class": _BOOL,
    "algo": ("ALGO_AUTO", "NAIVE", "TREE_REORG", "BATCH_TREE_REORG"),
    "storage_type": ("AUTO", "DENSE", "SPARSE", "SPARSE8"),
    "blocks_per_sm": None,
    "threads_per_tree": None,
}
FIL_PARAMETERS_FROM_25_09: dict[str, tuple[str, ...] | None] = {
    **_FIL_COMMON,
    "is_classifier": _BOOL,
    "layout": ("depth_first", "breadth_first", "layered"),
    "chunk_size": None,
}
FIL_REMOVED_IN_25_09 = ("algo", "threads_per_tree", "output_class", "storage_type", "blocks_per_sm")

FIL_MODEL_FILES = {"xgboost": "xgboost.model", "xgboost_json": "xgboost.json", "xgboost_ubj": "xgboost.ubj",
                   "lightgbm": "model.txt", "treelite_checkpoint": "checkpoint.tl"}

# Triton's `platform` names and the backend that serves each (model_config.proto docs).
PLATFORM_BACKENDS = {"pytorch_libtorch": "pytorch", "tensorflow_savedmodel": "tensorflow",
                     "tensorflow_graphdef": "tensorflow", "onnxruntime_onnx": "onnxruntime",
                     "tensorrt_plan": "tensorrt", "ensemble": "ensemble"}

_BACKENDS_25_02 = frozenset({"ensemble", "identity", "square", "repeat", "tensorflow", "onnxruntime",
                             "python", "dali", "pytorch", "openvino", "fil", "tensorrt"})


@dataclass(frozen=True)
class TritonRelease:
    """One ``nvcr.io/nvidia/tritonserver:<tag>-py3`` release.

    Attributes:
        tag: container release, e.g. "25.02".
        triton_version: the server version it carries.
        python: the container's Python (the python backend stub embeds it).
        backends: backend directories under /opt/tritonserver/backends.
        treelite: Treelite version the FIL backend links.
        fil_parameters: FIL ``parameters`` keys this release reads, with allowed values.
        fil_required: FIL keys read without a default (a missing one fails the model load).
        libtorch: PyTorch version of the pytorch backend (None: not recorded).
        torchscript_max_file_format: newest TorchScript archive version that libtorch reads.
        tensorflow: TensorFlow version of the tensorflow backend (None: no such backend).
    """

    tag: str
    triton_version: str
    python: str
    backends: frozenset[str]
    treelite: str
    fil_parameters: dict[str, tuple[str, ...] | None] = field(repr=False)
    fil_required: tuple[str, ...]
    libtorch: str | None = None
    torchscript_max_file_format: int = 0xA
    tensorflow: str | None = None

    @property
    def image(self) -> str:
        return f"nvcr.io/nvidia/tritonserver:{self.tag}-py3"

    @property
    def fil_classifier_key(self) -> str:
        return "output_class" if "output_class" in self.fil_parameters else "is_classifier"


RELEASES: dict[str, TritonRelease] = {
    "25.02": TritonRelease("25.02", "2.55.0", "3.12.3", _BACKENDS_25_02, "4.4.1",
                           FIL_PARAMETERS_BEFORE_25_09, ("output_class",),
                           libtorch="2.7.0a0+6c54963f75", tensorflow="2.17"),
    "25.03": TritonRelease("25.03", "2.56.0", "3.12.3", _BACKENDS_25_02 - {"tensorflow"}, "4.4.1",
                           FIL_PARAMETERS_BEFORE_25_09, ("output_class",),
                           libtorch="2.7.0a0+7c8ec84dab"),
    "25.09": TritonRelease("25.09", "2.61.0", "3.12.3", _BACKENDS_25_02 - {"tensorflow"}, "4.4.1",
                           FIL_PARAMETERS_FROM_25_09, ("is_classifier",)),
    "26.06": TritonRelease("26.06", "2.70.0", "3.12.3", _BACKENDS_25_02 - {"tensorflow"}, "4.7.0",
                           FIL_PARAMETERS_FROM_25_09, ("is_classifier",)),
}

# 25.02 is the last release whose container still has the TensorFlow backend (dlrm_tf is a
# SavedModel). Its FIL backend links Treelite 4.4.1, which cannot parse XGBoost 3.x JSON, so the
# trees ship as a Treelite checkpoint (see ensemble.models.xgb.write_fil_checkpoint).
PINNED = RELEASES["25.02"]


def backend_of(backend: str, platform: str) -> str:
    """The backend directory a config names, from ``backend`` or else ``platform``."""
    return backend or PLATFORM_BACKENDS.get(platform, platform)
