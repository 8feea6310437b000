"""Criteo TSV reading, splitting, and a seeded synthetic generator writing the same format.

A Criteo line is ``label \\t I1..I13 \\t C1..C26``: integer features (may be negative), hashed
categorical features as 8-digit hex strings; an empty field is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ensemble import schema

# Distinct values per categorical column in the Criteo Kaggle day files (C1..C26).
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Approximate share of empty fields per column in the Criteo day files.
DENSE_MISSING: tuple[float, ...] = (
    0.45, 0.0, 0.21, 0.22, 0.026, 0.22, 0.043, 0.0005, 0.043, 0.45, 0.043, 0.77, 0.22,
)
CATEGORICAL_MISSING: tuple[float, ...] = (
    0, 0, 0.034, 0.034, 0, 0.12, 0, 0, 0, 0, 0, 0.034, 0, 0, 0, 0.034, 0, 0, 0.44, 0.44,
    0.034, 0.76, 0, 0.034, 0.44, 0.44,
)


def read_criteo(paths: Sequence[str | Path], nrows: int | None = None) -> pd.DataFrame:
    """Read one or several Criteo TSV files (plain or .gz) into one frame.

    Args:
        paths: day files, read in order.
        nrows: stop after this many rows in total (None = all).

    Returns:
        Frame with ``label`` (int8), ``I1..I13`` (float32, NaN = missing) and ``C1..C26``
        (object: str, None = missing), in file order.
    """
    dtypes = {schema.LABEL: "int8"}
    dtypes.update({c: "float32" for c in schema.DENSE_COLUMNS})
    dtypes.update({c: "object" for c in schema.CATEGORICAL_COLUMNS})
    frames, remaining = [], nrows
    for path in paths:
        if remaining is not None and remaining <= 0:
            break
        frame = pd.read_csv(
            path, sep="\t", header=None, names=list(schema.CRITEO_COLUMNS), dtype=dtypes,
            keep_default_na=False, na_values=[""], nrows=remaining, compression="infer",
            quoting=3,
        )
        frames.append(frame)
        if remaining is not None:
            remaining -= len(frame)
    if not frames:
        raise ValueError("no input files given")
    frame = pd.concat(frames, ignore_index=True)
    cats = frame[list(schema.CATEGORICAL_COLUMNS)]
    frame[list(schema.CATEGORICAL_COLUMNS)] = cats.where(cats.notna(), None)
    return frame


def split(frame: pd.DataFrame, valid: float = 0.1, test: float = 0.1
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Split by row order into train / valid / test (Criteo rows are in time order)."""
    n = len(frame)
    n_test, n_valid = int(n * test), int(n * valid)
    n_train = n - n_valid - n_test
    parts = frame.iloc[:n_train], frame.iloc[n_train:n_train + n_valid], frame.iloc[n_train + n_valid:]
    return tuple(p.reset_index(drop=True) for p in parts)  # type: ignore[return-value]


@dataclass(frozen=True)
class SynthConfig:
    """Shape of a synthetic Criteo-like data set.

    Attributes:
        rows: number of lines.
        scale: per-column cardinality as a fraction of Criteo's (1.0 = full size: three
            columns with millions of values).
        seed: everything is drawn from ``np.random.default_rng(seed)``.
        ctr: target share of positive labels.
    """

    rows: int = 300_000
    scale: float = 0.01
    seed: int = 0
    ctr: float = 0.25

    def cardinalities(self) -> tuple[int, ...]:
        return tuple(max(min(c, 10), math.ceil(c * self.scale)) for c in CRITEO_CARDINALITIES)


@dataclass(frozen=True)
class SynthData:
    """A generated frame plus the hidden model's click probability of each row."""

    frame: pd.DataFrame
    probability: np.ndarray  # [rows] float64


def _hex_names(column: int, ranks: np.ndarray) -> np.ndarray:
    """8-digit hex value of each rank: a bijection on uint32, so no two ranks collide."""
    h = ranks.astype(np.uint32) ^ np.uint32((column * 0x9E3779B1) & 0xFFFFFFFF)
    h = (h * np.uint32(0x85EBCA6B)) & np.uint32(0xFFFFFFFF)
    h ^= h >> np.uint32(13)
    h = (h * np.uint32(0xC2B2AE35)) & np.uint32(0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    return np.array([f"{v:08x}" for v in h.tolist()], dtype=object)


def _zipf_ranks(rng: np.random.Generator, n: int, cardinality: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.power(np.arange(1, cardinality + 1, dtype=np.float64) + 2.0, exponent)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), cardinality - 1)


