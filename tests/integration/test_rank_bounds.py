"""The ``rank`` model is bounded as the ranker is, on every CPU layout: at most ``max_candidates``
candidates (the ranker's max batch size), malformed input answered 400 / INVALID_ARGUMENT, a
request that would miss its deadline refused as the ranker refuses; and in the native layout its
threads run at the ranker's priority."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clients.triton import RankerClient
from ensemble import schema
from tests.helpers import fresh_rows, http_post, thread_ticks


def _rank_body(candidates: int, dense_shape=None, dense_bytes: bytes | None = None,
               categorical_wire: bytes | None = None) -> tuple[bytes, int]:
    """A binary-tensor ranking request of ``candidates`` empty candidates (or the given shapes and
    bytes): (body, JSON header length)."""
    dense = dense_bytes if dense_bytes is not None else bytes(candidates * schema.N_DENSE * 4)
    wire = categorical_wire if categorical_wire is not None else bytes(4 * candidates * schema.N_CATEGORICAL)
    head = json.dumps({"inputs": [
        {"name": schema.CANDIDATE_DENSE.name, "datatype": "FP32",
         "shape": dense_shape or [candidates, schema.N_DENSE], "parameters": {"binary_data_size": len(dense)}},
        {"name": schema.CANDIDATE_CATEGORICAL.name, "datatype": "BYTES", "shape": [candidates, schema.N_CATEGORICAL],
         "parameters": {"binary_data_size": len(wire)}}]}).encode()
    return head + dense + wire, len(head)


def _post(address: str, body: bytes, head_length: int) -> tuple[int, bytes]:
    return http_post(address, "/v2/models/rank/infer", body, {"Inference-Header-Content-Length": str(head_length)})


def test_more_candidates_than_the_limit_are_refused_naming_it(layout_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    limit = schema.MAX_BATCH_SIZE
    status, reply = _post(layout_server.http_url, *_rank_body(limit + 1))
    assert status == 400 and f"at most {limit}".encode() in reply and b"max_candidates" in reply, (status, reply)
    client = grpcclient.InferenceServerClient(layout_server.grpc_url)
    try:
        inputs = [grpcclient.InferInput(schema.CANDIDATE_DENSE.name, [limit + 1, schema.N_DENSE], "FP32"),
                  grpcclient.InferInput(schema.CANDIDATE_CATEGORICAL.name, [limit + 1, schema.N_CATEGORICAL], "BYTES")]
        inputs[0].set_data_from_numpy(np.zeros((limit + 1, schema.N_DENSE), np.float32))
        inputs[1].set_data_from_numpy(np.full((limit + 1, schema.N_CATEGORICAL), b"", object))
        with pytest.raises(InferenceServerException) as refused:
            client.infer(schema.RANK_MODEL, inputs)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and f"at most {limit}" in refused.value.message()
    finally:
        client.close()
    # the limit itself is served
    dense, cats = fresh_rows(limit, seed=31)
    ranking = RankerClient(layout_server.http_url, "http", timeout=120).rank(None, (dense[:limit], cats[:limit]), k=3)
    assert len(ranking.scores) == limit and len(ranking.order) == 3


@pytest.mark.parametrize("case", ["truncated BYTES", "wrapping shape", "lying BYTES length"])
def test_malformed_ranking_input_is_a_client_error(layout_server, pipeline, case):
    from ensemble.models.registry import Layout

    if case == "wrapping shape" and layout_server.options.layout is not Layout.NATIVE:
        # Triton 2.51's python-backend stub dies reading such a tensor, before the model sees it (the
        # supervisor heals it: tests/integration/test_faults.py): docs/reliability.md, "Known limits"
        pytest.skip("a shape whose byte size wraps kills Triton 2.51's python-backend stub (fused layout)")
    if case == "truncated BYTES":
        body = _rank_body(3, categorical_wire=b"\x05\x00\x00\x00ab")
    elif case == "wrapping shape":  # 2^62 x 13 x 4 bytes wraps to 0 in 64 bits
        body = _rank_body(3, dense_shape=[2**62, schema.N_DENSE], dense_bytes=b"")
    else:  # a length prefix far past the buffer
        body = _rank_body(1, categorical_wire=b"\xff\xff\xff\x7f" + bytes(4 * (schema.N_CATEGORICAL - 1)))
    status, reply = _post(layout_server.http_url, *body)
    assert status == 400, (case, status, reply)
    dense, cats = fresh_rows(20, seed=37)  # and the server ranks as before
    ranking = RankerClient(layout_server.http_url, "http").rank(None, (dense[:20], cats[:20]))
    np.testing.assert_allclose(ranking.scores, pipeline.score(dense[:20], cats[:20])["score"].ravel(), atol=1e-5)


def test_a_ranking_request_that_would_miss_its_timeout_is_refused(servers):
    """The native rank model holds a request to the sooner of its timeout and the objective: 8,192
    candidates within 1 ms cannot be scored, and are refused with UNAVAILABLE as the ranker refuses
    (the client itself waits as long as it takes)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from ensemble.models.registry import Layout

    server = servers(Layout.NATIVE)
    n = schema.MAX_BATCH_SIZE
    dense, cats = fresh_rows(n, seed=41)
    dense, cats = dense[:n], cats[:n]
    RankerClient(server.http_url, "http", timeout=120).rank(None, (dense, cats))  # the model's rate, measured
    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        client = module.InferenceServerClient(url)
        inputs = [module.InferInput(schema.CANDIDATE_DENSE.name, list(dense.shape), "FP32"),
                  module.InferInput(schema.CANDIDATE_CATEGORICAL.name, list(cats.shape), "BYTES")]
        inputs[0].set_data_from_numpy(dense)
        inputs[1].set_data_from_numpy(cats)
        with pytest.raises(InferenceServerException) as refused:
            client.infer(schema.RANK_MODEL, inputs, timeout=1000)  # Triton's request timeout, in microseconds
        text = str(refused.value)
        assert "would miss its deadline" in text and "the request's timeout" in text, text
        assert module is httpclient or refused.value.status() == "StatusCode.UNAVAILABLE", text
        ranking = client.infer(schema.RANK_MODEL, inputs, timeout=60_000_000)  # with time enough: answered
        assert ranking.as_numpy(schema.CANDIDATE_SCORES.name).shape == (n,)
        client.close()


