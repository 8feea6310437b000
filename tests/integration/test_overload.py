"""More requests at once than the ranker's queue holds: the excess is refused with a retryable
status, the accepted ones are scored correctly, the server keeps serving, and the
client's retries carry every request through."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from clients.triton import AsyncRankerClient, Retry, ScoringError
from ensemble.repository.configs import CPU_QUEUE
from tests.helpers import fresh_rows

# Requests of 4,096 rows: the dynamic batcher takes two per 8,192-row batch, so the queue really
# fills (with small requests it swallows the whole queue into one batch). 96 stays below the
# asyncio HTTP client's 100 connections.
ROWS = 4096
IN_FLIGHT = CPU_QUEUE.max_queue_size + 32


async def _burst(url: str, dense, cats, retry: Retry):
    client = AsyncRankerClient(url, retry=retry, max_in_flight=IN_FLIGHT)

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


def test_a_burst_beyond_the_queue_is_refused_and_retries_carry_it(server, pipeline):
    dense, cats = fresh_rows(2 * ROWS, seed=61)
    dense, cats = dense[:2 * ROWS], cats[:2 * ROWS]
    expected = pipeline.score(dense, cats)["score"].ravel()
    results = asyncio.run(_burst(server.http_url, dense, cats, Retry(attempts=1)))
    refused = [(k, r, t) for k, r, t in results if isinstance(r, ScoringError)]
    accepted = [(k, r, t) for k, r, t in results if not isinstance(r, ScoringError)]
    print(f"\nburst of {IN_FLIGHT} {ROWS}-row requests: {len(accepted)} accepted, {len(refused)} refused; "
          f"refusal p50 {1e3 * np.median([t for *_, t in refused] or [0]):.1f} ms")
    assert refused and accepted
    reasons = {str(r.cause)[:120] for _, r, _ in refused}
    # full queue, or queued longer than the policy's timeout: both 503, both retried by the clients
    assert reasons <= {"[503] [request id: <id_unknown>] Exceeds maximum queue size", "[503] Request timeout expired"}, \
        reasons
    assert any("Exceeds maximum queue size" in r for r in reasons)
    for k, scores, _ in accepted:
        np.testing.assert_allclose(scores, expected[k % 2 * ROWS:k % 2 * ROWS + ROWS], atol=1e-5)
    again = asyncio.run(_burst(server.http_url, dense, cats, Retry(attempts=8, backoff=0.05, max_sleep=1.0)))
    assert not [r for _, r, _ in again if isinstance(r, ScoringError)]
