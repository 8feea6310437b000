"""The served ensemble against the in-process pipeline, on the real tritonserver."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from ensemble import schema
from tests.helpers import decodes_as_utf8, fresh_rows

TOL = 1e-5


@pytest.fixture(scope="module")
def rows():
    return fresh_rows(3000, seed=1234)


@pytest.fixture(scope="module")
def expected(pipeline, rows):
    return {k: v.ravel() for k, v in pipeline.score(*rows).items()}


@pytest.mark.parametrize("client_name,binary", [("http_client", True), ("http_client", False),
                                                ("grpc_client", True)])
def test_served_scores_equal_in_process(request, client_name, binary, rows, expected):
    client = request.getfixturevalue(client_name)
    dense, cats = rows
    keep = np.ones(len(dense), bool)
    if not binary:  # JSON carries text: rows with non-UTF-8 bytes can only go in binary form
        keep = np.array([all(decodes_as_utf8(v) for v in row) for row in cats])
        assert 0 < (~keep).sum() < 3
    client.binary = binary
    try:
        served = client.score(dense[keep], cats[keep], all_scores=True)
    finally:
        client.binary = True
    assert set(served) == {t.name for t in schema.RANKER_OUTPUTS}
    for name, values in served.items():
        assert values.shape == expected[name][keep].shape
        assert np.max(np.abs(values - expected[name][keep])) <= TOL, name


def test_score_alone_is_served(http_client, grpc_client, rows, expected):
    """Asking for `score` only (not the per-model scores) works on both protocols."""
    dense, cats = rows
    for client in (http_client, grpc_client):
        out = client.infer(dense[:50], cats[:50])
        assert list(out) == ["score"]
        assert np.max(np.abs(out["score"].ravel() - expected["score"][:50])) <= TOL
