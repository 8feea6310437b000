"""The clients a Triton user brings, against the fused ranker in both of its backends (the python
backend and the project's own): plain ``tritonclient`` in closed loops of 1 to 16 threads with no
retries, and Triton's own benchmark client ``perf_analyzer``.
Ordinary concurrency is queued and batched, never refused; a request that cannot meet its own
timeout is refused at once, saying why."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from clients.triton import Protocol, build_inputs
from ensemble import schema
from ensemble.models.registry import Layout
from loadtest.plain_clients import infer_once
from tests.helpers import fresh_rows

ROW_CHOICES = (1, 20, 100)


def _closed_loop(url: str, protocol: Protocol, users: int, seconds: float, dense, cats) -> tuple[int, list[str]]:
    """``users`` threads, each with its own plain tritonclient, sending requests of 1, 20 or 100
    rows back to back for ``seconds``: (answered, errors)."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client

    module = grpc_client if protocol is Protocol.GRPC else http_client
    answered, errors = [0] * users, []
    stop = time.perf_counter() + seconds

    def user(u: int) -> None:
        client = module.InferenceServerClient(url)
        rng = np.random.default_rng(u)
        while time.perf_counter() < stop:
            rows = int(rng.choice(ROW_CHOICES))
            start = int(rng.integers(0, len(dense) - rows))
            try:
                infer_once(client, module, protocol, dense[start:start + rows], cats[start:start + rows])
                answered[u] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        client.close()

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return sum(answered), errors


@pytest.fixture(scope="module", params=[Layout.FUSED, Layout.NATIVE], ids=lambda layout: layout.value)
def served(request, servers):
    """The default layout's ranker and the same ranker in the project's own backend."""
    return servers(request.param)


@pytest.mark.parametrize("protocol", [Protocol.HTTP, Protocol.GRPC], ids=lambda p: p.value)
def test_closed_loops_of_1_to_16_plain_clients_are_never_refused(served, protocol):
    dense, cats = fresh_rows(500, seed=81)
    url = served.grpc_url if protocol is Protocol.GRPC else served.http_url
    for users in (1, 4, 16):
        answered, errors = _closed_loop(url, protocol, users, 2.0, dense, cats)
        print(f"\n{protocol.value}, {users} plain client(s), no retries: {answered} answered, {len(errors)} errors")
        assert answered > users and not errors, errors[:3]


def test_a_request_whose_own_timeout_cannot_be_met_is_refused_at_once(served):
    import tritonclient.http as http_client
    from tritonclient.utils import InferenceServerException

    dense, cats = fresh_rows(100, seed=82)
    dense, cats = dense[:100], cats[:100]
    client = http_client.InferenceServerClient(served.http_url)
    inputs = build_inputs(http_client, Protocol.HTTP, True, dense, cats)
    started = time.perf_counter()
    with pytest.raises(InferenceServerException) as refused:  # 100 rows take milliseconds, not 0.1 ms
        client.infer(schema.Model.RANKER.value, inputs, timeout=100)
    print(f"\nrefused after {(time.perf_counter() - started) * 1e3:.1f} ms: {refused.value}")
    assert str(refused.value.status()) == "503" and schema.OVERLOAD_REFUSAL in str(refused.value)
    assert "the request's timeout" in str(refused.value)
    # the same request with time enough is scored
    result = client.infer(schema.Model.RANKER.value, inputs, timeout=10_000_000)
    assert result.as_numpy(schema.SCORE.name).shape == (100, 1)


def test_perf_analyzer_measures_concurrent_clients_without_an_error(served):
    """Triton's own benchmark client, installed by the project: 16 synchronous clients of 100-row
    requests over HTTP and gRPC, each point measured with no error (errors are what this checks, not
    figures: any variation between windows is accepted)."""
    from loadtest import perf_analyzer

    tool = perf_analyzer.install()
    for protocol, url in (("http", served.http_url), ("grpc", served.grpc_url)):
        point = perf_analyzer.measure(tool, url, protocol, rows=100, concurrency=16, window_ms=1500,
                                      stability_percent=10_000)
        print(f"\nperf_analyzer {protocol} 100 rows x 16: {point}")
        assert point.measured, point.error


def test_the_plain_client_benchmark_counts_every_answer(served):
    """``loadtest.plain_clients`` (the documented plain-client run) against this server: every
    request answered, and a server that is not there counted as errors, not as answers."""
    from ensemble.base.machine import free_port
    from loadtest.plain_clients import point

    dense, cats = fresh_rows(300, seed=83)
    for protocol, url in ((Protocol.HTTP, served.http_url), (Protocol.GRPC, served.grpc_url)):
        r = point(url, protocol, threads=4, requests=5, rows=20, dense=dense, cats=cats)
        assert (r["sent"], r["answered"], r["errors"]) == (20, 20, 0), r["first_errors"]
    nobody = point(f"127.0.0.1:{free_port()}", Protocol.HTTP, threads=2, requests=2, rows=1, dense=dense, cats=cats)
    assert (nobody["answered"], nobody["errors"]) == (0, 4)
