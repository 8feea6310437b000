"""Latency-summary flags, the PromQL/exposition readers, and the Grafana dashboard and Prometheus
configuration checked statically (the integration test checks the names against a real server)."""

import json
from pathlib import Path

import pytest
import yaml

from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.operate.monitoring import (DASHBOARD, DEFAULT_QUANTILES, LatencySummaries, dashboard_metric_names,
                                         dashboard_queries, format_quantiles, parse_exposition, parse_quantiles,
                                         promql_metric_names)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker" / "grafana"


def test_quantiles_round_trip_and_bad_values_are_named():
    assert parse_quantiles(format_quantiles(DEFAULT_QUANTILES)) == DEFAULT_QUANTILES
    assert parse_quantiles(" 0.5:0.05, 0.999:0.0001 ") == ((0.5, 0.05), (0.999, 0.0001))
    for bad in ("0.5", "1.2:0.01", "0:0", "0.99:0.02", "a:b", "", "0.5:-0.1"):
        with pytest.raises(ValueError, match="quantile"):
            parse_quantiles(bad)


def test_server_flags_off_by_default_and_on_on_request():
    def command(summaries: LatencySummaries) -> list[str]:
        options = ServerOptions(Path("repo"), latency_summaries=summaries)
        return TritonServer(options).command(Path("/bin/tritonserver"), Path("/backends"))

    assert "--metrics-config=summary_latencies=false" in command(LatencySummaries())
    on = command(LatencySummaries(True))
    assert "--metrics-config=summary_latencies=true" in on
    assert "--metrics-config=summary_quantiles=0.5:0.05,0.9:0.01,0.95:0.005,0.99:0.001" in on
    off = command(LatencySummaries(enabled=False))
    assert "--metrics-config=summary_latencies=false" in off and not any("summary_quantiles" in a for a in off)
    with pytest.raises(ValueError):  # the binary would only log it and start without quantiles
        command(LatencySummaries(True, ((1.5, 0.1),)))


def test_serve_flags_reach_the_server_options():
    from ensemble.cli import build_parser
    from ensemble.cli.common import _server_options

    def summaries(*argv: str) -> LatencySummaries:
        return _server_options(build_parser().parse_args(["serve", *argv])).latency_summaries

    assert summaries() == LatencySummaries(False, DEFAULT_QUANTILES)
    assert summaries("--latency-summaries") == LatencySummaries(True, DEFAULT_QUANTILES)
    assert summaries("--latency-quantiles", "0.5:0.05,0.99:0.001") == LatencySummaries(True, ((0.5, 0.05), (0.99, 0.001)))
    assert summaries("--no-latency-summaries", "--latency-quantiles", "0.99:0.001").enabled is False
    assert summaries("--latency-summaries", "--no-latency-summaries").enabled is False


@pytest.mark.parametrize("expr, names", [
    ('sum by (model) (rate(nv_inference_request_success{model=~"$model"}[$__rate_interval]))',
     {"nv_inference_request_success"}),
    ('sum by (model) (rate(a_total{x="by (y)"}[5m])) / sum without (version) (rate(b:c[1m] offset 5m))',
     {"a_total", "b:c"}),
    ('max by (model, quantile) (nv_inference_queue_summary_us{model=~"$model"}) / 1e3 > bool 0.5',
     {"nv_inference_queue_summary_us"}),
    ("histogram_quantile(0.99, sum by (le) (rate(x_bucket[$__rate_interval]))) and on (job) up", {"x_bucket", "up"}),
    ("nv_cpu_utilization", {"nv_cpu_utilization"}),
])
def test_promql_metric_names(expr, names):
    assert promql_metric_names(expr) == names


def test_exposition_parser_reads_labels_values_and_summaries():
    text = """# HELP nv_inference_queue_summary_us Summary of queuing duration
# TYPE nv_inference_queue_summary_us summary
nv_inference_queue_summary_us_count{model="ranker",version="1"} 161
nv_inference_queue_summary_us{model="ranker",version="1",quantile="0.5"} 55
nv_cpu_utilization 0.25
"""
    samples = parse_exposition(text)
    assert samples["nv_inference_queue_summary_us_count"] == [({"model": "ranker", "version": "1"}, 161.0)]
    assert samples["nv_inference_queue_summary_us"][0][0]["quantile"] == "0.5"
    assert samples["nv_cpu_utilization"] == [({}, 0.25)] and len(samples) == 3


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_covers_what_the_issue_asks(dashboard):
    names = dashboard_metric_names()
    for needed in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_queue_duration_us",
                   "nv_inference_compute_infer_duration_us", "nv_inference_request_summary_us",
                   "nv_inference_queue_summary_us", "nv_inference_compute_infer_summary_us"):
        assert needed in names, needed
    variable = dashboard["templating"]["list"][0]
    assert variable["name"] == "model" and "nv_inference_request_success" in dashboard_queries(dashboard)[-1]


def test_dashboard_is_well_formed_for_grafana(dashboard):
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid and panel["targets"] and panel["description"]
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"])
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36


def test_prometheus_scrapes_triton_metrics_port_and_grafana_is_provisioned():
    from tests.unit.test_compose import COMPOSE

    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["triton:8002"] and config["scrape_configs"][0]["metrics_path"] == "/metrics"
    assert "8002:8002" in services["triton"]["ports"] and "triton" in services["triton-cpu"]["networks"]["default"][
        "aliases"]
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "ensemble.yml").read_text())
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"]}
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert (mounts[dashboards_dir] / DASHBOARD.name).resolve() == DASHBOARD
    assert mounts["/etc/grafana/provisioning"].resolve() == (GRAFANA / "provisioning")
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090" and "9090:9090" in services["prometheus"]["ports"]
    prometheus_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert (ROOT / prometheus_mounts["/etc/prometheus/prometheus.yml"]).resolve() == ROOT / "docker" / "prometheus.yml"


def test_gpu_triton_service_exports_the_same_summaries():
    from tests.unit.test_compose import COMPOSE

    triton = yaml.safe_load(COMPOSE.read_text())["services"]["triton"]
    assert set(LatencySummaries(True).server_args()) <= set(triton["command"])
