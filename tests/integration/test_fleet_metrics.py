"""A real Prometheus scraping a real fleet: two tritonservers behind the Envoy gateway, traffic through
the gateway, and every query the Grafana dashboard runs evaluated by Prometheus itself, which must
return data (not only name metrics that exist)."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from ensemble import schema
from ensemble.fleet.fleet import Fleet, FleetOptions
from ensemble.fleet.prometheus import GATEWAY_JOB, TRITON_JOB, Prometheus, scrape_config
from ensemble.operate.monitoring import (DASHBOARD, EXPERIMENT_METRIC_PREFIXES, STORE_METRIC_PREFIX, TABLE_METRIC_PREFIX,
                                         dashboard_queries)
from ensemble.operate.monitoring import LatencySummaries
from ensemble.operate.server import ServerOptions
from ensemble.base.machine import free_port
from tests.helpers import ADMIN_KEY, fleet_ports, fresh_rows

RATE_WINDOW = "20s"  # Grafana's $__rate_interval for a 1 s scrape: at least four scrapes
DATA_WAIT_S = 90.0


def concrete(expr: str) -> str:
    """A dashboard expression as Grafana sends it: every model selected, the rate window set."""
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", ".*")


@pytest.fixture(scope="module")
def observed(trained, tmp_path_factory):
    import json

    from clients.triton import RankerClient

    root = tmp_path_factory.mktemp("fleet-metrics")
    lines: list[str] = []
    http, grpc, metrics = fleet_ports(2)
    options = FleetOptions(ServerOptions(trained.repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                         log_file=root / "serve.log", latency_summaries=LatencySummaries(True),
                                         admin_key=ADMIN_KEY),
                           replicas=2)  # summaries on: the dashboard's latency panels read them
    fleet = Fleet(options, log=lines.append).start()
    stop = threading.Event()
    supervising = threading.Thread(target=fleet.run, args=(stop.is_set,), daemon=True)
    supervising.start()
    prometheus = None
    try:
        targets = [s.metrics_url.split("//", 1)[1].rsplit("/", 1)[0] for s in fleet.servers]
        prometheus = Prometheus(scrape_config(targets, f"127.0.0.1:{fleet.gateway.admin_port}", interval_s=1),
                                free_port(), root / "prometheus").start()
        gateway = f"{fleet.gateway.host}:{fleet.gateway.http_port}"
        dense, categorical = fresh_rows(200, seed=5150)
        clients = [RankerClient(gateway, "http"),
                   RankerClient(f"{fleet.gateway.host}:{fleet.gateway.grpc_port}", "grpc")]
        end = time.monotonic() + 8
        i = 0
        while time.monotonic() < end:  # 1- and 100-row requests over both protocols, for a few scrapes
            rows = 100 if i % 4 == 0 else 1
            start = (i * 7) % 100
            clients[i % 2].score(dense[start:start + rows], categorical[start:start + rows])
            i += 1
        import urllib.error
        import urllib.request

        bad = json.dumps({"inputs": [{"name": schema.DENSE.name, "shape": [1, 2], "datatype": "FP32",
                                      "data": [0, 0]}]}).encode()
        try:  # one bad request: the failure counters carry a reason
            urllib.request.urlopen(urllib.request.Request(f"http://{gateway}{schema.RANKER_INFER_PATH}", bad),
                                   timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
        yield fleet, prometheus, i
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop.set()
        fleet.stop()
        supervising.join(60)


def _data(prometheus: Prometheus, expr: str, want=lambda result: bool(result)) -> list[dict]:
    """Evaluate ``expr`` until ``want(result)`` holds or the wait runs out; the last result."""
    deadline = time.monotonic() + DATA_WAIT_S
    while True:
        result = prometheus.query(expr)
        if want(result) or time.monotonic() > deadline:
            return result
        time.sleep(1)


def test_prometheus_scrapes_every_replica_and_the_gateway(observed):
    fleet, prometheus, _ = observed
    up = _data(prometheus, "up == 1", lambda r: len(r) == 3)
    jobs = sorted(sample["metric"]["job"] for sample in up)
    assert jobs == [GATEWAY_JOB, TRITON_JOB, TRITON_JOB], (up, prometheus.targets())


def test_every_dashboard_query_returns_data(observed):
    import json

    fleet, prometheus, sent = observed
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 20 and any("envoy_" in q for q in queries)
    empty = []
    for expr in queries:
        if STORE_METRIC_PREFIX in expr:  # the online-store row: a server with a store (test_rank_ids.py)
            continue
        if TABLE_METRIC_PREFIX in expr:  # the tables row: a row store release (test_tables.py)
            continue
        if any(p in expr for p in EXPERIMENT_METRIC_PREFIXES):  # an experiment's panels (test_experiments.py)
            continue
        if expr.startswith("label_values("):  # Grafana's variable query: the series it reads
            expr = re.fullmatch(r"label_values\((\w+), *\w+\)", expr).group(1)
        if not _data(prometheus, concrete(expr)):
            empty.append(expr)
    assert not empty, f"dashboard queries with no data from a fleet that answered {sent} requests: {empty}"


def test_fleet_panels_see_each_replica_and_one_release(observed):
    fleet, prometheus, _ = observed
    per_replica = _data(prometheus, f'sum by (instance) (rate(nv_inference_request_success{{model="ranker"}}'
                                    f'[{RATE_WINDOW}]))', lambda r: len(r) == 2)
    assert len(per_replica) == 2 and all(float(s["value"][1]) > 0 for s in per_replica), per_replica
    releases = _data(prometheus, 'count by (version) (nv_inference_request_success{model="ranker"})')
    assert [(s["metric"]["version"], s["value"][1]) for s in releases] == [(releases[0]["metric"]["version"], "2")]
    healthy = _data(prometheus, 'sum by (envoy_cluster_name) (envoy_cluster_membership_healthy'
                                '{envoy_cluster_name=~"replicas_(http|grpc)"})', lambda r: len(r) == 2)
    assert sorted((s["metric"]["envoy_cluster_name"], s["value"][1]) for s in healthy) == [
        ("replicas_grpc", "2"), ("replicas_http", "2")]
    answered = _data(prometheus, 'sum(envoy_http_downstream_rq_xx{envoy_http_conn_manager_prefix=~"http|grpc",'
                                 'envoy_response_code_class="2"})')
    assert answered and float(answered[0]["value"][1]) >= 10, answered
    assert np.isfinite(float(per_replica[0]["value"][1]))


def test_the_autoscalers_metric_query_returns_one_value_per_replica(observed):
    """prometheus-adapter's rule (deploy/kubernetes/prometheus-adapter) as the adapter runs it for
    the autoscaler, with the replica's ``instance`` label standing in for the pod's."""
    from ensemble.fleet.kubernetes import adapter_rules

    fleet, prometheus, _ = observed
    rule = adapter_rules()["rules"][0]
    expr = rule["metricsQuery"].replace("<<.LabelMatchers>>", f'job="{TRITON_JOB}"').replace("<<.GroupBy>>", "instance")
    result = _data(prometheus, expr, lambda r: len(r) == 2)
    assert len(result) == 2 and all(float(s["value"][1]) >= 0 for s in result), (expr, result)
    series = rule["seriesQuery"].split("{")[0]
    assert _data(prometheus, f'{series}{{model="ranker"}}'), series

