"""Rows no release was trained on, for checks before a release serves, the acceptance run and the tests."""

from __future__ import annotations

import numpy as np

from ensemble import schema
from ensemble.data import criteo
from ensemble.features import transforms


def fresh_rows(n: int = 256, seed: int = 20261122, widths: schema.Widths = schema.CRITEO_WIDTHS, *,
               scale: float = 0.01, edge_cases: bool = False, labels: bool = False):
    """``n`` rows of a dataset's ``widths``: synthetic Criteo rows (``scale``: the generator's vocabulary scale)
    for Criteo, else random values (unseen categories, missing values included) for another dataset.

    Args:
        edge_cases: add the edge-case rows (``ensemble.data.edge_cases``: odd floats, empty and huge values;
            Criteo widths only).
        labels: also return each row's label (0 for the edge cases and another dataset's rows).

    Returns:
        (dense [rows x dense] float32, categorical [rows x categorical] bytes), and labels [rows] when asked.
    """
    if widths == schema.CRITEO_WIDTHS:
        frame = criteo.synthesize(criteo.SynthConfig(rows=n, scale=scale, seed=seed)).frame
        dense, categorical = transforms.dense_array(frame), transforms.encode_categorical(frame)
        y = frame[schema.LABEL].to_numpy()
    else:
        rng = np.random.default_rng(seed)
        dense = rng.normal(0, 10, (n, widths.dense)).astype(np.float32)
        dense[rng.random(dense.shape) < 0.1] = np.nan
        categorical = np.array([[f"fresh-{v:x}".encode() for v in row]
                                for row in rng.integers(0, 2**20, (n, widths.categorical))], dtype=object)
        y = np.zeros(n, np.int64)
    if edge_cases:
        if widths != schema.CRITEO_WIDTHS:
            raise ValueError("the edge-case rows have Criteo's widths")
        from ensemble.data.edge_cases import edge_case_rows

        edge_dense, edge_cats = edge_case_rows(np.random.default_rng(seed))
        dense, categorical = np.concatenate([dense, edge_dense]), np.concatenate([categorical, edge_cats])
        y = np.concatenate([y, np.zeros(len(edge_dense), y.dtype)])
    return (dense, categorical, y) if labels else (dense, categorical)
