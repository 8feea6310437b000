"""The served ranker against the in-process pipeline, on the real tritonserver, in every CPU layout."""

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


@pytest.fixture
def http_client(layout_server):
    from clients.triton import RankerClient

    return RankerClient(layout_server.http_url, "http")


@pytest.fixture
def grpc_client(layout_server):
    from clients.triton import RankerClient

    return RankerClient(layout_server.grpc_url, "grpc")


@pytest.mark.parametrize("client_name,binary", [("http_client", True), ("http_client", False),
                                                ("grpc_client", True)])
def test_served_scores_equal_in_process(request, layout_server, client_name, binary, rows, expected):
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


def test_single_row_requests(http_client, rows, expected):
    dense, cats = rows
    for i in (0, 17, len(dense) - 1, len(dense) - 8):  # includes edge-case rows at the end
        got = http_client.score(dense[i:i + 1], cats[i:i + 1])
        assert abs(got[0] - expected["score"][i]) <= TOL


def test_odd_values_are_scored(http_client, rows):
    dense, cats = rows
    edge = slice(len(dense) - 8, len(dense))  # all-missing, inf, huge, non-hex, very long...
    out = http_client.score(dense[edge], cats[edge], all_scores=True)
    for name, values in out.items():
        assert np.isfinite(values).all() and ((values > 0) & (values < 1)).all(), name


