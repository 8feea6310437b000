"""Training with tables larger than memory: a step reads and updates only its batch's rows.

:class:`TrainingRows` holds the rows training touched, per table: a compact map id -> slot
(``ensemble.native._tables.Map``, 16-32 bytes a row), the rows in float32, their rowwise Adagrad state
(one float a row, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD``) and their access counts. A row joins at its
first lookup with its deterministic initialization (:func:`ensemble.tables.files.init_rows`: the
same row the export writes for a row nobody touched). The rows live in memory up to a budget, then in
a file of the work folder (``numpy.memmap``: the page cache holds what is hot), so resident memory is
bounded by the budget, not the tables.

A step (:meth:`TrainingRows.gather`) deduplicates the batch's ids per table and hands the framework one
array of the unique rows and, per position, which of them it is; the framework gathers from that array,
so its backward pass sums the gradient of each unique row, and :meth:`TrainingRows.apply` updates
exactly those rows. Both DLRMs train this way (their MLPs with Adam, in torch or Keras).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ensemble.models.artifacts import TOUCHED_ROWS as TOUCHED  # <model dir>/touched/<table>.npz: ids, rows, counts
from ensemble.tables import files
ADAGRAD_EPS = 1e-8


@dataclass(frozen=True)
class TableShape:
    """A table to train: its name, rows (the bucket count) and initialization seed."""

    name: str
    rows: int
    seed: int


class _Table:
    """One table's touched rows."""

    def __init__(self, shape: TableShape, dim: int, spill: Path | None, init=None):
        from ensemble.native import _tables

        self.shape, self.dim, self.spill = shape, dim, spill
        # a new row's first value: its initialization, or (init(name, ids)) the release training started from
        self.init = init or (lambda name, ids: files.init_rows(shape.seed, ids, dim))
        self.map = _tables.Map()
        self.capacity = 0
        self.rows = np.zeros((0, dim), np.float32)
        self.state = np.zeros(0, np.float32)
        self.counts = np.zeros(0, np.uint32)
        self.on_disk = False

    @property
    def size(self) -> int:
        return len(self.map)

    def nbytes(self) -> int:
        return self.capacity * (4 * self.dim + 8) + self.map.nbytes

    def grow(self, need: int, to_disk, keep: int) -> None:
        """Room for ``need`` rows, the first ``keep`` kept; in a file when ``to_disk(bytes it adds)`` says so."""
        capacity = max(1024, self.capacity)
        while capacity < need:
            capacity *= 2
        if self.spill is not None and (self.on_disk or to_disk((capacity - self.capacity) * (4 * self.dim + 8))):
            path = self.spill / f"{self.shape.name}.rows.f32"
            rows = np.lib.format.open_memmap(path.with_suffix(".new.npy"), "w+", np.float32, (capacity, self.dim))
            rows[:keep] = self.rows[:keep]
            del self.rows
            path.with_suffix(".new.npy").replace(path.with_suffix(".npy"))
            self.rows = np.lib.format.open_memmap(path.with_suffix(".npy"), "r+")
            self.on_disk = True
        else:
            rows = np.empty((capacity, self.dim), np.float32)
            rows[:keep] = self.rows[:keep]
            self.rows = rows
        state = np.zeros(capacity, np.float32)
        state[:keep] = self.state[:keep]
        counts = np.zeros(capacity, np.uint32)
        counts[:keep] = self.counts[:keep]
        self.state, self.counts, self.capacity = state, counts, capacity

    def slots(self, unique_ids: np.ndarray, to_disk) -> np.ndarray:
        """The slots of ``unique_ids`` (int64 [u], distinct), adding the new ones with their initial rows
        (``to_disk(bytes)``: whether growing by that much goes past the memory budget)."""
        before = self.size
        out = np.empty(len(unique_ids), np.int32)
        added = self.map.add(np.ascontiguousarray(unique_ids, np.int64), out)
        if added:
            if self.size > self.capacity:
                self.grow(self.size, to_disk, before)
            new = out >= before
            self.rows[out[new]] = self.init(self.shape.name, unique_ids[new])
        return out


