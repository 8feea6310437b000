"""Model-ready tensors on disk (Parquet shards) and the batch sources training streams from.

Shard format: one Parquet file per part, columns ``I1..I13`` float32 (the fitted transform's
normalized dense features), ``C1..C26`` int64 (Categorify ids) and ``label`` int8, in that
order. A split's shards sit in one folder with ``shards.json`` naming them and their row counts.

The batch source contract (what every trainer consumes)::

    source.rows                      # rows per epoch
    source.epoch(index) -> Iterator[(dense [B x 13] float32, ids [B x 26] int64, labels [B] int8)]

Every row appears exactly once per epoch; all batches have ``batch_size`` rows except the
last. With ``shuffle`` the order is drawn from ``(seed, index)``: the same epoch index gives
the same batches, different indices give different orders. :class:`ArraySource` serves
in-memory arrays; :class:`ShardSource` streams shards with a bounded shuffle (shard order
permuted, then rows permuted within a buffer of at most ``buffer_rows`` plus one shard).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np

from ensemble import schema

Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # dense [B x 13] f32, ids [B x 26] i64, labels [B] i8
MANIFEST = "shards.json"
SHARD_COLUMNS: tuple[str, ...] = (*schema.DENSE_COLUMNS, *schema.CATEGORICAL_COLUMNS, schema.LABEL)


class BatchSource(Protocol):
    """What the trainers read: see the module docstring for the contract."""

    @property
    def rows(self) -> int: ...

    def epoch(self, index: int) -> Iterator[Batch]: ...


def _epoch_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng((seed, index))


def _batches(dense: np.ndarray, ids: np.ndarray, labels: np.ndarray, batch_size: int) -> Iterator[Batch]:
    for start in range(0, len(labels), batch_size):
        yield dense[start:start + batch_size], ids[start:start + batch_size], labels[start:start + batch_size]


@dataclass(frozen=True)
class ArraySource:
    """The batch source over in-memory arrays (small data, tests).

    Attributes:
        dense: [N x 13] float32; ids: [N x 26] int64; labels: [N] int8.
        batch_size: rows per batch (the last batch of an epoch may be smaller).
        seed: with the epoch index, draws each epoch's permutation.
        shuffle: False yields the rows in order (scoring, validation).
    """

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray
    batch_size: int = 2048
    seed: int = 0
    shuffle: bool = True

    @property
    def rows(self) -> int:
        return len(self.labels)

    def epoch(self, index: int) -> Iterator[Batch]:
        if not self.shuffle:
            yield from _batches(self.dense, self.ids, self.labels, self.batch_size)
            return
        order = _epoch_rng(self.seed, index).permutation(self.rows)
        for start in range(0, self.rows, self.batch_size):
            idx = order[start:start + self.batch_size]
            yield self.dense[idx], self.ids[idx], self.labels[idx]


def write_shard(path: str | Path, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> int:
    """Write one shard (see the module docstring); returns its row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dense = np.asarray(dense, np.float32)
    ids = np.asarray(ids, np.int64)
    columns = [pa.array(dense[:, i]) for i in range(schema.N_DENSE)]
    columns += [pa.array(ids[:, j]) for j in range(schema.N_CATEGORICAL)]
    columns.append(pa.array(np.asarray(labels, np.int8)))
    pq.write_table(pa.Table.from_arrays(columns, names=list(SHARD_COLUMNS)), str(path))
    return len(labels)


def read_shard(path: str | Path) -> Batch:
    """One shard as (dense [N x 13] float32, ids [N x 26] int64, labels [N] int8)."""
    import pyarrow.parquet as pq

    table = pq.ParquetFile(str(path)).read(columns=list(SHARD_COLUMNS))
    dense = np.empty((table.num_rows, schema.N_DENSE), np.float32)
    ids = np.empty((table.num_rows, schema.N_CATEGORICAL), np.int64)
    for i, col in enumerate(schema.DENSE_COLUMNS):
        dense[:, i] = table.column(col).to_numpy()
    for j, col in enumerate(schema.CATEGORICAL_COLUMNS):
        ids[:, j] = table.column(col).to_numpy()
    return dense, ids, table.column(schema.LABEL).to_numpy().astype(np.int8, copy=False)