def test_max_batch_size_request(grpc_client, rows, expected):
    dense, cats = rows
    reps = -(-schema.MAX_BATCH_SIZE // len(dense))
    d, c = np.tile(dense, (reps, 1))[:schema.MAX_BATCH_SIZE], np.tile(cats, (reps, 1))[:schema.MAX_BATCH_SIZE]
    got = grpc_client.infer(d, c)["score"].ravel()
    want = np.tile(expected["score"], reps)[:schema.MAX_BATCH_SIZE]
    assert np.max(np.abs(got - want)) <= TOL


def test_concurrent_requests_get_their_own_rows(layout_server, rows, expected):
    """Many clients at once (dynamic batching merges them); bad requests mixed in."""
    from clients.triton import RankerClient

    dense, cats = rows
    rng = np.random.default_rng(5)
    jobs = []
    for k in range(120):
        size = int(rng.choice([1, 3, 10, 64]))
        start = int(rng.integers(0, len(dense) - size))
        jobs.append((k, start, size))

    def run(job):
        k, start, size = job
        client = RankerClient(layout_server.http_url if k % 2 else layout_server.grpc_url,
                              "http" if k % 2 else "grpc")
        if k % 10 == 0:  # a malformed request in the mix
            with pytest.raises(Exception):
                client.infer(dense[start:start + size, :12], cats[start:start + size])
            return None
        got = client.score(dense[start:start + size], cats[start:start + size])
        return float(np.max(np.abs(got - expected["score"][start:start + size])))

    with cf.ThreadPoolExecutor(16) as pool:
        diffs = [d for d in pool.map(run, jobs) if d is not None]
    assert len(diffs) == 108
    assert max(diffs) <= TOL


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ranking_request_without_context_orders_the_flat_scores(layout_server, protocol, rows, expected):
    """Criteo's spec has no context columns: a ranking request is its candidates alone, and its answer
    is the flat scores of the same rows and their order (JSON and binary tensors alike)."""
    from clients.triton import RankerClient

    url = layout_server.http_url if protocol == "http" else layout_server.grpc_url
    dense, cats = rows[0][:100], rows[1][:100]
    for binary in (True, False) if protocol == "http" else (True,):
        ranking = RankerClient(url, protocol, binary=binary).rank(None, (dense, cats), k=5)
        want = expected[schema.SCORE.name][:100]
        assert np.max(np.abs(ranking.scores - want)) <= TOL
        assert list(ranking.order) == list(np.argsort(-want, kind="stable")[:5])


def test_the_native_backend_answers_ordinary_requests_from_one_score_array(servers, rows, expected):
    """The native layout's backend answers a call of plain requests from one score array, planned
    and scored in C (said in the server's log at load; a call of 32 rows or more on a server with two
    cores is scored on two threads): each request gets its own rows of the outputs it asked for,
    whatever it asked for, in calls of either size."""
    from pathlib import Path

    import tritonclient.http as httpclient

    from ensemble.models.registry import Layout

    srv = servers(Layout.NATIVE)
    assert "plain requests are planned and scored in C, any other through Python" in Path(srv.log_file).read_text(
        errors="replace")
    dense, cats = rows
    wanted = [(schema.SCORE.name,), tuple(t.name for t in schema.RANKER_OUTPUTS[2:]), ()]
    with cf.ThreadPoolExecutor(6) as pool:
        def ask(k):  # requests in flight together, so Triton hands them to the backend in shared calls
            start, n = 7 * k, 40 if k % 10 == 9 else 1 + k % 5
            inputs = [httpclient.InferInput(schema.DENSE.name, [n, dense.shape[1]], "FP32"),
                      httpclient.InferInput(schema.CATEGORICAL.name, [n, cats.shape[1]], "BYTES")]
            inputs[0].set_data_from_numpy(np.ascontiguousarray(dense[start:start + n], np.float32))
            inputs[1].set_data_from_numpy(cats[start:start + n])
            names = wanted[k % 3]
            client = httpclient.InferenceServerClient(srv.http_url)  # one per request: not shared by threads
            try:
                result = client.infer(schema.Model.RANKER.value, inputs,
                                      outputs=[httpclient.InferRequestedOutput(m) for m in names] or None)
            finally:
                client.close()
            got = {o["name"] for o in result.get_response()["outputs"]}
            assert got == set(names or (t.name for t in schema.RANKER_OUTPUTS))
            for name in got:
                assert np.max(np.abs(result.as_numpy(name).ravel() - expected[name][start:start + n])) <= TOL, name

        list(pool.map(ask, range(60)))


def test_the_native_model_thread_runs_below_the_front_end(servers, rows):
    """The native ranker's instance thread takes the config's nice value on its first call (so Triton's
    front-end threads, left at 0, parse arriving requests before it takes the core back), and the chain's
    helper thread, which scores half of a large call, runs at it too, also after the bulk lane (nice 19)
    had large calls of its own helped (one shared helper was lowered to 19 by them for good); the rest of
    the server keeps 0."""
    import os
    import threading
    import time

    import tritonclient.http as httpclient

    from ensemble.models.registry import Layout
    from ensemble.repository import configs

    srv = servers(Layout.NATIVE)
    dense, cats = rows

    def infer(n: int, bulk: bool = False) -> None:
        client = httpclient.InferenceServerClient(srv.http_url)  # one per thread: not shared
        try:
            inputs = [httpclient.InferInput(schema.DENSE.name, [n, dense.shape[1]], "FP32"),
                      httpclient.InferInput(schema.CATEGORICAL.name, [n, cats.shape[1]], "BYTES")]
            inputs[0].set_data_from_numpy(np.ascontiguousarray(dense[:n], np.float32))
            inputs[1].set_data_from_numpy(cats[:n])
            client.infer(schema.Model.RANKER.value, inputs,
                         parameters={schema.BULK_PARAMETER: True} if bulk else None)
        finally:
            client.close()

    until = time.monotonic() + 2  # bulk requests beside interactive ones: the lane scores them, helped
    interactive = threading.Thread(target=lambda: [infer(1) for _ in iter(lambda: time.monotonic() < until, False)])
    interactive.start()
    while time.monotonic() < until:
        infer(min(len(dense), 200), bulk=True)
    interactive.join()
    for n in (1, 40):  # 40 rows: the chain's two-thread cut on a server with two cores
        infer(n)
    pid = srv.process.pid
    nice = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nice[tid] = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5): nice
    lowered = [t for t, v in nice.items() if v == configs.MODEL_THREAD_NICE]
    assert lowered, nice
    assert set(nice.values()) <= {0, configs.MODEL_THREAD_NICE, configs.RANK_THREAD_NICE}, nice  # rank's: below
    assert nice[str(pid)] == 0 and list(nice.values()).count(0) > len(lowered)  # the front end keeps 0
    if len(os.sched_getaffinity(pid)) > 1:  # the helper (started at load by another thread) follows it
        assert len(lowered) >= 2, nice


