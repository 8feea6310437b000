"""Turn what callers have into the two request tensors.

Accepted: a ``(dense, categorical)`` pair of arrays, a pandas DataFrame or pyarrow Table with
the Criteo column names (``I1..I13``, ``C1..C26``; others ignored), or raw Criteo TSV lines
(with or without the leading label). The column mapping comes from ``ensemble.schema``.
pandas is imported only for the inputs that need it (frames, Arrow tables, TSV lines): a caller
that passes arrays imports numpy and tritonclient, nothing heavier.
"""

from __future__ import annotations

import io
from typing import Iterable

import numpy as np

from ensemble import schema


def from_frame(frame) -> tuple[np.ndarray, np.ndarray]:
    """pandas DataFrame with Criteo columns -> ([B x 13] float32, [B x 26] bytes objects)."""
    from ensemble.features import transforms

    missing = [c for c in (*schema.DENSE_COLUMNS, *schema.CATEGORICAL_COLUMNS) if c not in frame.columns]
    if missing:
        raise ValueError(f"input lacks Criteo columns {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return transforms.dense_array(frame), transforms.encode_categorical(frame)


def from_arrow(table) -> tuple[np.ndarray, np.ndarray]:
    """pyarrow Table (or RecordBatch) with Criteo columns -> request tensors."""
    columns = [*schema.DENSE_COLUMNS, *schema.CATEGORICAL_COLUMNS]
    return from_frame(table.select(columns).to_pandas())


def from_tsv_lines(lines: Iterable[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Raw Criteo TSV lines (label optional, decided from the first line) -> request tensors."""
    from ensemble.data import criteo

    blob = b"".join((line.encode() if isinstance(line, str) else line).rstrip(b"\r\n") + b"\n" for line in lines)
    if not blob:
        return np.empty((0, schema.N_DENSE), np.float32), np.empty((0, schema.N_CATEGORICAL), object)
    with_label = criteo.has_label(blob.split(b"\n", 1)[0])
    return from_frame(criteo.parse_criteo(io.BytesIO(blob), with_label=with_label, compression=None))


def to_tensors(rows, categorical: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dispatch on the input's kind: the two arrays (``rows, categorical``), a DataFrame or pyarrow
    Table with Criteo columns, Criteo TSV lines, or one TSV line as a string."""
    if categorical is not None:
        dense = np.asarray(rows, dtype=np.float32)
        cats = np.asarray(categorical, dtype=object)
        if cats.size and not isinstance(cats.flat[0], bytes):
            cats = np.vectorize(lambda v: v.encode() if isinstance(v, str) else (v or b""), otypes=[object])(cats)
        return dense, cats
    if hasattr(rows, "to_pandas") and hasattr(rows, "schema"):
        return from_arrow(rows)
    if hasattr(rows, "columns") and hasattr(rows, "iloc"):
        return from_frame(rows)
    if isinstance(rows, (str, bytes)):  # one Criteo TSV line
        return from_tsv_lines([rows])
    if isinstance(rows, (list, tuple)) and (not rows or isinstance(rows[0], (str, bytes))):
        return from_tsv_lines(rows)
    raise TypeError(f"cannot score a {type(rows).__name__}: pass (dense, categorical) arrays, "
                    "a DataFrame or pyarrow Table with Criteo columns, or Criteo TSV lines")
