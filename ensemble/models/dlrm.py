"""What the two DLRM implementations share: sizes, training settings, and batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

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
