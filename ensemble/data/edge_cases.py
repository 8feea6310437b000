"""Rows a real client may send that training data never has, for parity checks (the demo, the
tests): the served ranker must score them like the in-process pipeline."""

from __future__ import annotations

import numpy as np

from ensemble import schema


def edge_case_rows(rng: np.random.Generator, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Rows a real client may send: everything missing, unseen/odd strings, negative, huge and
    non-finite integers. Returns ([n x 13] float32, [n x 26] bytes objects)."""
    dense = rng.integers(-5, 1000, (n, schema.N_DENSE)).astype(np.float32)
    dense[0] = np.nan
    dense[1, :4] = [np.inf, -np.inf, 3.0e38, -1e9]
    dense[2] = 1e30
    cats = np.array([[f"{v:08x}".encode() for v in row] for row in rng.integers(0, 2**32, (n, 26))], dtype=object)
    cats[0] = b""
    cats[3, :5] = [b"not-hex!", b"x" * 5000, "\u00e9\u00e8".encode(), b"\xff\xfe", b"  "]
    cats[4, ::2] = b""
    return dense, cats
