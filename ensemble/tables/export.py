"""A row store DLRM's export: every row of every table written into the version folder, in the format
the held-out rows allow, sharing what did not change with the release before.

1. The format (:func:`choose_format`): the held-out test rows scored with their rows in fp32, fp16 and
   int8 (each row encoded and decoded as the server would read it); the smallest format whose AUC is
   within :data:`ensemble.models.engines.AUC_TOLERANCE` of fp32 is the release's. A format the disk cannot
   hold is not chosen; when none fits, the export stops and says how much it needed.
2. The tables (:func:`write_tables`): a table whose release was trained from the one before
   (``ensemble train --init-from``) and changed few of its rows shares that release's file (a hard
   link: no copy) and writes only the changed rows (``<table>.delta.rows``, held in RAM by the server),
   small tables as large ones; any other table is written whole. ``tables.json`` says which, and what was
   written (every file of the export's tables) against what was shared.
3. The warm file: the large tables' trained rows, most touched first, which the server reads at load to
   fill its hot tier (a row in its table's delta is not repeated there: the delta is in RAM already);
   ``counts.npz``: what ``ensemble tables`` predicts hit rates from.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from ensemble.tables import files, training
from ensemble.tables.files import Delta, TableEntry, TablesManifest
from ensemble.tables.mlp import MlpWeights

LOG = logging.getLogger(__name__)
# A table shares the file of the release before when at most this share of its rows changed. A small table
# is in RAM either way: up to half, so that an export writes at most twice the changed rows' bytes. A large
# table's delta sits in RAM beside the hot tier: up to a quarter.
DELTA_SHARE = {"small": 0.5, "large": 0.25}
SPACE_MARGIN = 1 << 30  # free bytes an export leaves on the disk
INIT_FROM = "init_from.json"  # in a training run's model folder: the release its rows started from


class ExportError(RuntimeError):
    """The tables cannot be written (no format passes and fits)."""


def _pooled(touched: list[training.Touched], dim: int, ids: np.ndarray, init_from) -> np.ndarray:
    """float32 [B x F x dim]: each held-out position's row as training left it (trained, the release it started
    from, or its initialization)."""
    out = np.empty((*ids.shape, dim), np.float32)
    for c, table in enumerate(touched):
        column = ids[:, c]
        at = np.searchsorted(table.ids, column)
        hit = (at < len(table.ids)) & (table.ids[np.minimum(at, max(len(table.ids) - 1, 0))] == column)
        if len(table.ids):
            out[hit, c] = table.rows[at[hit]]
        if (~hit).any():
            out[~hit, c] = init_from(c, column[~hit])
    return out


def choose_format(weights: MlpWeights, touched: list[training.Touched], dim: int, held_out, init_from,
                  bytes_of) -> tuple[str, dict]:
    """The release's row format and every format's held-out AUC.

    Args:
        held_out: (dense, ids, labels) test rows, or None (then int8 is not chosen: fp16 if it fits).
        init_from: (table index, ids) -> float32 rows of ids training did not touch.
        bytes_of: format -> bytes the tables would take on disk.
    """
    from ensemble.models import engines, metrics

    free = shutil.disk_usage(os.getcwd()).free  # the caller runs in the repository's file system
    fits = {fmt: bytes_of(fmt) + SPACE_MARGIN <= free for fmt in files.FORMATS}
    accuracy: dict = {"disk_bytes": {fmt: bytes_of(fmt) for fmt in files.FORMATS}, "free_bytes": free}
    if held_out is None:
        chosen = next((fmt for fmt in ("fp16", "fp32") if fits[fmt]), None)
    else:
        dense, ids, labels = held_out
        pooled = _pooled(touched, dim, ids, init_from)
        aucs = {}
        for fmt in files.FORMATS:
            rows = pooled if fmt == "fp32" else files.decode(files.encode(pooled.reshape(-1, dim), fmt), fmt,
                                                             dim).reshape(pooled.shape)
            aucs[fmt] = metrics.auc(labels, weights.score(dense, rows))
        accuracy["held_out_auc"] = aucs
        accuracy["held_out_rows"] = int(len(labels))
        chosen = next((fmt for fmt in ("int8", "fp16", "fp32")
                       if fits[fmt] and abs(aucs[fmt] - aucs["fp32"]) <= engines.AUC_TOLERANCE), None)
    if chosen is None:
        passing = [f for f in files.FORMATS if held_out is None or
                   abs(accuracy["held_out_auc"][f] - accuracy["held_out_auc"]["fp32"]) <= 1e-3]
        raise ExportError(f"no row format both keeps the held-out AUC and fits the disk: {free / 1e9:.1f} GB free, "
                          + ", ".join(f"{f} needs {bytes_of(f) / 1e9:.1f} GB" for f in passing))
    accuracy["chosen"] = chosen
    return chosen, accuracy


def _previous(staging: Path) -> Path | None:
    """The newest version folder beside the one being exported."""
    versions = [p for p in staging.parent.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(versions, key=lambda p: int(p.name)) if versions else None


def _init_source(model_folder: Path, touched: list[training.Touched], dim: int):
    """(table index, ids) -> float32 rows of ids training did not touch: the rows of the release training started
    from (``ensemble train --init-from``), else their initialization; and that release's folder (or None)."""
    record = model_folder / training.TOUCHED / INIT_FROM
    if record.is_file():
        source = Path(json.loads(record.read_text())["version_dir"])
        manifest = TablesManifest.load(source)
        by_name = {t.name: t for t in manifest.tables}

        def rows(c: int, ids: np.ndarray) -> np.ndarray:
            return files.stored_rows(source, by_name[touched[c].shape.name], manifest.format, manifest.dim, ids)

        return rows, source
    return (lambda c, ids: files.init_rows(touched[c].shape.seed, ids, dim)), None


