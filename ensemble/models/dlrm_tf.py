"""DLRM in TensorFlow/Keras, the same architecture as :mod:`ensemble.models.dlrm_torch`.
Exported as a SavedModel with Keras ``model.export`` (signature output ``output_0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ensemble import metrics, schema
from ensemble.models.dlrm import DLRMConfig, minibatches

MODEL_DIR = "model.savedmodel"
SIGNATURE_OUTPUT = "output_0"


def build(config: DLRMConfig):
    """Return a ``keras.Model``: ``(dense [B x 13] f32, ids [B x 26] i64) -> [B x 1] prob``."""
    import keras
    from keras import layers, ops

    keras.utils.set_random_seed(config.seed)
    d = config.embedding_dim
    # Input names double as SavedModel signature argument names; they must not collide with
    # default layer names (an input called "dense" breaks export).
    dense_in = keras.Input((schema.N_DENSE,), dtype="float32", name=schema.DENSE_FEATURES.name)
    ids_in = keras.Input((schema.N_CATEGORICAL,), dtype="int64", name=schema.CATEGORY_IDS.name)
    x = dense_in
    for width in (*config.bottom_mlp, d):
        x = layers.Dense(width, activation="relu")(x)
    bottom = x
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=config.seed)
    vectors = [bottom]
    for j, n in enumerate(config.cardinalities):
        vectors.append(layers.Embedding(n, d, embeddings_initializer=init, name=f"embedding_{j}")(ids_in[:, j]))
    stacked = ops.stack(vectors, axis=1)  # B x 27 x d
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


def train(config: DLRMConfig, train_data: tuple[np.ndarray, np.ndarray, np.ndarray],
          valid_data: tuple[np.ndarray, np.ndarray, np.ndarray], device: str = "cpu",
          log: Callable[[str], None] = print):
    """Train on whole in-memory tensors; keep the epoch with the best validation log loss.

    Mixed precision (``mixed_float16``) only on GPU; the output layer stays float32.
    """
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16" if device == "gpu" else "float32")
    if device == "gpu":  # TF32 matmuls/convolutions on Ampere and later (TensorFlow's default, made explicit)
        tf.config.experimental.enable_tensor_float_32_execution(True)
    model = build(config)
    optimizer = keras.optimizers.Adam(config.learning_rate)
    if device == "gpu":  # float16 gradients underflow without dynamic loss scaling
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    loss_fn = keras.losses.BinaryCrossentropy()
    dense, ids, labels = (tf.constant(a) for a in train_data)
    labels = tf.reshape(tf.cast(labels, tf.float32), (-1, 1))

    @tf.function(reduce_retracing=True)
    def step(d, i, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model([d, i], training=True))
        # scale_loss is the identity for a plain optimizer; LossScaleOptimizer unscales in apply.
        grads = tape.gradient(optimizer.scale_loss(loss), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(config.seed)
    best_loss, best_weights = float("inf"), None
    for epoch in range(config.epochs):
        for idx in minibatches(int(labels.shape[0]), config.batch_size, rng):
            index = tf.constant(idx)
            step(tf.gather(dense, index), tf.gather(ids, index), tf.gather(labels, index))
        scores = predict(model, valid_data[0], valid_data[1])
        val_loss = metrics.log_loss(valid_data[2], scores)
        log(f"  dlrm_tf epoch {epoch + 1}: valid logloss {val_loss:.4f} "
            f"auc {metrics.auc(valid_data[2], scores):.4f}")
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


class TFScorer:
    """Loads the SavedModel; ``(dense_features, category_ids) -> [B x 1] float32``."""

    def __init__(self, model_dir: str | Path, threads: int = 1):
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # already initialised in this process (e.g. after training)
            pass
        self._tf = tf
        self._loaded = tf.saved_model.load(str(Path(model_dir) / MODEL_DIR))
        self._signature = self._loaded.signatures["serving_default"]

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        out = self._signature(**{
            schema.DENSE_FEATURES.name: self._tf.constant(dense_features, self._tf.float32),
            schema.CATEGORY_IDS.name: self._tf.constant(category_ids, self._tf.int64),
        })[SIGNATURE_OUTPUT]
        return out.numpy().astype(np.float32).reshape(-1, 1)
