"""Ranking by ids against a real redis-server (single and cluster) and the real tritonserver: MovieLens
100k materialized into the store, ids-only ranking requests over HTTP and gRPC equal to the inline
requests built from the same stored features, every edge case, and the store's outage."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pandas as pd
import pytest

from ensemble import dataset, online, schema
from ensemble.online import materialize
from ensemble.data import movielens
from ensemble.models.registry import Layout
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_port, free_ports
from ensemble.online.local import LocalRedis, LocalRedisCluster, cluster_ports

SPEC = dataset.load_spec(movielens.SPEC)


@pytest.fixture(scope="module")
def frame():
    return movielens.load()


@pytest.fixture(scope="module")
def store(frame, tmp_path_factory):
    redis = LocalRedis(free_port(), tmp_path_factory.mktemp("redis")).start()
    materialize.materialize(SPEC, frame, redis.url)
    yield redis
    redis.stop()


def _serve(repository, store_url: str, log, **settings) -> TritonServer:
    http, grpc, metrics = free_ports(3)
    server = TritonServer(ServerOptions(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                        layout=Layout.NATIVE, log_file=log,
                                        store=online.StoreSettings(store_url, **settings)))
    return server.start()


@pytest.fixture(scope="module")
def server(movielens_run, store):
    root, _ = movielens_run
    server = _serve(root / "repository", store.url, root / "tritonserver-ids.log")
    yield server
    server.stop()


def _client(server, protocol: str = "http", attempts: int = 1):
    from clients.triton import RankerClient, Retry

    return RankerClient(server.http_url if protocol == "http" else server.grpc_url, protocol, dataset=SPEC,
                        retry=Retry(attempts=attempts))


def _stored(store_url: str, user: str | None, items: list[str]) -> online.Rows:
    """The inline request's tensors, read from the store by the test (no cache)."""
    lookup = online.FeatureLookup(store_url, SPEC.name, cache_entries=0, timeout_s=2.0)
    try:
        return lookup.rows(None if user is None else user.encode(), [i.encode() for i in items])
    finally:
        lookup.close()


def _inline(client, rows: online.Rows, k=None):
    return client.rank((rows.context_dense, rows.context_categorical),
                       (rows.candidate_dense, rows.candidate_categorical), k=k)


def _items(n: int, seed: int = 0) -> list[str]:
    return [str(i) for i in np.random.default_rng(seed).choice(np.arange(1, 1683), n, replace=False)]