def export_tables(staging: Path, step: str, held_out=None, log=LOG.info) -> TablesManifest:
    """Write a row store DLRM's tables into its staged version folder (the rows training touched are in
    ``staging/touched``, copied there from the training run; they are removed once written).

    Returns:
        The written ``tables.json``.
    """
    staging = Path(staging)
    dim, touched = training.load_touched(staging)
    weights = MlpWeights.load(staging)
    init_from, source = _init_source(staging, touched, dim)
    shapes = [t.shape for t in touched]
    previous = _previous(staging)
    base = TablesManifest.load(previous) if previous is not None and files.has_tables(previous) else None
    shares = (base is not None and source is not None and source.resolve() == previous.resolve()
              and base.dim == dim
              and [(t.name, t.rows, t.seed) for t in base.tables] == [(s.name, s.rows, s.seed) for s in shapes])

    def bytes_of(fmt: str) -> int:
        """What the export would write in this format: a table that may share the release before's file
        counts its delta at most (every touched row and the earlier delta's), any other its whole file."""
        total = 0
        for table in touched:
            rows = table.shape.rows
            before = next(t for t in base.tables if t.name == table.shape.name) if shares and base.format == fmt \
                else None
            if before is not None and len(table.ids) <= _delta_share(rows) * rows:
                earlier = before.delta.rows if before.delta is not None else 0
                total += files.file_bytes(len(table.ids) + earlier, fmt, dim) + 8 * (len(table.ids) + earlier)
            else:
                total += files.file_bytes(rows, fmt, dim)
        return total

    fmt, accuracy = choose_format(weights, touched, dim, held_out, init_from, bytes_of)
    shareable = shares and base.format == fmt
    folder = staging / files.TABLES_DIR
    folder.mkdir(exist_ok=True)
    entries, written, shared, changed_rows = [], 0, 0, 0
    in_delta: dict[str, np.ndarray] = {}  # table -> its delta's ids
    for table in touched:
        shape = table.shape
        name = f"{files.TABLES_DIR}/{shape.name}.rows"
        small = files.is_small(shape.rows)
        before = next(t for t in base.tables if t.name == shape.name) if shareable else None
        if before is not None:
            changed_ids, changed = _changed(previous, before, fmt, dim, table)
            changed_rows += len(changed_ids)
            if len(changed_ids) <= _delta_share(shape.rows) * shape.rows:
                os.link(previous / before.file, staging / name)
                delta = _merge_delta(previous, before, fmt, dim, changed_ids, changed)
                d_rows, d_ids = f"{files.TABLES_DIR}/{shape.name}.delta.rows", f"{files.TABLES_DIR}/{shape.name}.delta.ids.npy"
                written += files.write_rows_file(staging / d_rows, delta[1], fmt, dim)
                np.save(staging / d_ids, delta[0])
                written += (staging / d_ids).stat().st_size
                in_delta[shape.name] = delta[0]
                shared += before.bytes
                entries.append(TableEntry(shape.name, shape.rows, shape.seed, name, small, before.bytes,
                                          Delta(d_rows, d_ids, int(len(delta[0]))),
                                          before.shared_from or previous.name))
                log(f"{step} {shape.name}: {len(changed_ids):,} rows changed, {len(delta[0]):,} in its delta; the "
                    f"rest shared with version {previous.name}")
                continue
        if before is None:
            changed_rows += shape.rows
        if source is not None:  # rows from the release training started from, the trained ones over them
            written += _write_over(source, staging / name, shape, fmt, dim, table)
        else:
            written += files.write_table(staging / name, shape.rows, dim, fmt, shape.seed, table.ids, table.rows)
        entries.append(TableEntry(shape.name, shape.rows, shape.seed, name, small, files.file_bytes(shape.rows, fmt, dim)))
    big_in_delta = all(t.shape.name in in_delta for t in touched if not files.is_small(t.shape.rows))
    earlier_warm = [previous / files.TABLES_DIR / name for name in (files.WARM_ROWS, files.WARM_KEYS)] \
        if shareable else []
    if shareable and big_in_delta and all(p.is_file() for p in earlier_warm):
        # every large table shares the release before's file: its warm rows are this release's too (the rows
        # this training changed are in the deltas, in RAM at load: the warm-up skips them), so the file is shared
        for path in earlier_warm:
            os.link(path, folder / path.name)
            shared += path.stat().st_size
        log(f"{step}: the warm file shared with version {previous.name} (its rows unchanged but the deltas')")
    else:
        written += _write_warm(staging, touched, fmt, dim, in_delta, log=log)
    np.savez(staging / files.TABLES_DIR / files.COUNTS, **{f"{t.shape.name}.ids": t.ids for t in touched},
             **{f"{t.shape.name}.counts": t.counts for t in touched})
    written += (staging / files.TABLES_DIR / files.COUNTS).stat().st_size
    warm_rows = int(len(np.load(staging / files.TABLES_DIR / files.WARM_KEYS)))
    manifest = TablesManifest(fmt, dim, tuple(entries), warm_rows, accuracy, written, shared, changed_rows)
    manifest.save(staging)
    shutil.rmtree(staging / training.TOUCHED)
    log(f"{step}: {len(entries)} tables in {fmt} ({manifest.disk_bytes() / 1e9:.2f} GB); wrote {written / 1e9:.2f} GB, "
        f"shared {shared / 1e9:.2f} GB; {changed_rows:,} rows changed")
    return manifest