def test_the_native_backend_counts_the_path_of_every_request(servers, rows, expected):
    """Plain requests are scored in C and counted under ensemble_backend_requests_total{path="c"}; a
    request that is not plain (here its last string runs past its buffer) goes through the model's
    execute, gets its own 400-class error and is counted under path="python"; the plain ones keep their
    scores."""
    import urllib.request

    from clients.triton import RankerClient
    from ensemble.models.registry import Layout
    from ensemble.operate.monitoring import parse_exposition
    from tests.integration.test_bad_input import _binary_post, _wire

    srv = servers(Layout.NATIVE)

    def counts(model=schema.Model.RANKER.value):
        with urllib.request.urlopen(srv.metrics_url, timeout=10) as reply:
            samples = parse_exposition(reply.read().decode()).get("ensemble_backend_requests_total", [])
        return {labels["path"]: value for labels, value in samples if labels.get("model") == model}

    before = counts()
    assert set(before) == {"c", "python"}
    assert set(counts(schema.RANK_MODEL)) == {"python"}  # the rank model has no C path
    dense, cats = rows
    client = RankerClient(srv.http_url, "http")
    for i in range(5):
        scores = client.score(dense[i * 3:i * 3 + 3], cats[i * 3:i * 3 + 3])
        assert np.max(np.abs(np.asarray(scores).ravel() - expected[schema.SCORE.name][i * 3:i * 3 + 3])) <= TOL
    # the last string's length runs past the buffer: Triton's own checks pass it, the backend's do not
    status, reply = _binary_post(srv, _wire([b"68fd1e64"] * 25) + (100).to_bytes(4, "little") + b"68f")
    assert 400 <= status < 500 and reply.get("error"), (status, reply)
    after = counts()
    assert after["c"] - before["c"] == 5
    assert after["python"] - before["python"] == 1


