"""Criteo TSV reading, splitting, and a seeded synthetic generator writing the same format.

A Criteo line is ``label \\t I1..I13 \\t C1..C26``: integer features (may be negative), hashed
categorical features as 8-digit hex strings; an empty field is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

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


def criteo_columns(has_label: bool = True) -> list[str]:
    """Column names of a Criteo line, with or without the leading label (test days have none)."""
    return list(schema.CRITEO_COLUMNS if has_label else schema.CRITEO_COLUMNS[1:])


def has_label(first_line: str | bytes) -> bool:
    """Whether a Criteo line starts with a label: 40 tab-separated fields, or 39 without."""
    fields = (first_line.decode() if isinstance(first_line, bytes) else first_line).rstrip("\r\n").split("\t")
    if len(fields) not in (39, 40):
        raise ValueError(f"not a Criteo line: {len(fields)} tab-separated fields (expected 40, or 39 without label)")
    return len(fields) == 40


def parse_criteo(source, with_label: bool = True, nrows: int | None = None, chunksize: int | None = None,
                 compression: str = "infer"):
    """Parse Criteo TSV from a path or a binary buffer.

    Returns:
        One frame (or an iterator of frames when ``chunksize`` is set) with ``label`` (int8,
        when present), ``I1..I13`` (float32, NaN = missing) and ``C1..C26`` (object: str,
        None = missing), in file order.
    """
    columns = criteo_columns(with_label)
    dtypes = {c: ("int8" if c == schema.LABEL else "float32" if c in schema.DENSE_COLUMNS else "object")
              for c in columns}
    reader = pd.read_csv(source, sep="\t", header=None, names=columns, dtype=dtypes, keep_default_na=False,
                         na_values=[""], nrows=nrows, compression=compression, quoting=3, chunksize=chunksize)
    if chunksize is None:
        return _missing_as_none(reader)
    return (_missing_as_none(frame) for frame in reader)


def _missing_as_none(frame: pd.DataFrame) -> pd.DataFrame:
    cats = frame[list(schema.CATEGORICAL_COLUMNS)]
    frame[list(schema.CATEGORICAL_COLUMNS)] = cats.where(cats.notna(), None)
    return frame


def read_criteo(paths: Sequence[str | Path], nrows: int | None = None) -> pd.DataFrame:
    """Read one or several labelled Criteo TSV files (plain or .gz) into one frame, in order.

    Args:
        paths: day files, read in order.
        nrows: stop after this many rows in total (None = all).
    """
    frames, remaining = [], nrows
    for path in paths:
        if remaining is not None and remaining <= 0:
            break
        frame = parse_criteo(path, nrows=remaining)
        frames.append(frame)
        if remaining is not None:
            remaining -= len(frame)
    if not frames:
        raise ValueError("no input files given")
    return pd.concat(frames, ignore_index=True)


def split(frame: pd.DataFrame, valid: float = 0.1, test: float = 0.1
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Split by row order into train / valid / test (Criteo rows are in time order)."""
    from ensemble.data import tables

    return tables.split(frame, valid, test)


@dataclass(frozen=True)
class SynthConfig:
    """Shape of a synthetic Criteo-like data set.

    Attributes:
        rows: number of lines.
        scale: per-column cardinality as a fraction of Criteo's (1.0 = full size: three
            columns with millions of values).
        seed: draws the rows.
        world_seed: draws the hidden world (value frequencies, effects, interactions). Data
            sets with the same world and scale come from one distribution, so a model trained
            on one scores the others; a new ``seed`` gives fresh rows (and unseen values).
        ctr: target share of positive labels.
    """

    rows: int = 300_000
    scale: float = 0.01
    seed: int = 0
    world_seed: int = 0
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


# Pairs of categorical columns whose latent vectors interact, and (dense, categorical) pairs
# whose slope depends on the category.
_CAT_PAIRS = ((0, 1), (4, 5), (13, 16), (22, 24), (0, 13), (5, 22))
_DENSE_CAT = ((0, 1), (5, 4), (9, 13))


