"""What the two DLRM implementations share: sizes, training settings, and batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np


@dataclass(frozen=True)
class DLRMConfig:
    """DLRM sizes (defaults sized for a CPU) and training settings.

    Attributes:
        embedding_dim: width of every embedding and of the bottom MLP's output.
        bottom_mlp: hidden widths of the bottom MLP (13 dense features in).
        top_mlp: hidden widths of the top MLP (one logit out).
        epochs, batch_size, learning_rate: Adam training settings.
        seed: initialisation and shuffling seed.
    """

    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (128, 64)
    epochs: int = 2
    batch_size: int = 2048
    learning_rate: float = 2e-3
    seed: int = 0
    # Vocabulary size of each categorical column (set from the fitted features).
    cardinalities: tuple[int, ...] = field(default=())
    # Width of the dense input (the dataset's continuous columns; Criteo's 13 unless set).
    n_dense: int = 13
    # Tables in a row store (ensemble.tables): their rows' rowwise Adagrad learning rate.
    table_learning_rate: float = 0.05

    def n_interactions(self, n_categorical: int) -> int:
        """Number of pairwise dot products between the 1 + n_categorical vectors."""
        n = n_categorical + 1
        return n * (n - 1) // 2


def minibatches(n_rows: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Shuffled index slices over whole in-memory tensors (no per-item dataset)."""
    order = rng.permutation(n_rows)
    for start in range(0, n_rows, batch_size):
        yield order[start:start + batch_size]


def table_offsets(cardinalities: tuple[int, ...]) -> np.ndarray:
    """[F] int64: the first row of each column's table inside the one stacked embedding table."""
    return np.concatenate([[0], np.cumsum(cardinalities[:-1])]).astype(np.int64)


def as_source(data, batch_size: int, seed: int = 0, shuffle: bool = True):
    """A batch source (:mod:`ensemble.data.shards`) as is, or in-memory ``(dense, ids, labels)``
    wrapped in an :class:`ensemble.data.shards.ArraySource`."""
    from ensemble.data.shards import ArraySource

    if hasattr(data, "epoch"):
        return data
    dense, ids, labels = data
    return ArraySource(np.asarray(dense, np.float32), np.asarray(ids, np.int64), np.asarray(labels, np.int8),
                       batch_size, seed, shuffle)


def score_source(predict: Callable[[np.ndarray, np.ndarray], np.ndarray], source) -> tuple[np.ndarray, np.ndarray]:
    """Score one (unshuffled) epoch of a source batch by batch.

    Returns:
        (scores [N] float32, labels [N] int8) in the source's order.
    """
    scores, labels = [], []
    for dense, ids, y in source.epoch(0):
        scores.append(np.asarray(predict(dense, ids), np.float32).reshape(-1))
        labels.append(y)
    if not scores:
        return np.empty(0, np.float32), np.empty(0, np.int8)
    return np.concatenate(scores), np.concatenate(labels)