def test_the_native_backend_counts_the_scores_it_answers(servers, rows):
    """Every blended score a version answers is observed in the histogram ensemble_served_score{model, version}
    (its _bucket{le}, _count and _sum): the ranker's plain requests scored in C, and ranking requests
    (the rank model's "scores", answered from Python). The deltas equal the answered scores binned
    here, exactly."""
    import time
    import urllib.request

    from clients.triton import RankerClient
    from ensemble.models.registry import Layout
    from ensemble.operate.monitoring import parse_exposition

    srv = servers(Layout.NATIVE)

    def served(model: str) -> dict:
        with urllib.request.urlopen(srv.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        # a histogram in Prometheus's metadata too, not counters named like one
        assert "# TYPE ensemble_served_score histogram" in text
        samples = parse_exposition(text)
        out = {}
        for name in ("bucket", "count", "sum"):
            for labels, value in samples.get(f"ensemble_served_score_{name}", []):
                if labels.get("model") == model:
                    out[(labels["version"], labels.get("le", name))] = value
        return out

    def binned(scores: np.ndarray, bounds: list[str]) -> dict:
        scores = scores[~np.isnan(scores)].astype(np.float64)
        counts = {le: float(np.sum(scores <= float(le))) for le in bounds}
        return {**counts, "count": float(len(scores)), "sum": float(np.sum(scores))}

    def delta(model: str, before: dict, answered: np.ndarray) -> None:
        bounds = sorted({le for _, le in before if le not in ("count", "sum")}, key=float)
        assert len(bounds) == 16 and bounds[-1] == "+Inf", bounds
        want = binned(answered, bounds)
        deadline = time.monotonic() + 5  # counted just after each answer is sent
        while True:
            now = served(model)
            got = {le: now[(v, le)] - before[(v, le)] for v, le in before}
            if got["count"] == want["count"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert {k: v for k, v in got.items() if k != "sum"} == {k: v for k, v in want.items() if k != "sum"}
        assert got["sum"] == pytest.approx(want["sum"], rel=1e-6)

    dense, cats = rows
    before = served(schema.Model.RANKER.value)
    assert len({v for v, _ in before}) == 1  # one version serves
    client = RankerClient(srv.http_url, "http")
    answered = [np.asarray(client.score(dense[a:b], cats[a:b])).ravel() for a, b in ((0, 1), (1, 40), (40, 1040))]
    answered.append(np.asarray(RankerClient(srv.grpc_url, "grpc").score(dense[:7], cats[:7])).ravel())
    delta(schema.Model.RANKER.value, before, np.concatenate(answered))

    before = served(schema.RANK_MODEL)
    ranked = [client.rank(None, (dense[a:b], cats[a:b])).scores for a, b in ((0, 30), (100, 300))]
    delta(schema.RANK_MODEL, before, np.concatenate(ranked).astype(np.float32))


@pytest.mark.parametrize("layout_name", ["native", "fused"])
def test_a_call_answers_its_interactive_requests_before_scoring_its_bulk_ones(servers, pipeline, layout_name):
    """A call that takes interactive and bulk requests (batch scoring's) scores and answers the
    interactive ones first, then the bulk ones (the native layout in C, the fused one in Python), so
    an interactive answer does not wait for bulk rows. Two full bulk requests keep the model busy
    while a 1-row request and another bulk one arrive; Triton hands those two to a call together, and
    the 1-row answer comes back ahead of the bulk one by the bulk rows' scoring: over a sixth of a lone
    bulk request's round trip (answered together, the two come back within a millisecond of each
    other)."""
    import statistics
    import threading
    import time

    from clients.triton import RankerClient
    from ensemble.models.registry import Layout

    srv = servers(Layout(layout_name))
    interactive = RankerClient(srv.grpc_url, "grpc")
    full = interactive.max_batch_size
    dense, cats = fresh_rows(full, seed=77)
    dense, cats = dense[:full], cats[:full]
    expected = pipeline.score(dense, cats)["score"].ravel()
    busy = [RankerClient(srv.grpc_url, "grpc", priority=schema.Priority.BATCH) for _ in range(2)]
    bulk = RankerClient(srv.grpc_url, "grpc", priority=schema.Priority.BATCH)

    def timed(client, rows: slice, done: dict, key: str) -> None:
        scores = client.infer(dense[rows], cats[rows])[schema.SCORE.name]
        done[key] = time.perf_counter(), float(np.max(np.abs(scores - expected[rows])))

    alone = []
    for _ in range(3):
        started = time.perf_counter()
        bulk.infer(dense[1:], cats[1:])
        alone.append(time.perf_counter() - started)
    gaps = []
    for _ in range(5):
        done: dict[str, tuple[float, float]] = {}  # answered at, largest difference from in-process
        threads = [threading.Thread(target=timed, args=(client, slice(0, full), done, f"busy {k}"))
                   for k, client in enumerate(busy)]
        for t in threads:
            t.start()
        time.sleep(0.005)  # two full calls first: the next two requests queue behind them and share a call
        threads += [threading.Thread(target=timed, args=(interactive, slice(0, 1), done, "interactive")),
                    threading.Thread(target=timed, args=(bulk, slice(1, full), done, "bulk"))]
        for t in threads[2:]:
            t.start()
        for t in threads:
            t.join(60)
        assert len(done) == 4, done  # a failed request: raised in its thread
        assert all(error <= TOL for _, error in done.values()), done
        gaps.append(done["bulk"][0] - done["interactive"][0])
    print(f"\nbulk request alone {statistics.median(alone) * 1e3:.1f} ms; the 1-row answer ahead of the bulk one "
          f"by {', '.join(f'{g * 1e3:.1f}' for g in gaps)} ms")
    assert statistics.median(gaps) > 0.15 * statistics.median(alone), (gaps, alone)