class _World:
    """The hidden parameters: drawn once from ``world_seed`` and shared by every draw of rows."""

    def __init__(self, config: SynthConfig):
        rng = np.random.default_rng(config.world_seed)
        self.cards = config.cardinalities()
        self.dense = [(rng.uniform(0.0, 3.5), rng.uniform(0.8, 2.0), rng.normal(0, 0.25), rng.normal(0, 0.3))
                      for _ in schema.DENSE_COLUMNS]
        self.cdfs, self.effects = [], []
        for card in self.cards:
            weights = 1.0 / np.power(np.arange(1, card + 1, dtype=np.float64) + 2.0, rng.uniform(1.05, 1.35))
            cdf = np.cumsum(weights)
            self.cdfs.append(cdf / cdf[-1])
            self.effects.append(rng.normal(0, rng.uniform(0.1, 0.6), card + 1))  # last entry: missing
        used = sorted({c for pair in _CAT_PAIRS for c in pair})
        self.latent = {j: rng.normal(0, 0.5, (self.cards[j] + 1, 4)) for j in used}
        self.slopes = {c: rng.normal(0, 0.3, self.cards[c] + 1) for _, c in _DENSE_CAT}
        # Scale and bias from a reference sample, so they do not depend on the rows drawn.
        reference = self.raw_logit(*self.draw(np.random.default_rng(config.world_seed + 1), 20_000)[1:])
        self.scale = 1.0 / max(float(reference.std()), 1e-9)
        self.bias = _bias_for_rate(reference * self.scale, config.ctr)

    def draw(self, rng: np.random.Generator, n: int):
        """Rows: (dense values with NaN, log-dense [n x 13], ranks [n x 26] with -1 = missing)."""
        values = np.empty((n, schema.N_DENSE))
        dense_log = np.zeros((n, schema.N_DENSE))
        for i, col in enumerate(schema.DENSE_COLUMNS):
            mu, sigma, _, _ = self.dense[i]
            v = np.floor(rng.lognormal(mu, sigma, n))
            if col == "I2":
                v -= rng.choice([0, 0, 0, 1, 2, 3], size=n)
            missing = rng.random(n) < DENSE_MISSING[i]
            dense_log[:, i] = np.where(missing, np.nan, np.log1p(np.maximum(v, 0)))
            values[:, i] = np.where(missing, np.nan, v)
        ranks = np.empty((n, schema.N_CATEGORICAL), dtype=np.int64)
        for j, cdf in enumerate(self.cdfs):
            r = np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1)
            r[rng.random(n) < CATEGORICAL_MISSING[j]] = -1
            ranks[:, j] = r
        return values, dense_log, ranks

    def raw_logit(self, dense_log: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        logit = np.zeros(len(ranks))
        for i, (mu, sigma, weight, missing_effect) in enumerate(self.dense):
            missing = np.isnan(dense_log[:, i])
            logit += weight * (np.nan_to_num(dense_log[:, i]) - mu) / (sigma + 1) + missing_effect * missing
        for j, effect in enumerate(self.effects):
            logit += effect[ranks[:, j]]
        for a, b in _CAT_PAIRS:
            logit += np.sum(self.latent[a][ranks[:, a]] * self.latent[b][ranks[:, b]], axis=1)
        for d, c in _DENSE_CAT:
            logit += self.slopes[c][ranks[:, c]] * (np.nan_to_num(dense_log[:, d]) - 1.5)
        logit += 0.6 * ((np.nan_to_num(dense_log[:, 2]) > 1.5) & (np.nan_to_num(dense_log[:, 6]) < 1.0))
        return logit


# Rows drawn at once by the generator: the memory of one chunk (~1.4 GB of Python strings at
# 500k rows) does not grow with the file. Chunk 0 is drawn from ``default_rng(seed)`` exactly
# as the whole-frame generator did, so files up to this many rows are byte-identical to it.
CHUNK_ROWS = 500_000


def _chunk_rng(seed: int, index: int) -> np.random.Generator:
    """Chunk 0: ``default_rng(seed)`` (the one-chunk stream); chunk k: its own seeded stream."""
    return np.random.default_rng(seed if index == 0 else (seed, index))


def _synthesize_chunk(world: _World, rng: np.random.Generator, n: int) -> SynthData:
    values, dense_log, ranks = world.draw(rng, n)
    probability = 1.0 / (1.0 + np.exp(-(world.raw_logit(dense_log, ranks) * world.scale + world.bias)))
    label = (rng.random(n) < probability).astype(np.int8)
    frame: dict[str, object] = {schema.LABEL: label}
    for i, col in enumerate(schema.DENSE_COLUMNS):
        frame[col] = pd.array(values[:, i], dtype="Int64")
    for j, col in enumerate(schema.CATEGORICAL_COLUMNS):
        uniq, inverse = np.unique(ranks[:, j], return_inverse=True)
        names = _hex_names(j, np.maximum(uniq, 0))
        names[uniq < 0] = None
        frame[col] = names[inverse]
    return SynthData(pd.DataFrame(frame)[list(schema.CRITEO_COLUMNS)], probability)


def synthesize_chunks(config: SynthConfig, chunk_rows: int = CHUNK_ROWS) -> Iterator[SynthData]:
    """The data set of :func:`synthesize` as consecutive chunks of at most ``chunk_rows`` rows.

    Chunk ``k`` is drawn from its own seeded stream (see :func:`_chunk_rng`), so the rows depend
    on ``(seed, chunk_rows)`` but never on the memory at hand; the hidden world is shared.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, not {chunk_rows}")
    world = _World(config)
    for index, start in enumerate(range(0, config.rows, chunk_rows)):
        yield _synthesize_chunk(world, _chunk_rng(config.seed, index), min(chunk_rows, config.rows - start))


def synthesize(config: SynthConfig, chunk_rows: int | None = None) -> SynthData:
    """Draw a learnable Criteo-format data set.

    Categorical values follow Zipf-like frequencies; integer features are heavy-tailed counts
    (I2 can be negative, as in Criteo); labels come from a hidden logistic model with
    per-value effects, dense effects, categorical x categorical (latent dot products) and
    dense x categorical interactions.

    Args:
        chunk_rows: None draws all rows as one chunk; a size gives the rows that
            :func:`write_synthetic` writes with that chunk size.
    """
    if chunk_rows is None or chunk_rows >= config.rows:
        return _synthesize_chunk(_World(config), _chunk_rng(config.seed, 0), config.rows)
    chunks = list(synthesize_chunks(config, chunk_rows))
    return SynthData(pd.concat([c.frame for c in chunks], ignore_index=True),
                     np.concatenate([c.probability for c in chunks]))


@dataclass(frozen=True)
class SynthSummary:
    """What :func:`write_synthetic` wrote: rows, click rate, and the AUC of the generator's own
    probabilities (the best any model can reach), from a histogram (error < 1e-5)."""

    path: Path
    rows: int
    click_rate: float
    best_auc: float


# Probability bins of the streaming AUC: ties within one bin of width 2^-20 count as half.
_AUC_BINS = 1 << 20


def _binned_auc(positives: np.ndarray, negatives: np.ndarray) -> float:
    """Mann-Whitney AUC from per-bin counts of positive and negative rows (bins in score order)."""
    neg_below = np.cumsum(negatives) - negatives
    n_pos, n_neg = positives.sum(), negatives.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((positives * (neg_below + 0.5 * negatives)).sum() / (n_pos * n_neg))


def write_synthetic(config: SynthConfig, path: str | Path, chunk_rows: int = CHUNK_ROWS) -> SynthSummary:
    """Generate and write a synthetic Criteo file chunk by chunk (memory flat in ``config.rows``).

    The file equals ``write_criteo(synthesize(config, chunk_rows).frame, path)``; for
    ``config.rows <= chunk_rows`` that is the one-chunk :func:`synthesize` output.
    """
    import gzip

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    positives = np.zeros(_AUC_BINS, np.int64)
    negatives = np.zeros(_AUC_BINS, np.int64)
    rows = clicks = 0
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(tmp, "wt", newline="") as handle:
        for chunk in synthesize_chunks(config, chunk_rows):
            _criteo_frame(chunk.frame).to_csv(handle, sep="\t", header=False, index=False, na_rep="")
            labels = chunk.frame[schema.LABEL].to_numpy().astype(bool)
            bins = np.minimum((chunk.probability * _AUC_BINS).astype(np.int64), _AUC_BINS - 1)
            positives += np.bincount(bins[labels], minlength=_AUC_BINS)
            negatives += np.bincount(bins[~labels], minlength=_AUC_BINS)
            rows, clicks = rows + len(labels), clicks + int(labels.sum())
    tmp.replace(path)
    return SynthSummary(path, rows, clicks / max(rows, 1), _binned_auc(positives, negatives))


def _bias_for_rate(logit: np.ndarray, rate: float) -> float:
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _criteo_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The Criteo columns in order, integer features as nullable Int64 (written without ``.0``)."""
    out = frame[list(schema.CRITEO_COLUMNS)].copy()
    for col in schema.DENSE_COLUMNS:
        if not isinstance(out[col].dtype, pd.Int64Dtype):
            out[col] = pd.array(out[col].to_numpy(dtype=np.float64), dtype="Int64")
    return out


def write_criteo(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a frame in Criteo TSV format (``.gz`` suffix compresses)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    _criteo_frame(frame).to_csv(tmp, sep="\t", header=False, index=False, na_rep="",
                                compression="gzip" if path.suffix == ".gz" else None)
    tmp.replace(path)
    return path