def _delta_share(rows: int) -> float:
    return DELTA_SHARE["small" if files.is_small(rows) else "large"]


def _changed(previous: Path, before: TableEntry, fmt: str, dim: int, table: training.Touched):
    """The trained rows that differ, as stored, from the previous release's: (ids, encoded rows)."""
    if not len(table.ids):
        return table.ids, np.zeros((0, files.row_bytes(fmt, dim)), np.uint8)
    new = files.encode(table.rows, fmt)
    old = files.encode(files.stored_rows(previous, before, fmt, dim, table.ids), fmt)
    differs = np.any(new != old, axis=1)
    return table.ids[differs], new[differs]


def _merge_delta(previous: Path, before: TableEntry, fmt: str, dim: int, ids: np.ndarray,
                 rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The new delta over the shared file: the previous delta's rows, the changed ones over them."""
    if before.delta is None or not before.delta.rows:
        return ids, rows
    old_ids, old_rows = files.read_delta(previous, before.delta, fmt, dim)
    keep = ~np.isin(old_ids, ids)
    merged_ids = np.concatenate([old_ids[keep], ids])
    merged_rows = np.concatenate([old_rows[keep], rows])
    order = np.argsort(merged_ids, kind="stable")
    return merged_ids[order], merged_rows[order]


def _write_over(source: Path, path: Path, shape, fmt: str, dim: int, table: training.Touched) -> int:
    """A whole table file: the rows of the release training started from, as stored there (its file and its
    delta), the trained rows over them."""
    manifest = TablesManifest.load(source)
    entry = next(t for t in manifest.tables if t.name == shape.name)
    delta = files.read_delta(source, entry.delta, manifest.format, manifest.dim) if entry.delta and entry.delta.rows \
        else None

    def base(first: int, count: int) -> np.ndarray:
        ids = np.arange(first, first + count, dtype=np.int64)
        data = files.read_encoded(source / entry.file, ids)
        if delta is not None:
            lo, hi = np.searchsorted(delta[0], [first, first + count])
            data[delta[0][lo:hi] - first] = delta[1][lo:hi]
        return data

    if manifest.format != fmt or manifest.dim != dim:  # another format: decoded and encoded again
        return files.write_table(path, shape.rows, dim, fmt, shape.seed, table.ids, table.rows,
                                 base=lambda first, count: files.encode(
                                     files.decode(base(first, count), manifest.format, dim), fmt))
    return files.write_table(path, shape.rows, dim, fmt, shape.seed, table.ids, table.rows, base=base)


def _write_warm(staging: Path, touched: list[training.Touched], fmt: str, dim: int,
                in_delta: dict[str, np.ndarray], max_bytes: int = files.WARM_FILE_BYTES, log=LOG.info) -> int:
    """The large tables' trained rows, the most looked-up first (ties by table and id), but those in their
    table's delta (in RAM at load already); at most ``max_bytes`` of rows (a hot tier cannot hold more: a
    long training touches most rows, and a warm file as large as the tables would double the disk)."""
    keys, rows, counts = [], [], []
    for c, table in enumerate(touched):
        if files.is_small(table.shape.rows) or not len(table.ids):
            continue
        keep = ~np.isin(table.ids, in_delta[table.shape.name]) if table.shape.name in in_delta else slice(None)
        keys.append((np.int64(c) << files.KEY_SHIFT) | table.ids[keep])
        rows.append(table.rows[keep])
        counts.append(table.counts[keep])
    folder = staging / files.TABLES_DIR
    if not keys:
        np.save(folder / files.WARM_KEYS, np.zeros(0, np.int64))
        return files.write_rows_file(folder / files.WARM_ROWS, np.zeros((0, files.row_bytes(fmt, dim)), np.uint8), fmt, dim)
    keys, rows, counts = np.concatenate(keys), np.concatenate(rows), np.concatenate(counts)
    order = np.lexsort((keys, -counts.astype(np.int64)))
    most = max(0, max_bytes // files.row_bytes(fmt, dim))
    if len(order) > most:
        log(f"the warm file holds the {most:,} most looked-up of {len(order):,} trained rows "
            f"({max_bytes / 2**30:.2f} GiB, files.WARM_FILE_BYTES)")
        order = order[:most]
    np.save(folder / files.WARM_KEYS, keys[order])
    return files.write_rows_file(folder / files.WARM_ROWS, files.encode(rows[order], fmt), fmt, dim) + \
        (folder / files.WARM_KEYS).stat().st_size
