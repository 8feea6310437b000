"""The native backend in tritonserver with its allocations failing: tests/fuzz/sanitize.py runs this file on
its sanitized build, where ENSEMBLE_ALLOC_FAULTS is compiled in (ensemble/native/backend_internal.h). With
every Nth malloc, calloc and strdup of the backend's own failing, each request gets its scores or an
error its client may retry, the server keeps serving, and it exits with nothing leaked (the step reads
its sanitizer log). Not collected by the normal run: the backend that ``make setup`` builds has no faults."""

from __future__ import annotations

import collections
import concurrent.futures as cf

import numpy as np
from tritonclient.utils import InferenceServerException

from clients.triton import RankerClient, Retry, ScoringError, is_transient
from ensemble.models.registry import Layout
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_ports
from ensemble.schema import Priority
from tests.helpers import fresh_rows

FAULTS_ENV = "ENSEMBLE_ALLOC_FAULTS"
# Prime, and above the ~15 allocations of a call on the C path: the failing one moves through them from call
# to call, and most calls still get through.
FAIL_EVERY = 23
ROUNDS = 12
ONCE = Retry(attempts=1)


def _outcome(server: TritonServer, kind: str, n: int, dense: np.ndarray, cats: np.ndarray,
             expected: np.ndarray) -> str:
    """One request of ``kind`` for the first ``n`` rows, on a client of its own (tritonclient's are not
    shared between threads): ``scored`` (the scores the in-process pipeline gives) or ``refused`` (out of
    memory, answered as a failure the client retries); anything else fails the test."""
    client = CLIENTS[kind](server)
    try:
        if kind.startswith("rank"):
            got = client.rank(None, (dense[:n], cats[:n])).scores
        else:
            got = client.infer(dense[:n], cats[:n])["score"]
    except (InferenceServerException, ScoringError) as exc:
        cause = exc.cause if isinstance(exc, ScoringError) else exc
        text = str(cause)
        assert "out of memory" in text or "MemoryError" in text, text
        assert is_transient(cause), f"not answered as retryable: {text}"
        return "refused"
    finally:
        client.close()
    np.testing.assert_allclose(np.asarray(got).ravel(), expected[:n], atol=1e-5)
    return "scored"


# One round: the C path (HTTP binary and JSON, gRPC; 1 to 40 rows), bulk requests beside them (the bulk
# lane), and ranking requests (the rank model: the path through the model's execute).
CLIENTS = {"http": lambda server: RankerClient(server.http_url, "http", retry=ONCE),
           "json": lambda server: RankerClient(server.http_url, "http", binary=False, retry=ONCE),
           "grpc": lambda server: RankerClient(server.grpc_url, "grpc", retry=ONCE),
           "bulk": lambda server: RankerClient(server.http_url, "http", retry=ONCE, priority=Priority.BATCH),
           "rank": lambda server: RankerClient(server.http_url, "http", retry=ONCE),
           "rank-grpc": lambda server: RankerClient(server.grpc_url, "grpc", retry=ONCE)}
ROUND = (("http", 1), ("http", 40), ("json", 7), ("grpc", 1), ("grpc", 40), ("bulk", 40), ("bulk", 3), ("rank", 20),
         ("rank-grpc", 5))


def test_every_request_is_scored_or_refused_while_allocations_fail(trained, pipeline, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, str(FAIL_EVERY))  # read by the server's backend, armed by its first call
    http, grpc, metrics = free_ports(3)
    server = TritonServer(ServerOptions(trained.repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                        log_file=tmp_path / "tritonserver.log", layout=Layout.NATIVE))
    server.start()
    dense, cats = fresh_rows(40, seed=53)
    dense, cats = dense[:40], cats[:40]
    expected = pipeline.score(dense, cats)["score"].ravel()
    outcomes = collections.Counter()
    try:
        with cf.ThreadPoolExecutor(8) as pool:  # concurrent: calls of several requests, some bulk beside interactive
            for _ in range(ROUNDS):
                sent = [pool.submit(_outcome, server, kind, n, dense, cats, expected) for kind, n in ROUND]
                outcomes.update(future.result(timeout=120) for future in sent)
                assert server.alive(), server.log_tail()
    finally:
        exit_code = server.stop()
    assert outcomes["scored"] and outcomes["refused"], outcomes
    assert exit_code == 0, f"tritonserver exited with {exit_code} (a leak report ends it with 1)"
