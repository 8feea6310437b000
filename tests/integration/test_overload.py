"""More requests than the ranker takes: the excess is refused with a retryable status, the accepted
ones are scored correctly, the server keeps serving, and the clients' retries carry every request
through. The policy is the fused ranker's call budget (ensemble/serving/admission.py): small
requests beyond a call's budget are refused, bulk (batch-scoring) requests are always taken.
No timing is asserted: the figures are printed (run with -s) and measured by
``python -m loadtest.openloop``."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from clients.triton import AsyncRankerClient, Retry, ScoringError
from ensemble import schema
from ensemble.schema import Priority
from tests.helpers import fresh_rows

# Requests of 4,096 rows (batch scoring's size), more at once than one model call takes.
ROWS = 4096
IN_FLIGHT = 16
REFUSAL = schema.OVERLOAD_REFUSAL


async def _burst(url: str, dense, cats, retry: Retry):
    client = AsyncRankerClient(url, retry=retry, max_in_flight=IN_FLIGHT, priority=Priority.BATCH)

    async def one(k: int):
        rows = slice(k % 2 * ROWS, k % 2 * ROWS + ROWS)
        started = time.perf_counter()
        try:
            return k, await client.score(dense[rows], cats[rows]), time.perf_counter() - started
        except ScoringError as exc:
            return k, exc, time.perf_counter() - started

    try:
        return await asyncio.gather(*(one(k) for k in range(IN_FLIGHT)))
    finally:
        await client.close()


def test_a_burst_of_bulk_requests_is_scored_without_refusals(server, pipeline):
    """Bulk requests cost more than a call's budget on their own: refusing them would only buy a
    retry (their client bounds its concurrency), so each is taken, queued behind the others."""
    dense, cats = fresh_rows(2 * ROWS, seed=61)
    dense, cats = dense[:2 * ROWS], cats[:2 * ROWS]
    expected = pipeline.score(dense, cats)["score"].ravel()
    results = asyncio.run(_burst(server.http_url, dense, cats, Retry(attempts=1)))
    refused = [r for _, r, _ in results if isinstance(r, ScoringError)]
    print(f"\nburst of {IN_FLIGHT} {ROWS}-row requests: {len(refused)} refused; "
          f"latency max {max(t for *_, t in results):.2f} s")
    assert not refused, {str(r.cause)[:120] for r in refused}
    for k, scores, _ in results:
        np.testing.assert_allclose(scores, expected[k % 2 * ROWS:k % 2 * ROWS + ROWS], atol=1e-5)


OVERLOAD_MULTIPLE = 3.0  # of the closed-loop capacity: clearly more than the server takes, even if
# the short capacity run underestimates it on a busy machine


def test_open_loop_overload_refuses_the_excess_retryably_and_keeps_serving(server, pipeline):
    import json
    import threading

    from ensemble.serving.supervise import Supervisor, SupervisorPolicy
    from loadtest.openloop import closed_loop, open_loop, request_bodies, server_counters, server_view, summarize

    # 96-row requests: the model (not the HTTP front end, which parses every request before any
    # policy can see it) is what runs out, and the server's capacity in requests/s stays within
    # what one asyncio generator can offer (1-row requests: the batcher absorbs more than it sends).
    bodies, arrays = request_bodies(rows=96, count=64, seed=71, timeout_s=1.0)
    expected = [pipeline.score(d, c)["score"].ravel() for d, c in arrays]
    lines: list[str] = []
    supervisor = Supervisor(server, SupervisorPolicy(probe_interval=0.5, probe_timeout=1.0), log=lines.append)
    stop = threading.Event()
    watching = threading.Thread(target=supervisor.run, args=(stop.is_set,), daemon=True)
    watching.start()
    try:
        capacity = asyncio.run(closed_loop(server.http_url, bodies, 8, 2.0))
        # A closed loop of 8 underestimates what batching absorbs: raise the offered load until
        # the queue overflows (on a busy machine the first multiple already does).
        for multiple in (OVERLOAD_MULTIPLE, 2 * OVERLOAD_MULTIPLE, 4 * OVERLOAD_MULTIPLE):
            before = server_counters(server.http_url)
            outcomes = asyncio.run(open_loop(server.http_url, bodies, multiple * capacity, 3.0))
            view = server_view(before, server_counters(server.http_url))
            result = summarize(multiple * capacity, 3.0, outcomes)
            if result.refused:
                break
    finally:
        stop.set()
        watching.join(30)
    print(f"\ncapacity {capacity:.0f} req/s; offered {result.rate:.0f} req/s: {result.accepted} accepted "
          f"(p99 {result.accepted_p99_ms:.1f} ms), {result.refused} refused (p99 {result.refused_p99_ms:.1f} ms), "
          f"{result.errors} errors; generator late p99 {result.late_p99_ms:.1f} ms; {result.refusal_reasons}; "
          f"server view {view}")
    assert result.errors == 0, result.error_samples
    assert result.accepted and result.refused, result
    # refused = 503 from the call budget: retryable
    assert {o.status for o in outcomes if o.status != 200} == {503}
    assert all(REFUSAL in r for r in result.refusal_reasons), result.refusal_reasons
    # Triton's own statistics saw the same run: refusals mean calls of several requests
    assert view["requests_per_call"] > 1 and view["server_call_ms"] > 0 and view["server_queue_ms"] >= 0, view
    for k, outcome in enumerate(outcomes):
        if outcome.status == 200:
            scores = json.loads(outcome.body)["outputs"][0]["data"]
            np.testing.assert_allclose(scores, expected[k % len(bodies)], atol=1e-5)
    # overload is not a fault: the supervisor did not reload or restart the busy ranker
    assert supervisor.heals == 0 and not supervisor.restarts, lines
    assert server.ready() and supervisor.probe() is None


def test_grpc_refusals_are_unavailable_and_retried(server):
    """64 interactive 1-row requests at once over gRPC, more than one call's budget may take: what is
    refused is UNAVAILABLE (retryable); with retries every request is scored."""
    from clients.triton import is_transient

    dense, cats = fresh_rows(64, seed=73)

    async def burst(retry: Retry):
        client = AsyncRankerClient(server.grpc_url, "grpc", retry=retry, max_in_flight=64)
        try:
            async def one(k: int):
                try:
                    return await client.score(dense[k:k + 1], cats[k:k + 1])
                except ScoringError as exc:
                    return exc
            return await asyncio.gather(*(one(k) for k in range(64)))
        finally:
            await client.close()

    once = asyncio.run(burst(Retry(attempts=1)))
    refused = [r for r in once if isinstance(r, ScoringError)]
    print(f"\ngRPC burst of 64: {len(refused)} refused")
    for r in refused:
        assert str(r.cause.status()) == "StatusCode.UNAVAILABLE" and is_transient(r.cause), r
    again = asyncio.run(burst(Retry(attempts=10, backoff=0.02, max_sleep=0.5)))
    assert not [r for r in again if isinstance(r, ScoringError)]
