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


def post_infer(base_url: str, body: bytes) -> tuple[int, dict]:
    """POST a v2 JSON inference body to ``<base_url>/v2/models/ranker/infer``: (status, reply)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base_url}/v2/models/ranker/infer", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def decodes_as_utf8(value: bytes) -> bool:
    """Whether a categorical value can travel in JSON (which carries text)."""
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def modules_loaded(code: str, watched: tuple[str, ...]) -> list[str]:
    """Run ``code`` in a fresh interpreter; return which of ``watched`` modules it left imported."""
    import subprocess
    import sys

    probe = f"{code}\nimport sys\nprint(','.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]
