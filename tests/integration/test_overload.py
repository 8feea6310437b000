"""More requests at once than the ranker's queue holds: the excess is refused fast with a
retryable status, the accepted ones are scored correctly, the server keeps serving, and the
client's retries carry every request through."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from clients.triton import AsyncRankerClient, Retry, ScoringError
from ensemble.configs import CPU_QUEUE
from tests.helpers import fresh_rows

IN_FLIGHT = CPU_QUEUE.max_queue_size * 3


async def _burst(url: str, dense, cats, retry: Retry):
    client = AsyncRankerClient(url, retry=retry, max_in_flight=IN_FLIGHT)

    async def one(k: int):
        rows = slice(k % 8 * 100, k % 8 * 100 + 100)
        started = time.perf_counter()
        try:
            return k, await client.score(dense[rows], cats[rows]), time.perf_counter() - started
        except ScoringError as exc:
            return k, exc, time.perf_counter() - started

    try:
        return await asyncio.gather(*(one(k) for k in range(IN_FLIGHT)))
    finally:
        await client.close()


def test_a_burst_beyond_the_queue_is_refused_fast_and_retries_carry_it(server, pipeline):
    dense, cats = fresh_rows(800, seed=61)
    dense, cats = dense[:800], cats[:800]
    expected = pipeline.score(dense, cats)["score"].ravel()
    results = asyncio.run(_burst(server.http_url, dense, cats, Retry(attempts=1)))
    refused = [(k, r, t) for k, r, t in results if isinstance(r, ScoringError)]
    accepted = [(k, r, t) for k, r, t in results if not isinstance(r, ScoringError)]
    print(f"\nburst of {IN_FLIGHT} 100-row requests: {len(accepted)} accepted, {len(refused)} refused; "
          f"refusal p50 {1e3 * np.median([t for *_, t in refused] or [0]):.1f} ms")
    assert refused and accepted
    assert all("Exceeds maximum queue size" in str(r) and "503" in str(r) for _, r, _ in refused)
    for k, scores, _ in accepted:
        np.testing.assert_allclose(scores, expected[k % 8 * 100:k % 8 * 100 + 100], atol=1e-5)
    again = asyncio.run(_burst(server.http_url, dense, cats, Retry(attempts=8, backoff=0.05, max_sleep=1.0)))
    assert not [r for _, r, _ in again if isinstance(r, ScoringError)]
