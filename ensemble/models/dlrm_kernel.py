"""Either DLRM's forward pass through one C call (``ensemble/native/_dlrm.c``), with the weights read
from the exported model itself.

The scorers (:class:`ensemble.models.dlrm_torch.TorchScorer`) use it on the CPU when the extension
was built and the weights could be read, after checking at load that it gives the framework's own
scores on a sample batch (within :data:`AGREEMENT`); otherwise they keep the framework.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

try:
    from ensemble.native import _dlrm
except ImportError:  # built without a C compiler: the frameworks score
    _dlrm = None

LOG = logging.getLogger(__name__)

# How far the kernel may be from the framework on the load-time sample (float32 sums in another order).
AGREEMENT = 1e-5


@dataclass(frozen=True)
class DLRMWeights:
    """A DLRM's weights in the kernel's layout.

    Attributes:
        bottom, top: per layer (weights [in x out], bias [out]), float32.
        table: the stacked embedding table [rows x dim]; ``offsets``: each column's first row.
        pair_i, pair_j: the vectors (0 = the bottom MLP's output, c + 1 = column c's embedding) of
            each interaction output, in the model's order.
    """

    bottom: tuple[tuple[np.ndarray, np.ndarray], ...]
    table: np.ndarray
    offsets: np.ndarray
    pair_i: np.ndarray
    pair_j: np.ndarray
    top: tuple[tuple[np.ndarray, np.ndarray], ...]

    @functools.cached_property
    def _forward(self):
        """The C forward pass with these arrays taken and checked once and held (each call then takes
        only its rows); built on the first call, so shapes that do not chain raise there (ValueError)."""
        return _dlrm.Weights(self.bottom, self.table, self.offsets, self.pair_i, self.pair_j, self.top)

    @property
    def native(self):
        """The ``_dlrm.Weights`` object the C forward pass runs on (what a C caller hands ``_dlrm``'s entry
        points, ``ensemble/native/api.h``)."""
        return self._forward

    def into(self, dense_features: np.ndarray, category_ids: np.ndarray, out: np.ndarray) -> None:
        """:meth:`__call__` into ``out`` (B float32), for C-contiguous float32 / int64 inputs as they are."""
        self._forward(dense_features, category_ids, out)

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        """[B x 13] float32, [B x 26] int64 -> [B x 1] float32 probabilities."""
        dense = np.ascontiguousarray(dense_features, dtype=np.float32)
        out = np.empty((len(dense), 1), dtype=np.float32)
        self._forward(dense, np.ascontiguousarray(category_ids, dtype=np.int64), out)
        return out

    @classmethod
    def from_tflite(cls, interpreter) -> "DLRMWeights | None":
        try:
            return _from_tflite(interpreter)
        except (KeyError, ValueError, AttributeError, RuntimeError) as exc:  # a graph of another shape
            LOG.warning("dlrm_tf: weights not read from the TFLite model (%s); LiteRT scores", exc)
            return None

    @classmethod
    def from_torchscript(cls, module) -> "DLRMWeights | None":
        """From a frozen TorchScript DLRM (:func:`ensemble.models.dlrm_torch.save`): its graph's
        constants, found by the operators that use them. None when the graph is not that shape."""
        constants = {}
        for node in module.graph.nodes():
            if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType":
                constants[node.output().debugName()] = node.t("value").detach().cpu().numpy()
        linears, table, offsets, pairs, seen_interaction = ([], []), None, None, None, False
        for node in module.graph.nodes():
            names = [i.debugName() for i in node.inputs()]
            kind = node.kind()
            if kind == "aten::linear":
                weight, bias = constants.get(names[1]), constants.get(names[2])
                if weight is None or bias is None:
                    return None
                linears[seen_interaction].append((np.ascontiguousarray(weight.T, np.float32),
                                                  np.ascontiguousarray(bias, np.float32)))
            elif kind == "aten::embedding":
                table = constants.get(names[0])
            elif kind == "aten::add" and names[1] in constants:
                offsets = constants[names[1]]
            elif kind == "aten::index_select":
                pairs = constants.get(names[2])
            elif kind == "aten::bmm":
                seen_interaction = True
        if table is None or offsets is None or pairs is None or not all(linears):
            return None
        vectors = len(offsets) + 1
        return cls(tuple(linears[0]), np.ascontiguousarray(table, np.float32), np.ascontiguousarray(offsets, np.int64),
                   np.ascontiguousarray(pairs // vectors, np.int32), np.ascontiguousarray(pairs % vectors, np.int32),
                   tuple(linears[1]))


def _from_tflite(interpreter) -> "DLRMWeights | None":
    """From the Keras DLRM's TFLite conversion (:func:`ensemble.models.dlrm_tf.write_tflite`): the
    constants its operators read. The ids are shifted by ``ids - c`` (so the offsets are ``-c``); the
    pairs are a gather from the flattened [(F+1) x (F+1)] products."""
    interpreter.allocate_tensors()  # constants are readable once the interpreter has its buffers
    details = {d["index"]: d for d in interpreter.get_tensor_details()}
    ids_input = {d["index"] for d in interpreter.get_input_details() if len(d["shape"]) == 2 and
                 np.issubdtype(d["dtype"], np.integer)}
    linears, table, offsets, pairs, seen_interaction = ([], []), None, None, None, False
    for op in interpreter._get_ops_details():  # LiteRT's listing of the model's operators
        name, inputs = op["op_name"], [i for i in op["inputs"] if i >= 0]
        if name == "FULLY_CONNECTED" and len(inputs) in (2, 3):  # the converter drops an all-zero bias
            weight = interpreter.get_tensor(inputs[1])
            bias = interpreter.get_tensor(inputs[2]) if len(inputs) == 3 else np.zeros(len(weight), np.float32)
            linears[seen_interaction].append((np.ascontiguousarray(weight.T, np.float32),
                                              np.ascontiguousarray(bias.reshape(-1), np.float32)))
        elif name == "GATHER" and len(details[inputs[1]]["shape"]) == 1:  # constant indices: the pairs
            pairs = interpreter.get_tensor(inputs[1])
        elif name == "GATHER" and details[inputs[0]]["dtype"] == np.float32:  # rows of the table by id
            table = interpreter.get_tensor(inputs[0])
        elif name == "SUB" and inputs[0] in ids_input:
            offsets = -interpreter.get_tensor(inputs[1]).astype(np.int64)
        elif name == "BATCH_MATMUL":
            seen_interaction = True
    if table is None or offsets is None or pairs is None or not all(linears):
        return None
    vectors = len(offsets) + 1
    return DLRMWeights(tuple(linears[0]), np.ascontiguousarray(table, np.float32),
                       np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(pairs // vectors, np.int32),
                       np.ascontiguousarray(pairs % vectors, np.int32), tuple(linears[1]))


def checked(weights: DLRMWeights | None, reference, name: str, rows: int = 64,
            seed: int = 0) -> DLRMWeights | None:
    """``weights`` when the kernel reproduces ``reference(dense, ids)`` on a random batch within
    :data:`AGREEMENT`, else None (logged): the framework keeps scoring."""
    if _dlrm is None or weights is None:
        return None
    rng = np.random.default_rng(seed)
    n_dense = weights.bottom[0][0].shape[0]  # the bottom MLP's first layer is [n_dense x width]
    dense = rng.normal(size=(rows, n_dense)).astype(np.float32)
    ids = np.stack([rng.integers(0, max(int(c), 1), rows) for c in cardinalities(weights)], axis=1).astype(np.int64)
    try:
        gap = float(np.abs(weights(dense, ids).ravel() - np.asarray(reference(dense, ids)).ravel()).max())
    except (ValueError, TypeError) as exc:
        LOG.warning("%s: the C forward pass could not run (%s); the framework scores", name, exc)
        return None
    if not gap <= AGREEMENT:
        LOG.warning("%s: the C forward pass differs from the framework by %.2g; the framework scores", name, gap)
        return None
    return weights


def cardinalities(weights: DLRMWeights) -> np.ndarray:
    """Each column's table size (from the offsets and the stacked table's rows)."""
    return np.diff(np.append(weights.offsets, len(weights.table)))


def available() -> bool:
    """Built, and this CPU runs its vectorized kernels (the baseline build is slower than the frameworks)."""
    return _dlrm is not None and _dlrm.vectorized()

