"""Turn what callers have into the two request tensors.

Accepted: a ``(dense, categorical)`` pair of arrays, a pandas DataFrame or pyarrow Table with
the dataset spec's column names (Criteo's ``I1..I13``, ``C1..C26`` unless another spec is given;
others ignored), or raw Criteo TSV lines (with or without the leading label). The column mapping
comes from the spec (:mod:`ensemble.dataset`).
pandas is imported only for the inputs that need it (frames, Arrow tables, TSV lines): a caller
that passes arrays imports numpy and tritonclient, nothing heavier.
"""

from __future__ import annotations

import io
from typing import Iterable

import numpy as np

from clients.wire import WireStrings
from ensemble import schema
from ensemble.dataset import DatasetSpec


def from_frame(frame, spec: DatasetSpec = schema.CRITEO) -> tuple[np.ndarray, np.ndarray]:
    """pandas DataFrame with the spec's columns -> ([B x continuous] float32, [B x categorical]
    bytes objects)."""
    from ensemble.features import transforms

    missing = [c for c in (*spec.continuous, *spec.categorical) if c not in frame.columns]
    if missing:
        raise ValueError(f"input lacks {spec.name} columns {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return (transforms.dense_array(frame, spec.continuous),
            transforms.encode_categorical(frame, spec.categorical, spec.list_separator))


def from_arrow(table, spec: DatasetSpec = schema.CRITEO) -> tuple[np.ndarray, np.ndarray]:
    """pyarrow Table (or RecordBatch) with the spec's columns -> request tensors."""
    columns = [c for c in (*spec.continuous, *spec.categorical) if c in table.schema.names]
    return from_frame(table.select(columns).to_pandas(), spec)


def from_tsv_lines(lines: Iterable[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Raw Criteo TSV lines (label optional, decided from the first line) -> request tensors."""
    from ensemble.data import criteo

    blob = b"".join((line.encode() if isinstance(line, str) else line).rstrip(b"\r\n") + b"\n" for line in lines)
    if not blob:
        return np.empty((0, schema.N_DENSE), np.float32), np.empty((0, schema.N_CATEGORICAL), object)
    with_label = criteo.has_label(blob.split(b"\n", 1)[0])
    return from_frame(criteo.parse_criteo(io.BytesIO(blob), with_label=with_label, compression=None))


def _encode(values, separator: str = "|") -> np.ndarray:
    from ensemble.dataset import cell_bytes

    if isinstance(values, (list, tuple)) and any(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        values = [cell_bytes(v, separator) for v in values]  # a multi-hot context value given as a list
    cats = np.asarray(values, dtype=object)
    if cats.size and not all(isinstance(v, bytes) for v in cats.flat):
        cats = np.vectorize(lambda v: cell_bytes(v, separator) if isinstance(v, (str, bytes)) else
                            (cell_bytes(v, separator) if isinstance(v, (list, tuple, np.ndarray)) else b""),
                            otypes=[object])(cats)
    return cats


def ranking_tensors(context, candidates, spec: DatasetSpec = schema.CRITEO
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A ranking request's four tensors: the context's continuous and categorical values (1-D) and
    the candidates' ([N x columns]).

    Args:
        context: a ``(continuous, categorical)`` pair of sequences, a mapping (dict, pandas Series)
            from the spec's context columns to values, or None when the spec has no context.
        candidates: a ``(continuous [N x], categorical [N x])`` pair of arrays, or a DataFrame with
            the spec's candidate columns.
    """
    from ensemble.dataset import Kind, Side

    def names(kind, side):
        return [c.name for c in spec.columns if c.kind is kind and c.side is side]

    if context is None:
        context_dense, context_cats = np.zeros(0, np.float32), np.zeros(0, object)
    elif hasattr(context, "keys"):
        missing = [c for c in spec.context if c not in context.keys()]
        if missing:
            raise ValueError(f"context lacks {spec.name} context columns {missing}")
        context_dense = np.array([np.nan if context[c] is None else context[c]
                                  for c in names(Kind.CONTINUOUS, Side.CONTEXT)], np.float32)
        context_cats = _encode([context[c] for c in names(Kind.CATEGORICAL, Side.CONTEXT)], spec.list_separator)
    else:
        context_dense = np.asarray(context[0], np.float32).reshape(-1)
        context_cats = _encode(context[1], spec.list_separator).reshape(-1)
    if hasattr(candidates, "columns") and hasattr(candidates, "iloc"):
        from ensemble.features import transforms

        dense_cols, cat_cols = names(Kind.CONTINUOUS, Side.CANDIDATE), names(Kind.CATEGORICAL, Side.CANDIDATE)
        missing = [c for c in (*dense_cols, *cat_cols) if c not in candidates.columns]
        if missing:
            raise ValueError(f"candidates lack {spec.name} candidate columns {missing[:5]}")
        return (context_dense, context_cats, transforms.dense_array(candidates, tuple(dense_cols)),
                transforms.encode_categorical(candidates, tuple(cat_cols), spec.list_separator))
    dense, cats = candidates
    return context_dense, context_cats, np.asarray(dense, np.float32), _encode(cats, spec.list_separator)


def to_tensors(rows, categorical: np.ndarray | None = None, spec: DatasetSpec = schema.CRITEO
               ) -> tuple[np.ndarray, np.ndarray]:
    """Dispatch on the input's kind: the two arrays (``rows, categorical``), a DataFrame or pyarrow
    Table with the spec's columns, Criteo TSV lines, or one TSV line as a string."""
    if categorical is not None:
        dense = np.asarray(rows, dtype=np.float32)
        if isinstance(categorical, WireStrings):  # already serialized (batch scoring's TSV parser)
            return dense, categorical
        cats = np.asarray(categorical, dtype=object)
        if cats.size and not isinstance(cats.flat[0], bytes):
            cats = np.vectorize(lambda v: v.encode() if isinstance(v, str) else (v or b""), otypes=[object])(cats)
        return dense, cats
    if hasattr(rows, "to_pandas") and hasattr(rows, "schema"):
        return from_arrow(rows, spec)
    if hasattr(rows, "columns") and hasattr(rows, "iloc"):
        return from_frame(rows, spec)
    if isinstance(rows, (str, bytes)):  # one Criteo TSV line
        return from_tsv_lines([rows])
    if isinstance(rows, (list, tuple)) and (not rows or isinstance(rows[0], (str, bytes))):
        return from_tsv_lines(rows)
    raise TypeError(f"cannot score a {type(rows).__name__}: pass (dense, categorical) arrays, "
                    "a DataFrame or pyarrow Table with Criteo columns, or Criteo TSV lines")
