"""The one place that names columns, Triton models, tensors, dtypes and shapes.

Configs, model.py, the in-process pipeline, clients and tests import these names; no other
module spells a tensor name as a string literal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ensemble import dataset

# The built-in default dataset (ensemble/datasets/criteo.toml): I1..I13 continuous, C1..C26
# categorical. Other datasets describe their columns in a spec of their own (ensemble.dataset).
CRITEO = dataset.load_spec(dataset.DEFAULT)

LABEL = CRITEO.label
DENSE_COLUMNS: tuple[str, ...] = CRITEO.continuous
CATEGORICAL_COLUMNS: tuple[str, ...] = CRITEO.categorical
N_DENSE = len(DENSE_COLUMNS)
N_CATEGORICAL = len(CATEGORICAL_COLUMNS)
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


_NUMPY_TYPES = {"TYPE_FP32": "float32", "TYPE_INT32": "int32", "TYPE_INT64": "int64", "TYPE_STRING": "object"}


class DType(str, enum.Enum):
    """Triton data types used here, with their numpy counterparts."""

    FP32 = "TYPE_FP32"
    INT32 = "TYPE_INT32"
    INT64 = "TYPE_INT64"
    STRING = "TYPE_STRING"

    @property
    def numpy(self) -> str:
        return _NUMPY_TYPES[self.value]

    @property
    def wire(self) -> str:
        """The name tritonclient uses (``FP32``, ``INT32``, ``INT64``, ``BYTES``)."""
        return self.value.removeprefix("TYPE_").replace("STRING", "BYTES")


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


# The client contract of the `ranker`.
DENSE = Tensor("dense", DType.FP32, (N_DENSE,))  # raw integer features, NaN = missing
CATEGORICAL = Tensor("categorical", DType.STRING, (N_CATEGORICAL,))  # hex strings, "" = missing
SCORE = Tensor("score", DType.FP32, (1,))
SCORE_XGB = Tensor("score_xgb", DType.FP32, (1,))
SCORE_DLRM_TORCH = Tensor("score_dlrm_torch", DType.FP32, (1,))
SCORE_DLRM_TF = Tensor("score_dlrm_tf", DType.FP32, (1,))

# Between the steps (in the GPU layout, of its Triton ensemble). The per-model probabilities travel
# under their own names and the blend step re-emits them as the ranker's outputs: a tensor that is both
# an ensemble output and another step's input deadlocks Triton's ensemble scheduler when the
# client asks for `score` alone (seen with tritonserver 2.51, on a CPU ensemble of the same steps).
DENSE_FEATURES = Tensor("dense_features", DType.FP32, (N_DENSE,))  # normalized
CATEGORY_IDS = Tensor("category_ids", DType.INT64, (N_CATEGORICAL,))  # Categorify ids
PROB_XGB = Tensor("prob_xgb", DType.FP32, (1,))
PROB_DLRM_TORCH = Tensor("prob_dlrm_torch", DType.FP32, (1,))
PROB_DLRM_TF = Tensor("prob_dlrm_tf", DType.FP32, (1,))

RANKER_INPUTS: tuple[Tensor, ...] = (DENSE, CATEGORICAL)
RANKER_OUTPUTS: tuple[Tensor, ...] = (SCORE, SCORE_XGB, SCORE_DLRM_TORCH, SCORE_DLRM_TF)

# Each scoring model's output, and the ranker's output that carries it.
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

@dataclass(frozen=True)
class Widths:
    """How many continuous and categorical columns a dataset has (its spec's): the tensors above
    carry Criteo's (13 and 26); :func:`sized` gives them another dataset's. ``context_dense`` and
    ``context_categorical``: how many of each are the context's (the leading columns), which a
    ranking request sends once. ``category_ids``: the width of the ids the features step hands the
    models (``categorical`` plus the extra slots of multi-hot columns; 0: the same as
    ``categorical``)."""

    dense: int
    categorical: int
    context_dense: int = 0
    context_categorical: int = 0
    category_ids: int = 0

    def __post_init__(self):
        if self.category_ids == self.categorical:  # one form per width: equal Widths compare equal
            object.__setattr__(self, "category_ids", 0)

    @classmethod
    def of(cls, spec: dataset.DatasetSpec) -> "Widths":
        return cls(len(spec.continuous), len(spec.categorical), spec.context_width(dataset.Kind.CONTINUOUS),
                   spec.context_width(dataset.Kind.CATEGORICAL), len(spec.model_categorical))

    @property
    def ids(self) -> int:
        return self.category_ids or self.categorical

    def dims(self, tensor: Tensor) -> tuple[int, ...]:
        if tensor.name in (DENSE.name, DENSE_FEATURES.name):
            return (self.dense,)
        if tensor.name == CATEGORICAL.name:
            return (self.categorical,)
        if tensor.name == CATEGORY_IDS.name:
            return (self.ids,)
        if tensor.name == XGB_FEATURES.name:
            return (self.dense + self.ids,)
        return tensor.dims


CRITEO_WIDTHS = Widths.of(CRITEO)


def sized(step: Step, widths: Widths) -> Step:
    """``step`` with its tensors' dims for a dataset of these widths."""
    if (widths.dense, widths.categorical, widths.ids) == (CRITEO_WIDTHS.dense, CRITEO_WIDTHS.categorical,
                                                          CRITEO_WIDTHS.ids):
        return step
    resize = lambda tensors: tuple(Tensor(t.name, t.dtype, widths.dims(t)) for t in tensors)  # noqa: E731
    return Step(step.model, resize(step.inputs), resize(step.outputs))


def widths_of_config(config: dict) -> Widths:
    """The widths a model config (Triton's JSON form) declares, from whichever of the dense and
    categorical tensors it has (Criteo's for a config with neither: the blend)."""
    found = {t["name"]: int(t["dims"][-1]) for t in (*config.get("input", []), *config.get("output", []))
             if t.get("dims")}
    dense = found.get(DENSE.name, found.get(DENSE_FEATURES.name, CRITEO_WIDTHS.dense))
    categorical = found.get(CATEGORICAL.name, found.get(CATEGORY_IDS.name, CRITEO_WIDTHS.categorical))
    ids = found.get(CATEGORY_IDS.name, 0)
    return Widths(dense, categorical, category_ids=ids)


# Ranking requests: the ``rank`` model takes one context and N candidates, broadcasts the context
# onto every candidate, has the ranker score the N rows, and answers each candidate's scores and the
# candidates' order, best first (the first ``top_k`` when given). Not batched across requests
# (max_batch_size 0): the candidate list is the batch. The context tensors exist when the dataset's
# spec has context columns.
RANK_MODEL = "rank"
CONTEXT_DENSE = Tensor("context_dense", DType.FP32, (0,))  # dims: (context continuous columns,)
CONTEXT_CATEGORICAL = Tensor("context_categorical", DType.STRING, (0,))
CANDIDATE_DENSE = Tensor("candidate_dense", DType.FP32, (-1, 0))  # dims: (N, candidate continuous columns)
CANDIDATE_CATEGORICAL = Tensor("candidate_categorical", DType.STRING, (-1, 0))
TOP_K = Tensor("top_k", DType.INT32, (1,))  # optional; absent or 0: every candidate
ORDER = Tensor("order", DType.INT32, (-1,))  # candidate indices, best first
CANDIDATE_SCORES = Tensor("scores", DType.FP32, (-1,))  # the blended score of every candidate, in input order
# Ranking by ids (ensemble/online/): the user (the spec's context key) and the items (its candidate key)
# instead of their features, which the rank model reads from the online store. ``dropped``: the indices
# of the item ids the store does not hold, when the server drops unknown items (their scores are NaN and
# they are not in ``order``); empty otherwise.
USER_ID = Tensor("user_id", DType.STRING, (1,))
ITEM_IDS = Tensor("item_ids", DType.STRING, (-1,))
DROPPED = Tensor("dropped", DType.INT32, (-1,))


def rank_tensors(widths: Widths) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The ``rank`` model's inputs and outputs for a dataset of these widths."""
    inputs = []
    if widths.context_dense:
        inputs.append(Tensor(CONTEXT_DENSE.name, DType.FP32, (widths.context_dense,)))
    if widths.context_categorical:
        inputs.append(Tensor(CONTEXT_CATEGORICAL.name, DType.STRING, (widths.context_categorical,)))
    inputs.append(Tensor(CANDIDATE_DENSE.name, DType.FP32, (-1, widths.dense - widths.context_dense)))
    inputs.append(Tensor(CANDIDATE_CATEGORICAL.name, DType.STRING, (-1, widths.categorical - widths.context_categorical)))
    inputs += [TOP_K, USER_ID, ITEM_IDS]
    return tuple(inputs), (CANDIDATE_SCORES, ORDER, DROPPED)


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

# The ``rank`` model's config parameter bounding a ranking request's candidates (by default the
# ranker's max_batch_size: a ranking request is then no more work than the largest ranker request).
MAX_CANDIDATES_PARAMETER = "max_candidates"


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