@dataclass(frozen=True)
class ShardSet:
    """One split's shards: files (relative to ``folder``) and their row counts, in data order."""

    folder: Path
    files: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @property
    def paths(self) -> list[Path]:
        return [self.folder / f for f in self.files]

    def save(self) -> Path:
        path = self.folder / MANIFEST
        path.write_text(json.dumps({"files": list(self.files), "counts": list(self.counts)}, indent=1))
        return path

    @classmethod
    def load(cls, folder: str | Path) -> "ShardSet":
        folder = Path(folder)
        try:
            meta = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{folder} holds no {MANIFEST}: not a shard folder written by ensemble") from None
        return cls(folder, tuple(meta["files"]), tuple(int(c) for c in meta["counts"]))

    def partition(self, rank: int, world: int) -> "ShardSet":
        """Every ``world``-th shard from ``rank`` (one distributed worker's share)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        return ShardSet(self.folder, self.files[rank::world], self.counts[rank::world])

    def source(self, batch_size: int = 2048, seed: int = 0, shuffle: bool = True,
               buffer_rows: int = 1 << 20) -> "ShardSource":
        return ShardSource(self, batch_size, seed, shuffle, buffer_rows)


@dataclass(frozen=True)
class ShardSource:
    """The batch source streaming a :class:`ShardSet` from disk.

    Memory: at most ``buffer_rows`` rows plus one shard (about 270 bytes a row) are held;
    every row is visited once per epoch. With ``shuffle``, shards are read in a permuted order,
    and each buffer of rows is permuted before it is cut into batches; the rows left over
    (fewer than one batch) move into the next buffer, so batch sizes stay exact.
    """

    shards: ShardSet
    batch_size: int = 2048
    seed: int = 0
    shuffle: bool = True
    buffer_rows: int = 1 << 20

    @property
    def rows(self) -> int:
        return self.shards.rows

    def epoch(self, index: int) -> Iterator[Batch]:
        rng = _epoch_rng(self.seed, index)
        paths = self.shards.paths
        order = rng.permutation(len(paths)) if self.shuffle else np.arange(len(paths))
        pending: list[Batch] = []
        held = 0
        for k in order:
            pending.append(read_shard(paths[k]))
            held += len(pending[-1][2])
            if held >= self.buffer_rows:
                rest = yield from self._drain(pending, rng, final=False)
                pending, held = [rest], len(rest[2])
        yield from self._drain(pending, rng, final=True)

    def _drain(self, pending: list[Batch], rng: np.random.Generator, final: bool):
        """Yield the buffer's whole batches (all of it when ``final``); return the remainder."""
        if not pending:  # no shards at all (e.g. a distributed rank given none)
            return None
        dense, ids, labels = (np.concatenate([p[i] for p in pending]) for i in range(3))
        if self.shuffle:
            order = rng.permutation(len(labels))
            dense, ids, labels = dense[order], ids[order], labels[order]
        cut = len(labels) if final else len(labels) - len(labels) % self.batch_size
        yield from _batches(dense[:cut], ids[:cut], labels[:cut], self.batch_size)
        return dense[cut:], ids[cut:], labels[cut:]


def collect(source: BatchSource, index: int = 0) -> Batch:
    """One whole epoch concatenated (small data: scoring, tests)."""
    parts = list(source.epoch(index))
    if not parts:
        return (np.empty((0, schema.N_DENSE), np.float32), np.empty((0, schema.N_CATEGORICAL), np.int64),
                np.empty(0, np.int8))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def write_shards(folder: str | Path, parts: Sequence[Batch] | Iterator[Batch]) -> ShardSet:
    """Write ``part-00000.parquet``, ... (one per part, empty parts skipped) and the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files, counts = [], []
    for dense, ids, labels in parts:
        if len(labels) == 0:
            continue
        name = f"part-{len(files):05d}.parquet"
        counts.append(write_shard(folder / name, dense, ids, labels))
        files.append(name)
    shards = ShardSet(folder, tuple(files), tuple(counts))
    shards.save()
    return shards


def in_order(source: BatchSource, batch_size: int) -> BatchSource:
    """The same rows unshuffled in batches of ``batch_size`` (the trees' iterator and scoring read
    big ordered batches); a source that is not one of this module's is returned as is."""
    from dataclasses import is_dataclass, replace

    if is_dataclass(source) and isinstance(source, (ArraySource, ShardSource)):
        return replace(source, batch_size=batch_size, shuffle=False)
    return source
