"""DLRM in TensorFlow/Keras, the same architecture as :mod:`ensemble.models.dlrm_torch`.
Exported as a SavedModel with Keras ``model.export`` (signature output ``output_0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ensemble import schema
from ensemble.models import dlrm_kernel, metrics
from ensemble.models.artifacts import SAVEDMODEL, SAVEDMODEL_OUTPUT, TFLITE
from ensemble.models.dlrm import DLRMConfig, as_source, score_source, table_offsets
from ensemble.base.device import Device
from ensemble.tables.mlp import POOLED_INPUT, MlpWeights

MODEL_DIR = SAVEDMODEL
SIGNATURE_OUTPUT = SAVEDMODEL_OUTPUT


def build(config: DLRMConfig):
    """Return a ``keras.Model``: ``(dense [B x 13] f32, ids [B x 26] i64) -> [B x 1] prob``."""
    import keras
    from keras import layers, ops

    keras.utils.set_random_seed(config.seed)
    d = config.embedding_dim
    # Input names double as SavedModel signature argument names; they must not collide with
    # default layer names (an input called "dense" breaks export).
    dense_in = keras.Input((config.n_dense,), dtype="float32", name=schema.DENSE_FEATURES.name)
    ids_in = keras.Input((len(config.cardinalities),), dtype="int64", name=schema.CATEGORY_IDS.name)
    x = dense_in
    for width in (*config.bottom_mlp, d):
        x = layers.Dense(width, activation="relu")(x)
    bottom = x
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=config.seed)
    # All columns' tables stacked into one (column j's ids shifted by its offset): one gather
    # instead of 26, the same maths (see ensemble.models.dlrm_torch.SparseArch).
    offsets = ops.convert_to_tensor(table_offsets(config.cardinalities))
    table = layers.Embedding(sum(config.cardinalities), d, embeddings_initializer=init, name="embeddings")
    # Written as a subtraction: the TFLite converter turns an int64 `ids + offsets` into an add
    # that TFLite has no int64 kernel for.
    sparse = table(ops.subtract(ids_in, -offsets))  # B x 26 x d
    stacked = ops.concatenate([ops.expand_dims(bottom, 1), sparse], axis=1)  # B x 27 x d
    products = ops.matmul(stacked, ops.transpose(stacked, (0, 2, 1)))  # B x 27 x 27
    n = len(config.cardinalities) + 1
    rows, cols = np.tril_indices(n, k=-1)
    flat = ops.reshape(products, (-1, n * n))
    pairs = ops.take(flat, rows * n + cols, axis=1)  # B x 351
    x = ops.concatenate([bottom, pairs], axis=1)
    for width in config.top_mlp:
        x = layers.Dense(width, activation="relu")(x)
    out = layers.Dense(1, activation="sigmoid", dtype="float32")(x)
    return keras.Model([dense_in, ids_in], out, name="dlrm")


def build_pooled(config: DLRMConfig, n_tables: int):
    """The DLRM without its tables, as :func:`build` but for the embeddings: ``keras.Model``
    ``(dense [B x 13] f32, pooled [B x F*D] f32, the rows a row store gathered) -> [B x 1] prob``."""
    import keras
    from keras import layers, ops

    keras.utils.set_random_seed(config.seed)
    d = config.embedding_dim
    dense_in = keras.Input((config.n_dense,), dtype="float32", name=schema.DENSE_FEATURES.name)
    pooled_in = keras.Input((n_tables * d,), dtype="float32", name=POOLED_INPUT)
    x = dense_in
    for width in (*config.bottom_mlp, d):
        x = layers.Dense(width, activation="relu")(x)
    bottom = x
    sparse = ops.reshape(pooled_in, (-1, n_tables, d))
    stacked = ops.concatenate([ops.expand_dims(bottom, 1), sparse], axis=1)
    products = ops.matmul(stacked, ops.transpose(stacked, (0, 2, 1)))
    n = n_tables + 1
    rows, cols = np.tril_indices(n, k=-1)
    pairs = ops.take(ops.reshape(products, (-1, n * n)), rows * n + cols, axis=1)
    x = ops.concatenate([bottom, pairs], axis=1)
    for width in config.top_mlp:
        x = layers.Dense(width, activation="relu")(x)
    out = layers.Dense(1, activation="sigmoid", dtype="float32")(x)
    return keras.Model([dense_in, pooled_in], out, name="dlrm_pooled")


class PooledFit:
    """The pooled Keras DLRM's MLPs trained with Adam; its rows are a row store's
    (:class:`ensemble.tables.training.TrainingRows`), which each step hands their gradient."""

    def __init__(self, config: DLRMConfig, n_tables: int) -> None:
        import keras
        import tensorflow as tf

        keras.mixed_precision.set_global_policy("float32")
        self.model = build_pooled(config, n_tables)
        self.n_tables, self.dim = n_tables, config.embedding_dim
        self.n_bottom = len(config.bottom_mlp) + 1
        optimizer = keras.optimizers.Adam(config.learning_rate)
        loss_fn = keras.losses.BinaryCrossentropy()
        model, width = self.model, n_tables * config.embedding_dim

        @tf.function(input_signature=[tf.TensorSpec((None, config.n_dense), tf.float32),
                                      tf.TensorSpec((None, config.embedding_dim), tf.float32),
                                      tf.TensorSpec((None, n_tables), tf.int64), tf.TensorSpec((None,), tf.int8)])
        def step(d, unique, where, y):
            y = tf.reshape(tf.cast(y, tf.float32), (-1, 1))
            with tf.GradientTape() as tape:
                tape.watch(unique)
                pooled = tf.reshape(tf.gather(unique, where), (-1, width))
                loss = loss_fn(y, model([d, pooled], training=True))
            grads = tape.gradient(loss, [*model.trainable_variables, unique])
            optimizer.apply_gradients(zip(grads[:-1], model.trainable_variables))
            return tf.convert_to_tensor(grads[-1])  # the gather's slices summed per unique row

        self._step = step

    def step(self, dense: np.ndarray, unique: np.ndarray, where: np.ndarray, labels: np.ndarray) -> np.ndarray:
        return self._step(dense, unique, where, labels).numpy()

    def predict(self, dense: np.ndarray, pooled: np.ndarray) -> np.ndarray:
        return predict(self.model, np.ascontiguousarray(dense, np.float32),
                       np.ascontiguousarray(pooled, np.float32).reshape(len(dense), -1))

    def load_mlp(self, weights: MlpWeights) -> None:
        """Start from these MLPs (a release's, ``ensemble train --init-from``): continued training."""
        import keras

        layers = [layer for layer in self.model.layers if isinstance(layer, keras.layers.Dense)]
        given = [*weights.bottom, *weights.top]
        if [tuple(layer.kernel.shape) for layer in layers] != [tuple(w.shape) for w, _ in given]:
            raise ValueError("--init-from: that release's MLPs have other widths than this training's")
        for layer, (w, b) in zip(layers, given):
            layer.set_weights([w, b])

    def mlp_weights(self) -> MlpWeights:
        import keras

        dense_layers = [layer for layer in self.model.layers if isinstance(layer, keras.layers.Dense)]
        pairs = [(np.ascontiguousarray(w, np.float32), np.ascontiguousarray(b, np.float32))
                 for w, b in (layer.get_weights() for layer in dense_layers)]
        return MlpWeights.lower_triangle(pairs[:self.n_bottom], pairs[self.n_bottom:], self.n_tables, self.dim)

    def save(self, out_dir: str | Path) -> Path:
        """The pooled model as a SavedModel and in TensorFlow Lite (the framework the engines are checked
        against, and what OpenVINO converts), and its weights in the C pass's layout (``mlp.npz``)."""
        path = save(self.model, out_dir)
        write_tflite(out_dir)
        self.mlp_weights().save(Path(out_dir))
        return path


def train(config: DLRMConfig, train_data, valid_data, device: Device = Device.CPU,
          log: Callable[[str], None] = print):
    """Train by streaming batches; keep the epoch with the best validation log loss.

    Args: as :func:`ensemble.models.dlrm_torch.train` (a batch source or in-memory arrays).
    Mixed precision (``mixed_float16``) only on GPU; the output layer stays float32.
    """
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16" if device is Device.GPU else "float32")
    if device is Device.GPU:  # TF32 matmuls/convolutions on Ampere and later (TensorFlow's default, made explicit)
        tf.config.experimental.enable_tensor_float_32_execution(True)
    train_source = as_source(train_data, config.batch_size, config.seed)
    valid_source = as_source(valid_data, 65536, shuffle=False)
    model = build(config)
    optimizer = keras.optimizers.Adam(config.learning_rate)
    if device is Device.GPU:  # float16 gradients underflow without dynamic loss scaling
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    loss_fn = keras.losses.BinaryCrossentropy()

    # Shapes with an unknown batch: one trace serves the full batches and the last, smaller one.
    @tf.function(input_signature=[tf.TensorSpec((None, config.n_dense), tf.float32),
                                  tf.TensorSpec((None, len(config.cardinalities)), tf.int64),
                                  tf.TensorSpec((None,), tf.int8)])
    def step(d, i, y):
        y = tf.reshape(tf.cast(y, tf.float32), (-1, 1))
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model([d, i], training=True))
        # scale_loss is the identity for a plain optimizer; LossScaleOptimizer unscales in apply.
        grads = tape.gradient(optimizer.scale_loss(loss), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    best_loss, best_weights = float("inf"), None
    for epoch in range(config.epochs):
        for dense, ids, labels in train_source.epoch(epoch):
            step(dense, ids, labels)
        scores, valid_labels = score_source(lambda d, i: predict(model, d, i), valid_source)
        val_loss = metrics.log_loss(valid_labels, scores)
        log(f"  dlrm_tf epoch {epoch + 1}: valid logloss {val_loss:.4f} "
            f"auc {metrics.auc(valid_labels, scores):.4f}")
        if val_loss < best_loss:
            best_loss, best_weights = val_loss, model.get_weights()
    model.set_weights(best_weights)
    return model


def predict(model, dense: np.ndarray, ids: np.ndarray, batch: int = 65536) -> np.ndarray:
    out = [np.asarray(model([dense[s:s + batch], ids[s:s + batch]], training=False))
           for s in range(0, len(dense), batch)]
    return np.concatenate(out).reshape(-1).astype(np.float32)


def save(model, out_dir: str | Path) -> Path:
    path = Path(out_dir) / MODEL_DIR
    model.export(str(path), format="tf_saved_model", verbose=False)
    return path


def write_tflite(model_dir: str | Path) -> Path:
    """Convert the SavedModel in ``model_dir`` to TensorFlow Lite (float32, no quantization)
    next to it: the form the CPU layouts run (see :class:`TFScorer`)."""
    import tensorflow as tf

    model_dir = Path(model_dir)
    converter = tf.lite.TFLiteConverter.from_saved_model(str(model_dir / MODEL_DIR))
    path = model_dir / TFLITE
    path.write_bytes(converter.convert())
    return path


def _interpreter_class():
    """LiteRT's interpreter when installed (no TensorFlow import), else TensorFlow's own."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    return Interpreter


class TFScorer:
    """Runs the Keras DLRM's TensorFlow Lite conversion; ``(dense_features, category_ids) -> [B x 1]``.

    The SavedModel's signature costs ~0.7 ms per 1-row call on this project's CPU, almost all
    of it per-op dispatch; the TFLite interpreter runs the same graph (same weights, differences
    ~2e-7) in ~0.01 ms. An interpreter is not thread-safe, so each calling thread gets its own
    (batch scoring with ``--local`` calls from several); its tensors are resized only when the
    batch size changes.
    """

    def __init__(self, model_dir: str | Path, threads: int = 1):
        import threading

        self._path, self._threads = str(Path(model_dir) / TFLITE), threads
        self.folder = Path(model_dir)
        self._local = threading.local()
        interpreter = self._interpreter()[0]  # load now: a broken file fails at load, not on the first request
        # The engine the release records for this step (ensemble.models.engines): the C pass (the same
        # weights through one C call, ensemble/native/_dlrm.c) or OpenVINO, said loudly when it cannot run here.
        from ensemble.models import engines

        self.weights = dlrm_kernel.DLRMWeights.from_tflite(interpreter)
        self.kernel_c, self._kernel, self.engine = engines.attach(Path(model_dir), "dlrm_tf", self.weights,
                                                                  self.framework)

    def _interpreter(self):
        state = getattr(self._local, "state", None)
        if state is None:
            interpreter = _interpreter_class()(model_path=self._path, num_threads=self._threads)
            by_name = {d["name"]: d["index"] for d in interpreter.get_input_details()}
            dense = next(i for n, i in by_name.items() if schema.DENSE_FEATURES.name in n)
            ids = next(i for n, i in by_name.items() if schema.CATEGORY_IDS.name in n)
            state = self._local.state = [interpreter, dense, ids, interpreter.get_output_details()[0]["index"], -1]
        return state

    @property
    def kernel(self) -> "dlrm_kernel.DLRMWeights | None":
        """The C forward pass, when it was checked against the framework at load (what scores then)."""
        return self._kernel

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        if self._kernel is not None:
            return self._kernel(dense_features, category_ids)
        return self.framework(dense_features, category_ids)

    def framework(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        """The TFLite interpreter's own run."""
        state = self._interpreter()
        interpreter, dense, ids, out, rows = state
        if len(dense_features) != rows:
            rows = state[4] = len(dense_features)
            interpreter.resize_tensor_input(dense, [rows, dense_features.shape[1]])
            interpreter.resize_tensor_input(ids, [rows, category_ids.shape[1]])
            interpreter.allocate_tensors()
        interpreter.set_tensor(dense, np.ascontiguousarray(dense_features, np.float32))
        interpreter.set_tensor(ids, np.ascontiguousarray(category_ids, np.int64))
        interpreter.invoke()
        return interpreter.get_tensor(out).reshape(-1, 1).astype(np.float32, copy=True)