def synthesize(config: SynthConfig) -> SynthData:
    """Draw a learnable Criteo-format data set.

    Categorical values follow Zipf-like frequencies; integer features are heavy-tailed counts
    (I2 can be negative, as in Criteo); labels come from a hidden logistic model with
    per-value effects, dense effects, categorical x categorical (latent dot products) and
    dense x categorical interactions.
    """
    rng = np.random.default_rng(config.seed)
    n = config.rows
    logit = np.zeros(n)
    frame: dict[str, object] = {}

    dense_log = np.zeros((n, schema.N_DENSE))
    for i, col in enumerate(schema.DENSE_COLUMNS):
        mu, sigma = rng.uniform(0.0, 3.5), rng.uniform(0.8, 2.0)
        values = np.floor(rng.lognormal(mu, sigma, n))
        if col == "I2":
            values -= rng.choice([0, 0, 0, 1, 2, 3], size=n)
        missing = rng.random(n) < DENSE_MISSING[i]
        dense_log[:, i] = np.where(missing, 0.0, np.log1p(np.maximum(values, 0)))
        logit += rng.normal(0, 0.25) * (dense_log[:, i] - mu) / (sigma + 1) + rng.normal(0, 0.3) * missing
        frame[col] = pd.array(np.where(missing, np.nan, values), dtype="Int64")

    ranks = np.zeros((n, schema.N_CATEGORICAL), dtype=np.int64)
    latent: dict[int, np.ndarray] = {}
    for j, (col, card) in enumerate(zip(schema.CATEGORICAL_COLUMNS, config.cardinalities())):
        r = _zipf_ranks(rng, n, card, rng.uniform(1.05, 1.35))
        missing = rng.random(n) < CATEGORICAL_MISSING[j]
        r[missing] = -1
        ranks[:, j] = r
        effect = rng.normal(0, rng.uniform(0.1, 0.6), card + 1)  # last entry: missing
        logit += effect[r]
        if j in (0, 1, 4, 5, 13, 16, 22, 24):
            latent[j] = rng.normal(0, 0.5, (card + 1, 4))
        uniq, inverse = np.unique(r, return_inverse=True)
        names = _hex_names(j, np.maximum(uniq, 0))
        names[uniq < 0] = None
        frame[col] = names[inverse]

    pairs = [(0, 1), (4, 5), (13, 16), (22, 24), (0, 13), (5, 22)]
    for a, b in pairs:
        logit += np.sum(latent[a][ranks[:, a]] * latent[b][ranks[:, b]], axis=1)
    for d, c in [(0, 1), (5, 4), (9, 13)]:  # dense x categorical
        slope = rng.normal(0, 0.3, config.cardinalities()[c] + 1)
        logit += slope[ranks[:, c]] * (dense_log[:, d] - dense_log[:, d].mean())
    logit += 0.6 * ((dense_log[:, 2] > 1.5) & (dense_log[:, 6] < 1.0))

    logit *= 1.0 / max(logit.std(), 1e-9)  # keep the problem in a realistic AUC range
    bias = _bias_for_rate(logit, config.ctr)
    probability = 1.0 / (1.0 + np.exp(-(logit + bias)))
    label = (rng.random(n) < probability).astype(np.int8)
    out = pd.DataFrame({schema.LABEL: label, **frame})[list(schema.CRITEO_COLUMNS)]
    return SynthData(out, probability)


def _bias_for_rate(logit: np.ndarray, rate: float) -> float:
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def write_criteo(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a frame in Criteo TSV format (``.gz`` suffix compresses)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = frame[list(schema.CRITEO_COLUMNS)].copy()
    for col in schema.DENSE_COLUMNS:
        if not isinstance(out[col].dtype, pd.Int64Dtype):
            out[col] = pd.array(out[col].to_numpy(dtype=np.float64), dtype="Int64")
    tmp = path.with_name(path.name + ".partial")
    out.to_csv(tmp, sep="\t", header=False, index=False, na_rep="",
               compression="gzip" if path.suffix == ".gz" else None)
    tmp.replace(path)
    return path