def test_the_native_rank_threads_run_below_the_rankers_priority(servers):
    """The thread that scored a burst of ranking requests (the busiest in the server meanwhile) runs
    at the rank model's nice value, below the ranker's, never above it."""
    from ensemble.models.registry import Layout
    from ensemble.repository.configs import MODEL_THREAD_NICE, RANK_THREAD_NICE

    assert RANK_THREAD_NICE > MODEL_THREAD_NICE
    server = servers(Layout.NATIVE)
    n = schema.MAX_BATCH_SIZE
    dense, cats = fresh_rows(n, seed=43)
    client = RankerClient(server.http_url, "http", timeout=120)
    before = thread_ticks(server.process.pid)
    for _ in range(6):
        client.rank(None, (dense[:n], cats[:n]))
    after = thread_ticks(server.process.pid)
    busiest = max(after, key=lambda t: after[t][1] - before.get(t, (0, 0))[1])
    assert after[busiest][0] == RANK_THREAD_NICE, {t: (v[0], v[1] - before.get(t, (0, 0))[1]) for t, v in after.items()}


def test_the_python_rank_model_runs_below_the_rankers_priority(servers):
    """In the fused layout the ``rank`` model's own process (a python-backend stub) does its work on
    a thread at the rank model's nice value (rank_model.RANK_NICE, which mirrors configs.RANK_THREAD_NICE:
    the stub imports no more than numpy and the schema): the busiest thread of that process during a
    burst of ranking requests."""
    from pathlib import Path

    from ensemble.models.registry import Layout
    from ensemble.repository.configs import RANK_THREAD_NICE

    server = servers(Layout.FUSED)
    n = schema.MAX_BATCH_SIZE
    dense, cats = fresh_rows(n, seed=47)
    client = RankerClient(server.http_url, "http", timeout=120)
    client.rank(None, (dense[:64], cats[:64]))  # the model loaded and its thread lowered
    stubs = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
             and b"rank_0" in _cmdline(p) and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server.process.pid]
    assert len(stubs) == 1, stubs
    before = thread_ticks(stubs[0])
    for _ in range(4):
        client.rank(None, (dense[:n], cats[:n]))
    after = thread_ticks(stubs[0])
    busiest = max(after, key=lambda t: after[t][1] - before.get(t, (0, 0))[1])
    assert after[busiest][0] == RANK_THREAD_NICE, {t: (v[0], v[1] - before.get(t, (0, 0))[1]) for t, v in after.items()}


def _cmdline(process) -> bytes:
    try:
        return (process / "cmdline").read_bytes()
    except OSError:
        return b""
