"""The metrics port of the real server: every metric the Grafana dashboard queries is exported,
with samples for the served models, and the latency summaries carry the configured quantiles."""

from __future__ import annotations

import time
import urllib.request

from ensemble.models.registry import Layout
from ensemble.schema import Model
from ensemble.operate.monitoring import (DEFAULT_QUANTILES, GATEWAY_METRIC_PREFIX, NATIVE_METRIC_PREFIX,
                                         EXPERIMENT_METRIC_PREFIXES, STORE_METRIC_PREFIX, TABLE_METRIC_PREFIX,
                                         dashboard_metric_names,
                                         parse_exposition)
from tests.helpers import fresh_rows

# Metrics without a model label (host-wide).
HOST_METRICS = {"nv_cpu_utilization", "nv_cpu_memory_used_bytes", "nv_cpu_memory_total_bytes"}
REQUESTS = 6


def _scrape(server) -> dict:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        return parse_exposition(reply.read().decode())


def _models(samples: list) -> set[str]:
    return {labels["model"] for labels, _ in samples if "model" in labels}


def test_every_dashboard_metric_is_exported(layout_server):
    from clients.triton import RankerClient

    dense, categorical = fresh_rows(40, seed=808)
    before = _scrape(layout_server)
    client = RankerClient(layout_server.http_url, "http")
    for i in range(REQUESTS):
        client.score(dense[i * 5:(i + 1) * 5], categorical[i * 5:(i + 1) * 5])

    def count(samples, metric):
        return sum(v for labels, v in samples.get(metric, []) if labels.get("model") == Model.RANKER.value)

    # Statistics follow the answers: the native backend reports them from a thread of its own, just
    # after the answer is sent (backend.c), so a scrape may briefly trail the last answer.
    deadline = time.monotonic() + 10
    after = _scrape(layout_server)
    while (count(after, "nv_inference_request_success") - count(before, "nv_inference_request_success") < REQUESTS
           and time.monotonic() < deadline):
        time.sleep(0.05)
        after = _scrape(layout_server)

    # the gateway's: a fleet's; the store's: a server with an online store's (tests/integration/test_rank_ids.py);
    # the shadow panels': an experiment's (test_experiments.py); the tables': a row store release's
    # (test_tables.py); the served scores: the native layout's
    elsewhere = (GATEWAY_METRIC_PREFIX, STORE_METRIC_PREFIX, TABLE_METRIC_PREFIX, *EXPERIMENT_METRIC_PREFIXES)
    if layout_server.options.layout is not Layout.NATIVE:
        elsewhere += (NATIVE_METRIC_PREFIX,)
    names = {n for n in dashboard_metric_names() if not n.startswith(elsewhere)}
    assert len(names) >= 10
    missing = sorted(n for n in names if n not in after)
    assert not missing, f"the dashboard queries metrics this server does not export: {missing}"
    expected_models = {Model.RANKER.value}
    for name in names - HOST_METRICS:
        assert expected_models <= _models(after[name]), f"{name}: no samples for {expected_models - _models(after[name])}"

    # the native layout says which C modules the install has, as built() reads them
    if layout_server.options.layout is Layout.NATIVE:
        from ensemble.native.built import built
        said = {labels["module"]: value for labels, value in after.get("ensemble_c_module_built", [])}
        assert said == {name: float(found) for name, found in built().items()}

    # the summaries observe each request once, as the success counter counts it
    assert count(after, "nv_inference_request_success") - count(before, "nv_inference_request_success") == REQUESTS
    assert (count(after, "nv_inference_request_summary_us_count")
            - count(before, "nv_inference_request_summary_us_count")) == REQUESTS


def test_latency_summaries_carry_the_configured_quantiles(server):
    after = _scrape(server)
    for stage in ("request", "queue", "compute_infer"):
        samples = [(labels, v) for labels, v in after[f"nv_inference_{stage}_summary_us"]
                   if labels["model"] == Model.RANKER.value]
        assert {float(labels["quantile"]) for labels, _ in samples} == {q for q, _ in DEFAULT_QUANTILES}
    p50, p99 = (next(v for labels, v in after["nv_inference_request_summary_us"]
                     if labels["model"] == Model.RANKER.value and float(labels["quantile"]) == q) for q in (0.5, 0.99))
    assert 0 < p50 <= p99  # microseconds, from requests the session has sent