def test_materialize_writes_each_entitys_latest_row_once_and_check_reports_it(frame, tmp_path):
    redis = LocalRedis(free_port(), tmp_path).start()
    try:
        first = materialize.materialize(SPEC, frame, redis.url)
        assert [(s.side, s.key, s.entities, s.written) for s in first.sides] == [
            ("context", "user_id", 943, 943), ("candidate", "movie_id", 1682, 1682)]
        assert first.memory_after > first.memory_before
        again = materialize.materialize(SPEC, frame, redis.url)
        assert [(s.written, s.unchanged, s.kept_newer) for s in again.sides] == [(0, 943, 0), (0, 1682, 0)]

        # A later row of one user replaces the stored one; an earlier row of another does not.
        latest = frame[frame["user_id"] == "1"].iloc[[-1]].assign(age=99.0, timestamp=frame["timestamp"].max() + 10)
        older = frame[frame["user_id"] == "2"].iloc[[0]].assign(age=1.0, timestamp=0)
        changed = materialize.materialize(SPEC, pd.concat([latest, older]), redis.url)
        # (each row's movie takes the row's time too: one movie newer, one older than stored)
        assert [(s.written, s.unchanged, s.kept_newer) for s in changed.sides] == [(1, 0, 1), (1, 0, 1)]
        rows = _stored(redis.url, "1", ["1"])
        assert rows.context_dense.tolist() == [99.0] and rows.context_categorical[0] == b"1"
        assert _stored(redis.url, "2", ["1"]).context_dense.tolist() != [1.0]

        report = materialize.check(SPEC, redis.url, now=float(frame["timestamp"].max()))
        assert report["meta"] == "matches"
        assert {s: v["entities"] for s, v in report["sides"].items()} == {"context": 943, "candidate": 1682}
        assert report["sides"]["context"]["newest_s"] == -10.0  # user 1's row is 10 s in the future of `now`
    finally:
        redis.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ids_rank_equals_the_inline_request_built_from_the_stored_features(server, store, protocol):
    client = _client(server, protocol)
    for user, items in (("1", _items(100)), ("943", _items(7, seed=1)), ("400", ["50", "50", "181", "50"])):
        rows = _stored(store.url, user, items)
        want = _inline(client, rows)
        got = client.rank_ids(user, items)
        assert np.array_equal(got.scores, want.scores) and np.array_equal(got.order, want.order)
        assert got.dropped.size == 0
        assert np.array_equal(client.rank_ids(user, items, k=5).order, want.order[:5])
    # Repeats score the same, ties keep the order sent.
    repeated = client.rank_ids("400", ["50", "50", "181", "50"])
    assert repeated.scores[0] == repeated.scores[1] == repeated.scores[3]
    assert [i for i in repeated.order if i != 2] == [0, 1, 3]
    # Request-time context features replace the stored user's.
    rows = _stored(store.url, "1", _items(20))
    context = {"age": 30.0, "user_id": "1", "gender": "F", "occupation": "writer", "zip3": "100"}
    with_context = client.rank_ids("1", _items(20), context=context)
    inline = client.rank(context, (rows.candidate_dense, rows.candidate_categorical))
    assert np.array_equal(with_context.scores, inline.scores)


def test_unknown_ids_are_defined_and_limits_refused(server, store):
    from clients.triton import ScoringError

    client = _client(server)
    # An unknown user: the context's key and missing values, as an inline request for a new user.
    items = _items(10)
    rows = _stored(store.url, "1", items)
    new_user = client.rank_ids("no-such-user", items)
    default = online.Side("user_id", 0, 1, 4).default(b"no-such-user")
    inline = client.rank(default, (rows.candidate_dense, rows.candidate_categorical))
    assert np.array_equal(new_user.scores, inline.scores)

    # Unknown items are dropped: their indices answered, NaN scores, not in the order.
    mixed = client.rank_ids("1", ["1", "nope", "2", "99999", "1"])
    assert mixed.dropped.tolist() == [1, 3]
    assert np.isnan(mixed.scores[[1, 3]]).all() and not np.isnan(mixed.scores[[0, 2, 4]]).any()
    assert sorted(mixed.order.tolist()) == [0, 2, 4]
    known = client.rank_ids("1", ["1", "2", "1"])
    assert np.array_equal(mixed.scores[[0, 2, 4]], known.scores)
    nothing = client.rank_ids("1", ["nope", "neither"])
    assert nothing.order.size == 0 and nothing.dropped.tolist() == [0, 1]

    # Refused, naming what is wrong; the server keeps ranking.
    for call, message in ((lambda: client.rank_ids("1", []), "empty item_ids"),
                          (lambda: client.rank_ids("1", [str(i % 1682 + 1) for i in range(schema.MAX_BATCH_SIZE + 1)]),
                           "at most 8192 on this server"),
                          (lambda: client.rank_ids("1", ["1"], k=-1), "top_k must be >= 0")):
        with pytest.raises(ScoringError, match=message):
            call()
    assert client.rank_ids("1", items).order.size == len(items)


