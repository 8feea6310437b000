"""A dataset's own files: CSV or TSV with a header, or Parquet, read as its spec describes.

Continuous columns are read as float32 (empty = missing), categorical columns as strings (empty =
missing, so ``007`` stays ``007``), the label as int8; other columns are kept as pandas reads them
(a time column, ids a report may want). The spec then checks the frame (:meth:`DatasetSpec.check_frame`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ensemble.dataset import DatasetSpec, cell_bytes


def read_table(paths: Sequence[str | Path], spec: DatasetSpec, nrows: int | None = None,
               with_label: bool = True) -> pd.DataFrame:
    """Read and check one frame from files in order (``.csv``, ``.tsv``/``.txt``, ``.parquet``;
    compressed CSV/TSV too, by pandas' suffix rules)."""
    frames, remaining = [], nrows
    for path in map(Path, paths):
        if remaining is not None and remaining <= 0:
            break
        suffixes = [s.lower() for s in path.suffixes]
        if ".parquet" in suffixes or ".pq" in suffixes:
            frame = pd.read_parquet(path)
            if remaining is not None:
                frame = frame.iloc[:remaining]
            for column in spec.categorical:  # text; a multi-hot column's lists joined by the separator
                if column in frame.columns:
                    frame[column] = frame[column].map(lambda v: _text(v, spec.list_separator))
        else:
            sep = "\t" if ".tsv" in suffixes or ".txt" in suffixes else ","
            dtypes = {**{c: "float32" for c in spec.continuous}, **{c: "object" for c in spec.categorical}}
            frame = pd.read_csv(path, sep=sep, dtype=dtypes, keep_default_na=False,
                                na_values={c: [""] for c in (*spec.continuous, *spec.categorical, spec.label)},
                                nrows=remaining)
        frames.append(frame)
        if remaining is not None:
            remaining -= len(frame)
    if not frames:
        raise ValueError("no input files given")
    frame = pd.concat(frames, ignore_index=True)
    spec.check_frame(frame, with_label=with_label)
    for column in spec.continuous:
        frame[column] = frame[column].astype(np.float32)
    if with_label:
        frame[spec.label] = frame[spec.label].astype(np.int8)
    return frame


def split(frame: pd.DataFrame, valid: float = 0.1, test: float = 0.1, time: str | None = None
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Train on the earliest rows, validate on the next, test on the latest: by ``time`` when given
    (a stable sort), else in file order."""
    if time is not None:
        frame = frame.sort_values(time, kind="stable")
    n = len(frame)
    n_test, n_valid = int(n * test), int(n * valid)
    n_train = n - n_valid - n_test
    parts = frame.iloc[:n_train], frame.iloc[n_train:n_train + n_valid], frame.iloc[n_train + n_valid:]
    return tuple(p.reset_index(drop=True) for p in parts)  # type: ignore[return-value]


def _text(value, separator: str) -> str | None:
    if isinstance(value, (list, tuple, np.ndarray)):
        return cell_bytes(value, separator).decode()
    return None if value is None or value != value else str(value)
