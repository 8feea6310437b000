"""The one place that names columns, Triton models, tensors, dtypes and shapes.

Configs, model.py, the in-process pipeline, clients and tests import these names; no other
module spells a tensor name as a string literal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

N_DENSE = 13
N_CATEGORICAL = 26

LABEL = "label"
DENSE_COLUMNS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, N_DENSE + 1))
CATEGORICAL_COLUMNS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, N_CATEGORICAL + 1))
# Column order of a Criteo TSV line.
CRITEO_COLUMNS: tuple[str, ...] = (LABEL, *DENSE_COLUMNS, *CATEGORICAL_COLUMNS)

# Largest batch any model in the repository accepts (rows per request or per dynamic batch).
MAX_BATCH_SIZE = 8192


class Priority(enum.IntEnum):
    """A request's Triton priority level (1 is served first; 0 on the wire means the model's
    default). Clients mark batch scoring for servers whose models have priority levels; the CPU
    layouts here have none (Triton then treats every request alike: see the overload note in
    :mod:`ensemble.repository.configs`)."""

    INTERACTIVE = 1  # one user waiting for a ranking
    BATCH = 2  # batch scoring: large requests that may wait for seconds


class DType(str, enum.Enum):
    """Triton data types used here, with their numpy counterparts."""

    FP32 = "TYPE_FP32"
    INT64 = "TYPE_INT64"
    STRING = "TYPE_STRING"

    @property
    def numpy(self) -> str:
        return {"TYPE_FP32": "float32", "TYPE_INT64": "int64", "TYPE_STRING": "object"}[self.value]

    @property
    def wire(self) -> str:
        """The name tritonclient uses (``FP32``, ``INT64``, ``BYTES``)."""
        return {"TYPE_FP32": "FP32", "TYPE_INT64": "INT64", "TYPE_STRING": "BYTES"}[self.value]


@dataclass(frozen=True)
class Tensor:
    """A batched tensor: ``dims`` excludes the batch dimension."""

    name: str
    dtype: DType
    dims: tuple[int, ...]


class Model(str, enum.Enum):
    """Models in the Triton repository."""

    FEATURES = "features"
    XGB = "xgb"
    DLRM_TORCH = "dlrm_torch"
    DLRM_TF = "dlrm_tf"
    BLEND = "blend"
    RANKER = "ranker"


# The client contract of the ensemble `ranker`.
DENSE = Tensor("dense", DType.FP32, (N_DENSE,))  # raw integer features, NaN = missing
CATEGORICAL = Tensor("categorical", DType.STRING, (N_CATEGORICAL,))  # hex strings, "" = missing
SCORE = Tensor("score", DType.FP32, (1,))
SCORE_XGB = Tensor("score_xgb", DType.FP32, (1,))
SCORE_DLRM_TORCH = Tensor("score_dlrm_torch", DType.FP32, (1,))
SCORE_DLRM_TF = Tensor("score_dlrm_tf", DType.FP32, (1,))

# Between the steps of the ensemble. The per-model probabilities travel under their own
# names and the blend step re-emits them as the ensemble outputs: a tensor that is both an
# ensemble output and another step's input deadlocks Triton's ensemble scheduler when the
# client asks for `score` alone (seen with tritonserver 2.51).
DENSE_FEATURES = Tensor("dense_features", DType.FP32, (N_DENSE,))  # normalized
CATEGORY_IDS = Tensor("category_ids", DType.INT64, (N_CATEGORICAL,))  # Categorify ids
PROB_XGB = Tensor("prob_xgb", DType.FP32, (1,))
PROB_DLRM_TORCH = Tensor("prob_dlrm_torch", DType.FP32, (1,))
PROB_DLRM_TF = Tensor("prob_dlrm_tf", DType.FP32, (1,))

RANKER_INPUTS: tuple[Tensor, ...] = (DENSE, CATEGORICAL)
RANKER_OUTPUTS: tuple[Tensor, ...] = (SCORE, SCORE_XGB, SCORE_DLRM_TORCH, SCORE_DLRM_TF)

# Each scoring model's output, and the ensemble output that carries it.
MODEL_SCORES: dict[Model, tuple[Tensor, Tensor]] = {
    Model.XGB: (PROB_XGB, SCORE_XGB),
    Model.DLRM_TORCH: (PROB_DLRM_TORCH, SCORE_DLRM_TORCH),
    Model.DLRM_TF: (PROB_DLRM_TF, SCORE_DLRM_TF),
}


@dataclass(frozen=True)
class Step:
    """One composing model: its inputs and outputs."""

    model: Model
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


STEPS: dict[Model, Step] = {
    Model.FEATURES: Step(Model.FEATURES, (DENSE, CATEGORICAL), (DENSE_FEATURES, CATEGORY_IDS)),
    Model.XGB: Step(Model.XGB, (DENSE_FEATURES, CATEGORY_IDS), (PROB_XGB,)),
    Model.DLRM_TORCH: Step(Model.DLRM_TORCH, (DENSE_FEATURES, CATEGORY_IDS), (PROB_DLRM_TORCH,)),
    Model.DLRM_TF: Step(Model.DLRM_TF, (DENSE_FEATURES, CATEGORY_IDS), (PROB_DLRM_TF,)),
    Model.BLEND: Step(Model.BLEND, (PROB_XGB, PROB_DLRM_TORCH, PROB_DLRM_TF), RANKER_OUTPUTS),
}

# The fused CPU layout: the ranker is one model running every step.
FUSED_STEP = Step(Model.RANKER, RANKER_INPUTS, RANKER_OUTPUTS)

# The GPU configuration serves the trees on Triton's FIL backend, which takes exactly one FP32
# input (`input__0`, [n_features]). The features step therefore also emits the trees' design
# matrix (13 normalized dense features, then the 26 category ids as floats: see
# ensemble.models.xgb.design_matrix) and xgb reads that instead of the two tensors above.
# These two steps are the only ones whose tensors differ between the CPU and GPU configurations.
XGB_FEATURES = Tensor("xgb_features", DType.FP32, (N_DENSE + N_CATEGORICAL,))

GPU_STEPS: dict[Model, Step] = {
    **STEPS,
    Model.FEATURES: Step(Model.FEATURES, (DENSE, CATEGORICAL), (DENSE_FEATURES, CATEGORY_IDS, XGB_FEATURES)),
    Model.XGB: Step(Model.XGB, (XGB_FEATURES,), (PROB_XGB,)),
}

# Triton's v2 inference endpoint of the ranker (HTTP), as clients, probes and baselines call it.
RANKER_INFER_PATH = f"/v2/models/{Model.RANKER.value}/infer"

# How the fused ranker's refusals begin (HTTP 503 / gRPC UNAVAILABLE; ensemble/serving/admission.py):
# load shedding, retryable, not a fault. The rest says why: the request would miss its deadline (by
# how much, and what set it), or the ranker is at capacity and keeps its calls short.
OVERLOAD_REFUSAL = "refused: "

# A request parameter (``"bulk": true``) batch scoring sets on its requests: the fused ranker then
# holds such a request to its client's timeout only, never to the server's latency objective, and
# scores it after the interactive requests of the same call.
BULK_PARAMETER = "bulk"


def v2_json_request(dense, categorical, outputs: tuple[str, ...] = (SCORE.name,)) -> bytes:
    """The ranker's v2 JSON inference body.

    Args:
        dense: [B x 13] float array (NaN = missing; json.dumps writes bare NaN, which Triton's
            parser takes).
        categorical: [B x 26] array of bytes (b"" = missing; sent as UTF-8 text).
        outputs: the output tensors to ask for.
    """
    import json

    return json.dumps({
        "inputs": [{"name": DENSE.name, "shape": list(dense.shape), "datatype": DENSE.dtype.wire,
                    "data": dense.ravel().tolist()},
                   {"name": CATEGORICAL.name, "shape": list(categorical.shape), "datatype": CATEGORICAL.dtype.wire,
                    "data": [v.decode("utf-8", "replace") for v in categorical.ravel()]}],
        "outputs": [{"name": name} for name in outputs]}).encode()
