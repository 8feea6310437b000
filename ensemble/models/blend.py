"""Blender: logistic regression on the three models' logits, fitted on the validation split."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ensemble.models.artifacts import BLEND_JSON
from ensemble import native

MODEL_FILE = BLEND_JSON
_EPS = 1e-6


def _logits(scores: np.ndarray) -> np.ndarray:
    p = np.clip(scores.astype(np.float64), _EPS, 1 - _EPS)
    return np.log(p) - np.log1p(-p)


@dataclass(frozen=True)
class Blender:
    """``score = sigmoid(bias + sum_i weights[i] * logit(score_i))``.

    Attributes:
        weights: one weight per model score, in ``schema.MODEL_SCORES`` order.
        bias: intercept.
    """

    weights: tuple[float, ...]
    bias: float

    @classmethod
    def fit(cls, scores: np.ndarray, labels: np.ndarray, l2: float = 1e-3, steps: int = 50) -> "Blender":
        """Newton's method on the L2-regularised log loss.

        Args:
            scores: [B x M] per-model probabilities on the validation split.
            labels: [B] 0/1.
        """
        x = np.concatenate([np.ones((len(scores), 1)), _logits(scores)], axis=1)
        y = labels.astype(np.float64).ravel()
        w = np.zeros(x.shape[1])
        reg = np.full(x.shape[1], l2 * len(y))
        reg[0] = 0.0
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-(x @ w)))
            grad = x.T @ (p - y) + reg * w
            hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(reg)
            delta = np.linalg.solve(hess, grad)
            w -= delta
            if np.max(np.abs(delta)) < 1e-10:
                break
        return cls(tuple(float(v) for v in w[1:]), float(w[0]))

    def __call__(self, *scores: np.ndarray) -> np.ndarray:
        """M arrays of [B x 1] probabilities -> [B x 1] float32 blended probability."""
        # One pass in C over the rows (numpy's form when it was not built): every request runs this.
        return native.blend(scores, self.weights, self.bias, _EPS).reshape(-1, 1)

    @property
    def eps(self) -> float:
        """How far from 0 and 1 a score is clipped before its logit."""
        return _EPS

    def into(self, scores: tuple[np.ndarray, ...], out: np.ndarray) -> None:
        """:meth:`__call__` into ``out`` (B float32), for C-contiguous float32 [B] ``scores`` as they are."""
        native.blend_into(scores, self.weights, self.bias, _EPS, out)

    def with_inputs(self, *scores: np.ndarray) -> tuple[np.ndarray, ...]:
        """The serving step: (blended score, *the per-model scores passed through)."""
        return (self(*scores), *scores)

    def save(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / MODEL_FILE
        path.write_text(json.dumps({"weights": list(self.weights), "bias": self.bias}, indent=1))
        return path

    @classmethod
    def load(cls, model_dir: str | Path) -> "Blender":
        raw = json.loads((Path(model_dir) / MODEL_FILE).read_text())
        return cls(tuple(float(v) for v in raw["weights"]), float(raw["bias"]))
