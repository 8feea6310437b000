"""The client library against the real server: protocols, input forms, splitting, errors."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pyarrow as pa
import pytest

from clients.triton import AsyncRankerClient, RankerClient, Retry, ScoringError
from ensemble import schema
from ensemble.data import criteo
from tests.helpers import SYNTH


@pytest.fixture(scope="module")
def frame():
    return criteo.synthesize(criteo.SynthConfig(rows=10_000, scale=SYNTH.scale, seed=71)).frame


def test_http_and_grpc_give_identical_scores(http_client, grpc_client, frame):
    http = http_client.score(frame, all_scores=True)
    grpc = grpc_client.score(frame, all_scores=True)
    for name in http:
        np.testing.assert_array_equal(http[name], grpc[name])


def test_large_input_is_split_by_the_servers_max_batch(http_client, pipeline, frame):
    assert http_client.max_batch_size == schema.MAX_BATCH_SIZE  # read from the server
    got = http_client.score(frame)  # 10,000 rows -> two requests
    want = pipeline.score(*__import__("clients.inputs", fromlist=["x"]).to_tensors(frame))["score"].ravel()
    assert got.shape == (10_000,) and np.max(np.abs(got - want)) <= 1e-5


def test_input_forms_agree(grpc_client, frame):
    part = frame.iloc[:200]
    base = grpc_client.score(part)
    np.testing.assert_array_equal(grpc_client.score(pa.Table.from_pandas(part)), base)
    lines = ["\t".join("" if v is None or v is __import__("pandas").NA else str(v) for v in row)
             for row in part.itertuples(index=False)]
    np.testing.assert_array_equal(grpc_client.score(lines), base)


def test_url_scheme_picks_the_protocol(server, frame):
    client = RankerClient(f"grpc://{server.grpc_url}")
    assert client.protocol.value == "grpc"
    assert client.score(frame.iloc[:5]).shape == (5,)


@pytest.mark.parametrize("port, protocol, hint", [("grpc_url", "http", "gRPC port? give grpc://"),
                                                  ("http_url", "grpc", "HTTP port? gRPC is on its own port")])
def test_a_port_of_the_other_protocol_is_named_as_the_likely_cause(server, frame, port, protocol, hint):
    client = RankerClient(getattr(server, port), protocol, retry=Retry(attempts=2, backoff=0.01), timeout=5)
    client.sleep = lambda _: None
    with pytest.raises(ScoringError, match=re.escape(hint)):
        client.score(frame.iloc[:2])


def test_async_client_matches_sync(server, http_client, frame):
    expected = http_client.score(frame, all_scores=True)

    async def run(url, protocol):
        client = AsyncRankerClient(url, protocol, max_in_flight=4)
        try:
            return await client.score(frame, all_scores=True)
        finally:
            await client.close()

    for url, protocol in ((server.http_url, "http"), (server.grpc_url, "grpc")):
        got = asyncio.run(run(url, protocol))
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], atol=1e-6)


def test_bad_request_is_not_retried_and_names_its_rows(server):
    client = RankerClient(server.http_url, retry=Retry(attempts=5, backoff=0.01))
    with pytest.raises(ScoringError, match=r"rows 0\.\.2 failed after 1 attempt") as err:
        client.score(np.ones((3, 12), np.float32), np.full((3, 26), b"a", dtype=object))
    assert err.value.attempts == 1


def test_unavailable_server_is_retried_then_reported():
    from ensemble.base.machine import free_port

    pauses = []
    client = RankerClient(f"grpc://127.0.0.1:{free_port()}", retry=Retry(attempts=3, backoff=0.01), timeout=5)
    client.sleep = pauses.append
    client._max_batch = 8192  # the config lookup would fail first; exercise the infer path
    with pytest.raises(ScoringError, match="after 3 attempt"):
        client.score(np.ones((2, 13), np.float32), np.full((2, 26), b"a", dtype=object))
    assert pauses == [0.01, 0.02]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_server_down_from_the_first_call_is_retried_and_raised_as_scoring_error(protocol):
    from ensemble.base.machine import free_port

    pauses = []
    client = RankerClient(f"{protocol}://127.0.0.1:{free_port()}", retry=Retry(attempts=3, backoff=0.01), timeout=5)
    client.sleep = pauses.append
    with pytest.raises(ScoringError, match=r"rows 0\.\.1 failed after 3 attempt"):
        client.score(np.ones((2, 13), np.float32), np.full((2, 26), b"a", dtype=object))
    assert pauses == [0.01, 0.02]

    async def run():
        aclient = AsyncRankerClient(f"{protocol}://127.0.0.1:{free_port()}", retry=Retry(attempts=2, backoff=0.01), timeout=5)
        try:
            await aclient.score(np.ones((2, 13), np.float32), np.full((2, 26), b"a", dtype=object))
        finally:
            await aclient.close()

    with pytest.raises(ScoringError, match="after 2 attempt"):
        asyncio.run(run())


_EVENT_ENGINE_SWITCHES = """
import glob, sys
import numpy as np
from clients.triton import RankerClient

def switches():  # context switches of grpcio's event-engine threads in this process
    total = 0
    for task in glob.glob("/proc/self/task/*"):
        if open(task + "/comm").read().strip() == "event_engine":
            fields = dict(line.split(":\\t") for line in open(task + "/status").read().splitlines() if ":\\t" in line)
            total += int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
    return total

client = RankerClient(sys.argv[1], "grpc")
dense, cats = np.ones((1, 13), np.float32), np.full((1, 26), b"68fd1e64", dtype=object)
for _ in range(50):
    client.infer(dense, cats)
before = switches()
for _ in range(300):
    client.infer(dense, cats)
print(switches() - before)
"""


def test_the_grpc_client_reads_its_answers_on_the_calling_thread(server):
    """The client imports grpcio with calling-thread polling (ensemble/base/grpc_polling.py): 300 calls
    leave grpcio's event-engine threads nearly idle, where its default wakes them ~4 times a call."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    counts = {}
    for name, value in (("project's", None), ("grpcio's default", "")):
        run_env = env if value is None else {**env, "GRPC_EXPERIMENTS": value}
        out = subprocess.run([sys.executable, "-c", _EVENT_ENGINE_SWITCHES, server.grpc_url], env=run_env,
                             capture_output=True, text=True, check=True, timeout=120)
        counts[name] = int(out.stdout.split()[-1])
    assert counts["project's"] < 100, counts
    assert counts["grpcio's default"] > 300, counts  # the control: the count does tell the two apart
