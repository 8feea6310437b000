"""Helpers shared by tests (not fixtures)."""

from __future__ import annotations

import numpy as np

from ensemble import data

# Small enough for CI on 2 cores, big enough that every step trains for real.
SYNTH = data.SynthConfig(rows=24_000, scale=0.002, seed=11)


def fresh_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """New random rows (a different seed from training: unseen values included) plus edge cases."""
    from ensemble import features
    from ensemble.demo import edge_case_rows

    frame = data.synthesize(data.SynthConfig(rows=n, scale=SYNTH.scale, seed=seed)).frame
    edge_dense, edge_cats = edge_case_rows(np.random.default_rng(seed))
    return (np.concatenate([features.dense_array(frame), edge_dense]),
            np.concatenate([features.encode_categorical(frame), edge_cats]))
