"""Request bodies for the load test, built once before a run (not part of what is measured)."""

from __future__ import annotations

import json

import numpy as np

from ensemble import schema

POOL_SIZE = 256


def v2_json(dense: np.ndarray, cats: np.ndarray, outputs: tuple[str, ...] = (schema.SCORE.name,)) -> bytes:
    """Triton's v2 JSON inference body; json.dumps writes bare NaN, which Triton's parser takes."""
    return json.dumps({
        "inputs": [{"name": schema.DENSE.name, "shape": list(dense.shape), "datatype": schema.DENSE.dtype.wire,
                    "data": dense.ravel().tolist()},
                   {"name": schema.CATEGORICAL.name, "shape": list(cats.shape), "datatype": schema.CATEGORICAL.dtype.wire,
                    "data": [v.decode("utf-8", "replace") for v in cats.ravel()]}],
        "outputs": [{"name": name} for name in outputs]}).encode()


class Payloads:
    """``POOL_SIZE`` requests of ``rows`` rows drawn from a held-out Criteo TSV, as arrays and JSON."""

    def __init__(self, data_file: str, rows: int, seed: int = 0):
        from clients.inputs import from_tsv_lines

        with open(data_file, "rb") as handle:
            lines = handle.read().splitlines()[:20_000]
        dense, cats = from_tsv_lines(lines)
        rng = np.random.default_rng(seed)
        picks = [rng.integers(0, len(dense), rows) for _ in range(POOL_SIZE)]
        self.arrays = [(dense[p], cats[p]) for p in picks]
        self.json = [v2_json(d, c) for d, c in self.arrays]
