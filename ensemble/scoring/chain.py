"""The ranker's three models and its blend on the CPU as four direct C calls.

Through the steps (:class:`ensemble.scoring.pipeline.StepRunner`) a batch passes five step wrappers,
five output dictionaries, dtype checks and the trees' design-matrix concatenation before the kernels
see it: ~0.07 ms of Python for a 1-row request against ~0.035 ms in the kernels (build VM, one warm
process). :class:`KernelChain` calls the same kernels on the same arrays in the same order and
writes their scores into one preallocated array, so its answers are the steps' answers bit for bit;
:class:`ensemble.scoring.pipeline.Pipeline` uses it whenever every model scores with its C kernel
(the trees' evaluator, both DLRMs' forward pass, the blender) and checks that at load on a sample.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ensemble import schema
from ensemble.models.blend import Blender
from ensemble.schema import Model
from ensemble import native

try:
    from ensemble.native import _chain
except ImportError:  # built without a C compiler (or without numpy's headers): no chain in C
    _chain = None

# The steps the chain replaces, in the order of the outputs it writes after the blend's.
_MODELS = (Model.XGB, Model.DLRM_TORCH, Model.DLRM_TF)


class KernelChain:
    """``(dense_features [B x D] float32, category_ids [B x C] int64) -> the ranker's outputs``,
    each [B x 1] float32, keyed by name (``schema.RANKER_OUTPUTS``)."""

    def __init__(self, trees, dlrm_torch, dlrm_tf, blender: Blender, n_dense: int):
        self._trees, self._torch, self._tf, self._blender = trees, dlrm_torch, dlrm_tf, blender
        self._n_dense = n_dense

    @classmethod
    def of(cls, steps: Mapping[Model, object], n_dense: int) -> "KernelChain | None":
        """The chain for these loaded steps (``Model`` -> StepRunner), or None when a model does not
        score with its C kernel here (not built, a GPU, a model of another shape) or the steps are
        not the standard ones (names, order): then the steps run as they are."""
        if not native.COMPILED or any(m not in steps for m in (*_MODELS, Model.BLEND)):
            return None
        def names(tensors):
            return tuple(t.name for t in tensors)

        features = (schema.DENSE_FEATURES.name, schema.CATEGORY_IDS.name)
        scores = tuple(names(steps[m].step.outputs) for m in _MODELS)
        if (any(names(steps[m].step.inputs) != features for m in _MODELS) or any(len(s) != 1 for s in scores)
                or names(steps[Model.BLEND].step.inputs) != tuple(s[0] for s in scores)
                or names(steps[Model.BLEND].step.outputs) != names(schema.RANKER_OUTPUTS)):
            return None
        kernels = [getattr(steps[m].fn, "kernel", None) for m in _MODELS]
        blend = steps[Model.BLEND].fn
        blender = getattr(blend, "__self__", None)
        if any(k is None for k in kernels) or not isinstance(blender, Blender) or blend.__name__ != "with_inputs":
            return None
        return cls(*kernels, blender, n_dense)

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> dict[str, np.ndarray]:
        out = self.scores(dense_features, category_ids)
        rows = out.shape[1]
        return {t.name: out[k].reshape(rows, 1) for k, t in enumerate(schema.RANKER_OUTPUTS)}

    def scores(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        """The same outputs as one [outputs x B] float32 array, rows in ``schema.RANKER_OUTPUTS`` order."""
        x = np.ascontiguousarray(dense_features, dtype=np.float32)
        ids = np.ascontiguousarray(category_ids, dtype=np.int64)
        rows = len(x)
        if x.ndim != 2 or x.shape[1] != self._n_dense or ids.ndim != 2 or len(ids) != rows:
            raise ValueError(f"expected [rows x {self._n_dense}] dense features and [rows x columns] ids, "
                             f"got {list(x.shape)} and {list(ids.shape)}")
        design = np.empty((rows, x.shape[1] + ids.shape[1]), np.float32)  # the trees' input: ids as ordinal values
        design[:, :x.shape[1]] = x
        design[:, x.shape[1]:] = ids
        out = np.empty((len(schema.RANKER_OUTPUTS), rows), np.float32)  # blended, then one row per model
        self._trees.into(design, out[1])
        self._torch.into(x, ids, out[2])
        self._tf.into(x, ids, out[3])
        self._blender.into((out[1], out[2], out[3]), out[0])
        return out

    def native(self, transform) -> "object | None":
        """This chain with ``transform`` (a :class:`ensemble.features.transforms.LeanTransform` that reads the
        wire) before it, as one C object (``_chain.Chain``, ``ensemble/native/_chain.c``): raw float32
        dense values and Triton's BYTES wire buffers in, the outputs out, with no Python call, for the
        native backend. None when ``_chain`` or the C vocabulary was not built. Unchecked:
        :attr:`ensemble.scoring.pipeline.Pipeline.c_chain` compares it with the Python chain."""
        from ensemble.features.transforms import OOV_ID

        vocabulary = transform.vocabulary
        if _chain is None or not isinstance(vocabulary, native.Vocabulary) or not native.COMPILED:
            return None
        trees, blender = self._trees, self._blender
        return _chain.Chain(vocabulary, OOV_ID, transform.fill_value, transform.clip_min,
                            np.ascontiguousarray(transform.means, np.float32), transform.safe_stds,
                            trees.node_column, trees.node_threshold, trees.leaves, trees.depth, trees.base_margin,
                            self._torch.native, self._tf.native, tuple(float(w) for w in blender.weights),
                            float(blender.bias), blender.eps)
