"""Request bodies for the load test, built once before a run (not part of what is measured)."""

from __future__ import annotations

import numpy as np

from ensemble import schema

POOL_SIZE = 256


class Payloads:
    """``POOL_SIZE`` requests of ``rows`` rows drawn from a held-out Criteo TSV, as arrays and JSON.

    ``strict_json``: missing dense values as 0 instead of NaN, for a server whose JSON parser
    follows the JSON standard (MLServer's orjson refuses a bare NaN; Triton takes it). The rows
    cost the pipeline the same; their scores differ."""

    def __init__(self, data_file: str, rows: int, seed: int = 0, strict_json: bool = False):
        from clients.inputs import from_tsv_lines

        with open(data_file, "rb") as handle:
            lines = handle.read().splitlines()[:20_000]
        dense, cats = from_tsv_lines(lines)
        if strict_json:
            dense = np.nan_to_num(dense, nan=0.0)
        rng = np.random.default_rng(seed)
        picks = [rng.integers(0, len(dense), rows) for _ in range(POOL_SIZE)]
        self.arrays = [(dense[p], cats[p]) for p in picks]
        self.json = [schema.v2_json_request(d, c) for d, c in self.arrays]