def test_lookups_are_counted_in_the_servers_metrics(server):
    """ensemble_store_* counters on Triton's metrics port, as the dashboard's online-store row reads them."""
    from ensemble.operate.monitoring import parse_exposition

    def scrape():
        with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
            samples = parse_exposition(reply.read().decode())
        return {(name, labels.get("outcome", "")): value for name, series in samples.items()
                if name.startswith("ensemble_store_") for labels, value in series}

    client = _client(server)
    before = scrape()
    client.rank_ids("no-such-user", ["1", "2", "missing", "1"])
    client.rank_ids("no-such-user", ["1", "2"])
    deadline = time.monotonic() + 5
    while True:
        after = scrape()
        delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        if delta.get(("ensemble_store_entities_total", "unknown_item"), 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta[("ensemble_store_entities_total", "unknown_item")] == 1
    assert delta[("ensemble_store_entities_total", "unknown_user")] == 2
    found = delta.get(("ensemble_store_entities_total", "cache_hit"), 0) + delta.get(
        ("ensemble_store_entities_total", "store_hit"), 0)
    assert found == 4  # 1 and 2, twice
    assert ("ensemble_store_round_trips_total", "") in after


def test_ids_and_features_in_one_request_are_refused(server):
    body = ('{"inputs": [{"name": "item_ids", "shape": [1], "datatype": "BYTES", "data": ["1"]}, '
            '{"name": "candidate_dense", "shape": [1, 20], "datatype": "FP32", "data": [' + ",".join(["0"] * 20) + ']}, '
            '{"name": "candidate_categorical", "shape": [1, 1], "datatype": "BYTES", "data": ["1"]}]}').encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/rank/infer", body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400 and b"candidate features or item_ids, not both" in err.value.read()


def test_the_store_down_fails_fast_with_503_and_service_returns(server, store, frame):
    """Redis killed for 10 s under load: every ids request fails within its deadline with 503 naming the
    store (or is answered from the cache), inline requests keep being served, and ids requests are
    served again within 5 s of the store's return, with no server restart."""
    from clients.triton import ScoringError

    client = _client(server)
    pid = server.process.pid
    cached = _items(30, seed=5)
    client.rank_ids("5", cached)  # in the cache from now on (60 s)
    rows = _stored(store.url, "5", cached)
    store.kill()
    outcomes, slowest, started = {"refused": 0, "cached": 0}, 0.0, time.monotonic()
    seed = 100
    while time.monotonic() - started < 10:
        seed += 1
        t = time.monotonic()
        try:
            client.rank_ids("6", _items(10, seed=seed))
            raise AssertionError("an ids request was answered without the store")
        except ScoringError as exc:
            assert "503" in str(exc) or "UNAVAILABLE" in str(exc), exc
            assert "feature store redis://127.0.0.1" in str(exc), exc
            outcomes["refused"] += 1
        slowest = max(slowest, time.monotonic() - t)
        assert np.array_equal(client.rank_ids("5", cached).scores, _inline(client, rows).scores)
        outcomes["cached"] += 1
        time.sleep(0.05)
    assert outcomes["refused"] > 20 and slowest < 0.5, (outcomes, slowest)
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as reply:
        assert reply.status == 200

    store.start()
    materialize.materialize(SPEC, frame, store.url)
    back = time.monotonic()
    while True:
        try:
            client.rank_ids("6", _items(10, seed=1))
            break
        except ScoringError:
            assert time.monotonic() - back < 5, "ids requests were not served within 5 s of the store's return"
            time.sleep(0.05)
    assert server.process.pid == pid and server.process.poll() is None


def test_the_dashboards_store_panels_have_data_in_a_real_prometheus(server, tmp_path):
    """Prometheus scraping the server while ranking requests by ids go through: every query of the
    dashboard's online-store row returns data (the failures series exists since the outage above)."""
    import json

    from ensemble.fleet.prometheus import Prometheus, scrape_config
    from ensemble.operate.monitoring import DASHBOARD, STORE_METRIC_PREFIX, dashboard_queries

    target = server.metrics_url.split("//", 1)[1].rsplit("/", 1)[0]
    prometheus = Prometheus(scrape_config([target], None, interval_s=1), free_port(), tmp_path / "prometheus").start()
    try:
        client = _client(server)
        end, seed = time.monotonic() + 8, 0
        while time.monotonic() < end:  # a new user each time (from the store), 7 sets of items (cached)
            seed += 1
            client.rank_ids(str(seed % 900 + 1), _items(20, seed=seed % 7))
            time.sleep(0.02)  # paced: new users throughout the scrapes
        queries = [q for q in dashboard_queries(json.loads(DASHBOARD.read_text())) if STORE_METRIC_PREFIX in q]
        assert len(queries) == 4
        for expr in queries:
            expr = expr.replace("$__rate_interval", "20s")
            deadline = time.monotonic() + 60
            while not prometheus.query(expr):
                assert time.monotonic() < deadline, f"no data for {expr}"
                time.sleep(1)
        hit_rate = prometheus.query(next(q for q in queries if "cache_hit" in q).replace("$__rate_interval", "20s"))
        assert 0 < float(hit_rate[0]["value"][1]) < 1
    finally:
        prometheus.stop()


def test_a_redis_cluster_serves_the_same_rankings(movielens_run, store, tmp_path):
    cluster = LocalRedisCluster(cluster_ports(3), tmp_path).start()
    try:
        materialize.materialize(SPEC, movielens.load(), cluster.url)
        root, _ = movielens_run
        on_cluster = _serve(root / "repository", cluster.url, tmp_path / "tritonserver.log", cache_entries=0)
        try:
            for user, items in (("1", _items(100)), ("77", _items(9, seed=3) + ["unknown"])):
                want = _inline(_client(on_cluster), _stored(store.url, user, [i for i in items if i != "unknown"]))
                got = _client(on_cluster, "grpc").rank_ids(user, items)
                assert np.array_equal(got.scores[:len(want.scores)], want.scores)
                assert got.dropped.tolist() == ([9] if "unknown" in items else [])
        finally:
            on_cluster.stop()
    finally:
        cluster.stop()


def test_the_command_line_materializes_checks_and_ranks_by_ids(server, store, tmp_path):
    """`ensemble materialize` (again: nothing new), `--check`, and `ensemble rank --ids` on a file of ids."""
    import json
    import subprocess
    import sys

    def ensemble(*argv):
        done = subprocess.run([sys.executable, "-m", "ensemble", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    out = ensemble("materialize", "--dataset", SPEC.name, "--store", store.url, "--report", str(tmp_path / "m.json"))
    assert "user_id): 943 entities, 0 written, 943 unchanged" in out and "1682 unchanged" in out, out
    assert json.loads((tmp_path / "m.json").read_text())["sides"][1]["written"] == 0
    checked = json.loads(ensemble("materialize", "--dataset", SPEC.name, "--store", store.url, "--check"))
    assert checked["meta"] == "matches" and checked["sides"]["candidate"]["entities"] == 1682

    ids = pd.DataFrame({"user_id": ["1"] * 5 + ["2"] * 3, "movie_id": ["1", "50", "181", "nope", "7", "1", "2", "3"]})
    ids.to_csv(tmp_path / "ids.csv", index=False)
    ensemble("rank", str(tmp_path / "ids.csv"), "--dataset", SPEC.name, "--group-by", "user_id", "--ids",
             "--url", f"grpc://{server.grpc_url}", "--output", str(tmp_path / "ranked.parquet"))
    ranked = pd.read_parquet(tmp_path / "ranked.parquet")
    client = _client(server)
    for user, rows in ((("1"), [0, 1, 2, 4]), ("2", [5, 6, 7])):
        want = client.rank_ids(user, ids["movie_id"].iloc[rows].tolist())
        got = ranked[ranked["user_id"] == user].sort_values("row")
        assert got["row"].tolist() == rows  # the unknown movie is left out
        assert np.array_equal(got["score"].to_numpy(np.float32), want.scores)
