"""The keys of benchmarks.tables: each large table's ids drawn Zipf over its rows (a fixed bijection of ranks to
ids) or from training's own counts, sent as strings whose CRC-32 is the id (:func:`forge`); random rows of a release
without a row store."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

# CRC-32 (zlib's, reflected) table and the index of each entry's top byte: forging a value of a given CRC.
_CRC = [0] * 256
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0xEDB88320 if _c & 1 else _c >> 1
    _CRC[_i] = _c
_BY_TOP = {v >> 24: i for i, v in enumerate(_CRC)}


def forge(prefix: bytes, target: int) -> bytes:
    """``prefix`` and four bytes after it, whose zlib.crc32 is ``target``: the bytes run the CRC's register from
    the prefix's state to the one that ends in ``target`` (each step's table entry is known from the state's top
    byte, so the four entries are found backwards and the bytes forwards)."""
    state = target ^ 0xFFFFFFFF
    entries = []
    for _ in range(4):
        index = _BY_TOP[state >> 24]
        entries.append(index)
        state = ((state ^ _CRC[index]) << 8) & 0xFFFFFFFF
    crc = zlib.crc32(prefix) ^ 0xFFFFFFFF
    tail = bytearray()
    for index in reversed(entries):
        tail.append((crc ^ index) & 0xFF)
        crc = _CRC[index] ^ (crc >> 8)
    forged = prefix + bytes(tail)
    assert zlib.crc32(forged) == target
    return forged


def rank_ids(ranks: np.ndarray, rows: int) -> np.ndarray:
    """A Zipf rank's id: a fixed bijection on the table's rows (an affine map modulo rows)."""
    stride = 2654435761 % rows or 1
    while np.gcd(stride, rows) != 1:
        stride += 1
    return (np.asarray(ranks, np.int64) * stride + 12345) % rows


class Keys:
    """Request rows whose large tables' ids follow a distribution: dense values and categorical strings."""

    def __init__(self, repository: Path, release: int | None, source: str, alpha: float, seed: int = 0):
        from ensemble.scoring.pipeline import release_versions
        from ensemble.tables.files import COUNTS, TABLES_DIR, TablesManifest

        folders = release_versions(repository, release)
        step = next(f for m, f in folders.items() if m.value == "dlrm_torch")
        self.manifest = TablesManifest.load(step)
        self.rng = np.random.default_rng(seed)
        self.source, self.alpha = source, alpha
        self.rows = [t.rows for t in self.manifest.tables]
        self.permutations = {}
        if source == "counts":
            with np.load(step / TABLES_DIR / COUNTS) as data:
                self.counts = {t.name: (data[f"{t.name}.ids"], data[f"{t.name}.counts"]) for t in self.manifest.tables}
        self.forged: dict[int, bytes] = {}

    def _zipf(self, rows: int, n: int) -> np.ndarray:
        """Ranks 0.. with P(r) ~ (r + 1)^-alpha over ``rows`` ranks (by inverting the continuous CDF)."""
        a = self.alpha
        u = self.rng.random(n)
        top = (rows + 1) ** (1 - a)
        ranks = np.floor((1 + u * (top - 1)) ** (1 / (1 - a))) - 1
        return np.clip(ranks, 0, rows - 1).astype(np.int64)

    def ids(self, n: int) -> np.ndarray:
        """[n x tables] ids."""
        out = np.empty((n, len(self.rows)), np.int64)
        for c, (rows, table) in enumerate(zip(self.rows, self.manifest.tables)):
            if self.source == "counts" and len(self.counts[table.name][0]):
                ids, counts = self.counts[table.name]
                out[:, c] = ids[np.searchsorted(np.cumsum(counts), self.rng.random(n) * counts.sum(), side="right")]
            else:
                out[:, c] = rank_ids(self._zipf(rows, n), rows)
        return out

    def request(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.ids(n)
        dense = self.rng.lognormal(1.5, 1.2, (n, 13)).astype(np.float32)
        cats = np.empty(ids.shape, dtype=object)
        forged = self.forged
        for (r, c), value in np.ndenumerate(ids):
            value = int(value)
            text = forged.get(value)
            if text is None:
                if len(forged) > 2_000_000:
                    forged.clear()
                text = forged[value] = forge(b"k", value)  # crc32 == id, so crc32 % rows == id
            cats[r, c] = text
        return dense, cats


class SyntheticKeys:
    """Request rows of the synthetic Criteo data (a release without a row store: its vocabularies hold them)."""

    def __init__(self, seed: int = 0, rows: int = 20_000):
        from ensemble.data import criteo
        from ensemble.features import transforms

        frame = criteo.synthesize(criteo.SynthConfig(rows=rows, scale=1.0, seed=31 + seed)).frame
        self.dense, self.cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
        self.rng = np.random.default_rng(seed)

    def request(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        at = int(self.rng.integers(0, len(self.dense) - n))
        return self.dense[at:at + n], self.cats[at:at + n]


def _zipf_top(rows: list[int], n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` most likely (table, rank) pairs over tables of these rows, each table's ranks drawn as
    ``Keys._zipf`` draws them: (table index, rank), most likely first."""
    a = alpha
    norm = np.array([((r + 1) ** (1 - a) - 1) / (1 - a) for r in rows])

    def taken(p: float) -> np.ndarray:  # ranks of each table whose probability is at least p
        return np.minimum(np.array(rows), np.floor((p * norm) ** (-1 / a))).astype(np.int64)

    lo, hi = 1e-30, 1.0
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if taken(mid).sum() > n else (lo, mid)
    counts = taken(hi)
    tables = np.repeat(np.arange(len(rows)), counts)
    ranks = np.concatenate([np.arange(k) for k in counts]) if len(counts) else np.zeros(0, np.int64)
    order = np.argsort(-((ranks + 1.0) ** -a / norm[tables]), kind="stable")
    return tables[order][:n], ranks[order][:n]