class TrainingRows:
    """Every table's touched rows for one DLRM: in memory up to ``budget_bytes``, then in files under
    ``spill`` (None: memory only).

    Example::

        rows = TrainingRows([TableShape("C1", 40_000_000, 7)], dim=128, learning_rate=0.05)
        unique, where = rows.gather(ids)          # ids [B x F] int64
        # pooled [B x F x dim] = unique[where]; the framework's gradient of `unique`:
        rows.apply(grad)                          # float32 [len(unique) x dim]
    """

    def __init__(self, shapes: list[TableShape], dim: int, learning_rate: float = 0.05,
                 budget_bytes: int = 8 << 30, spill: Path | None = None, init=None):
        self.shapes, self.dim, self.learning_rate = list(shapes), dim, learning_rate
        self.budget_bytes = budget_bytes
        if spill is not None:
            Path(spill).mkdir(parents=True, exist_ok=True)
        self.tables = [_Table(s, dim, Path(spill) if spill is not None else None, init) for s in shapes]
        self._init = init
        self._last: list[tuple[np.ndarray, int]] | None = None

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.tables)

    @property
    def touched(self) -> int:
        return sum(t.size for t in self.tables)

    def gather(self, ids: np.ndarray, counting: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """A batch's unique rows and where each position's row is among them.

        Args:
            ids: int64 [B x F], column c an id of table c.
            counting: count the lookups (training's batches do; scoring held-out rows does not).

        Returns:
            (unique float32 [U x dim], where int64 [B x F]): position (b, c)'s row is ``unique[where[b, c]]``.
        """
        ids = np.asarray(ids, np.int64)
        parts, where, offset, last = [], np.empty(ids.shape, np.int64), 0, []
        to_disk = lambda extra: self.nbytes() + extra > self.budget_bytes  # noqa: E731
        for c, table in enumerate(self.tables):  # every id checked before any row is added
            column = ids[:, c]
            if column.size and (column.min() < 0 or column.max() >= table.shape.rows):
                bad = int(np.nonzero((column < 0) | (column >= table.shape.rows))[0][0])
                raise ValueError(f"row {bad}, table {table.shape.name}: id {int(column[bad])} is outside its "
                                 f"{table.shape.rows} rows")
        for c, table in enumerate(self.tables):
            column = ids[:, c]
            unique, inverse = np.unique(column, return_inverse=True)
            slots = table.slots(unique, to_disk)
            if counting:  # every lookup counts, a repeated one as often as it repeats
                table.counts[slots] += np.bincount(inverse, minlength=len(unique)).astype(np.uint32)
            parts.append(table.rows[slots])
            where[:, c] = inverse + offset
            last.append((slots, offset))
            offset += len(unique)
        self._last = last
        return (np.concatenate(parts) if parts else np.zeros((0, self.dim), np.float32)), where

    def apply(self, grad: np.ndarray) -> None:
        """Rowwise Adagrad on the rows of the last :meth:`gather`: each row's state grows by its
        gradient's mean square, the row moves by ``learning_rate * g / sqrt(state)``."""
        if self._last is None:
            raise RuntimeError("apply() follows a gather()")
        grad = np.asarray(grad, np.float32)
        for table, (slots, offset) in zip(self.tables, self._last):
            g = grad[offset:offset + len(slots)]
            state = table.state[slots] + np.mean(g * g, axis=1)
            table.state[slots] = state
            table.rows[slots] -= (self.learning_rate / (np.sqrt(state) + ADAGRAD_EPS))[:, None] * g
        self._last = None

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """float32 [B x F x dim]: each position's row (touched, or its initialization), nothing counted
        or added (scoring held-out rows)."""
        ids = np.asarray(ids, np.int64)
        out = np.empty((*ids.shape, self.dim), np.float32)
        for c, table in enumerate(self.tables):
            found = np.empty(len(ids), np.int32)
            table.map.find(np.ascontiguousarray(ids[:, c]), found)
            hit = found >= 0
            out[hit, c] = table.rows[found[hit]]
            if (~hit).any():
                out[~hit, c] = table.init(table.shape.name, ids[~hit, c])
        return out

    def save(self, folder: Path, init_from: Path | None = None) -> Path:
        """Each table's touched ids (sorted), rows and counts under ``folder/touched/`` (and the version folder
        training started from, ``init_from``); returns that folder."""
        out = Path(folder) / TOUCHED
        out.mkdir(parents=True, exist_ok=True)
        for table in self.tables:
            keys = np.empty(table.size, np.int64)
            table.map.keys(keys)
            order = np.argsort(keys, kind="stable")
            np.savez(out / f"{table.shape.name}.npz", ids=keys[order], rows=np.asarray(table.rows[:table.size])[order],
                     counts=table.counts[:table.size][order])
        (out / "tables.json").write_text(json.dumps({
            "dim": self.dim, "tables": [{"name": s.name, "rows": s.rows, "seed": s.seed} for s in self.shapes],
            "touched": self.touched, "on_disk": [t.shape.name for t in self.tables if t.on_disk]}, indent=1))
        if init_from is not None:
            (out / "init_from.json").write_text(json.dumps({"version_dir": str(Path(init_from).resolve())}))
        return out


@dataclass(frozen=True)
class Touched:
    """One table's rows as training left them (:meth:`TrainingRows.save`)."""

    shape: TableShape
    ids: np.ndarray  # int64 [t], sorted
    rows: np.ndarray  # float32 [t x dim]
    counts: np.ndarray  # uint32 [t]


def load_touched(folder: Path) -> tuple[int, list[Touched]]:
    """(dim, every table's touched rows) from a model folder's ``touched/``."""
    folder = Path(folder) / TOUCHED
    meta = json.loads((folder / "tables.json").read_text())
    found = []
    for raw in meta["tables"]:
        shape = TableShape(raw["name"], int(raw["rows"]), int(raw["seed"]))
        with np.load(folder / f"{shape.name}.npz") as data:
            found.append(Touched(shape, data["ids"], data["rows"], data["counts"]))
    return int(meta["dim"]), found


def rows_of_release(version_dir: Path):
    """(table name, ids) -> float32 rows as that release serves them."""
    manifest = files.TablesManifest.load(version_dir)
    by_name = {t.name: t for t in manifest.tables}
    return lambda name, ids: files.stored_rows(version_dir, by_name[name], manifest.format, manifest.dim, ids)


def has_touched(folder: Path) -> bool:
    return (Path(folder) / TOUCHED / "tables.json").is_file()


def train(name: str, fit, rows: TrainingRows, train_source, valid_source, epochs: int, log=print) -> dict:
    """Train a DLRM whose rows are ``rows``: each batch's unique rows gathered, the framework's step
    (``fit``: a ``PooledFit`` of :mod:`ensemble.models.dlrm_torch` or :mod:`~ensemble.models.dlrm_tf`) run on
    them, their gradient applied to those rows alone. Every epoch is kept (a table's rows are too many to
    hold a second copy of the best); each epoch's validation is logged.

    Returns:
        Per epoch, the validation log loss and AUC, and the rows touched.
    """
    import time

    from ensemble.models import metrics
    from ensemble.models.dlrm import score_source

    history = []
    for epoch in range(epochs):
        start = time.perf_counter()
        for dense, ids, labels in train_source.epoch(epoch):
            unique, where = rows.gather(ids)
            rows.apply(fit.step(dense, unique, where, labels))
        scores, labels = score_source(lambda d, i: fit.predict(d, rows.rows_of(i)), valid_source)
        loss, auc = metrics.log_loss(labels, scores), metrics.auc(labels, scores)
        history.append({"epoch": epoch + 1, "valid_logloss": loss, "valid_auc": auc, "touched_rows": rows.touched,
                        "rows_bytes": rows.nbytes(), "seconds": time.perf_counter() - start})
        log(f"  {name} epoch {epoch + 1}: valid logloss {loss:.4f} auc {auc:.4f}; {rows.touched:,} rows touched "
            f"({rows.nbytes() / 2**20:.0f} MiB{', part on disk' if any(t.on_disk for t in rows.tables) else ''})")
    return {"epochs": history}
