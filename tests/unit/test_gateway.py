"""The gateway's generated Envoy config: Envoy itself accepts every config the generator writes
(``envoy --mode validate``), the policies are in it, and bad fleet descriptions get clear errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ensemble.fleet import envoy_config as ec
from ensemble.fleet import gateway as gw
from ensemble.fleet.envoy import EnvoyError, validate
from ensemble.fleet.fleet import FleetError, FleetOptions, plan
from ensemble.operate.server import ServerOptions

TWO = gw.Gateway((gw.Replica(18100, 18101), gw.Replica(18102, 18103)), http_port=18000, grpc_port=18001,
                 admin_port=18002)


def _gateways() -> dict[str, gw.Gateway]:
    three = tuple(gw.Replica(19000 + 2 * i, 19001 + 2 * i) for i in range(3))
    return {"one replica": replace(TWO, replicas=TWO.replicas[:1]),
            "two replicas": TWO,
            "three replicas, all interfaces, own limits": gw.Gateway(three, host="0.0.0.0", max_request_bytes=4096,
                                                                     max_requests=10, retries=0),
            "pinned to a release": replace(TWO, release=7),
            "fleet plan": plan(FleetOptions(ServerOptions(Path("repo"), http_port=18500, grpc_port=18501,
                                                          metrics_port=18502, latency_objective_ms=10.0),
                                            replicas=4, replica_ports=18600, admin_port=18599))[1]}


@pytest.mark.parametrize("name", list(_gateways()))
def test_envoy_accepts_every_generated_config(name):
    validate(ec.envoy_config(_gateways()[name]))


def test_validate_reports_envoys_reason():
    config = ec.envoy_config(TWO)
    config["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    with pytest.raises(EnvoyError, match="NO_SUCH_POLICY"):
        validate(config)


def _routes(config: dict, listener: str) -> list[dict]:
    found = next(item for item in config["static_resources"]["listeners"] if item["name"] == listener)
    manager = found["filter_chains"][0]["filters"][0]["typed_config"]
    return manager["route_config"]["virtual_hosts"][0]["routes"]


def test_only_client_routes_reach_the_replicas():
    config = ec.envoy_config(TWO)
    http = _routes(config, "http")
    forwarded = [r["match"] for r in http if "route" in r]
    assert {m.get("path") for m in forwarded} >= {"/v2", "/v2/health/ready"}
    assert all("repository" not in str(m) for m in forwarded)
    assert http[-1]["direct_response"]["status"] == 403  # anything else, model control included
    grpc = _routes(config, "grpc")
    paths = {r["match"]["path"] for r in grpc if "route" in r}
    assert f"/{gw.GRPC_SERVICE}/ModelInfer" in paths
    assert not [p for p in paths if "Repository" in p or "SharedMemory" in p]
    assert grpc[-1]["direct_response"]["status"] == 403


def test_cluster_policies():
    config = ec.envoy_config(TWO)
    for cluster in config["static_resources"]["clusters"]:
        assert cluster["lb_policy"] == "LEAST_REQUEST"
        assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
        assert cluster["health_checks"][0]["http_health_check"]["path"] == "/v2/models/ranker/ready"
        assert cluster["outlier_detection"]["enforcing_consecutive_5xx"] == 0  # a deadline refusal is no fault
        limits = cluster["circuit_breakers"]["thresholds"][0]
        assert limits["max_requests"] == gw.requests_within_objective(None) * 2
        groups = cluster["load_assignment"]["endpoints"]
        health_ports = [e["endpoint"]["health_check_config"]["port_value"] for g in groups for e in g["lb_endpoints"]]
        assert health_ports == [18100, 18102]
        if cluster["name"].endswith("_stats"):  # cumulative counters: always the first healthy replica
            assert [g["priority"] for g in groups] == [0, 1]
        else:
            assert len(groups) == 1
    routes = {r["match"].get("path") or r["match"].get("safe_regex", {}).get("regex"): r["route"]["cluster"]
              for r in _routes(config, "http") + _routes(config, "grpc") if "route" in r}
    assert routes[gw.HTTP_STATS_PATHS] == "replicas_http_stats"
    assert routes[f"/{gw.GRPC_SERVICE}/ModelStatistics"] == "replicas_grpc_stats"
    assert routes[f"/{gw.GRPC_SERVICE}/ModelInfer"] == "replicas_grpc"
    grpc = next(c for c in config["static_resources"]["clusters"] if c["name"] == "replicas_grpc")
    options = grpc["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    retry = _routes(config, "grpc")[1]["route"]["retry_policy"]
    assert "unavailable" in retry["retry_on"] and retry["num_retries"] == 2
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"


def test_the_overload_bound_follows_the_objective():
    assert gw.requests_within_objective(500.0) == 2500
    assert gw.requests_within_objective(None) == gw.requests_within_objective(500.0)
    assert gw.requests_within_objective(1.0) == gw.MIN_REQUESTS_PER_REPLICA


@pytest.mark.parametrize("change, message", [
    ({"replicas": ()}, "at least one replica"),
    ({"admin_port": 18100}, "18100 given to more than one listener"),
    ({"http_port": 70000}, "out of range"),
    ({"retries": 9}, "retries must be 0-5"),
    ({"max_request_bytes": 10}, "max_request_bytes"),
])
def test_bad_gateways_are_refused(change, message):
    with pytest.raises(gw.GatewayError, match=message):
        ec.envoy_config(replace(TWO, **change))


def test_fleet_plan_ports_and_logs(tmp_path):
    options = FleetOptions(ServerOptions(Path("repo"), http_port=8000, grpc_port=8001, metrics_port=8002,
                                         log_file=tmp_path / "serve.log"), replicas=3, replica_ports=9100)
    servers, gateway = plan(options)
    assert [(s.http_port, s.grpc_port, s.metrics_port) for s in servers] == [
        (9100, 9101, 8002), (9102, 9103, 8003), (9104, 9105, 8004)]
    assert {s.host for s in servers} == {"127.0.0.1"}
    assert [s.log_file.name for s in servers] == ["serve-replica0.log", "serve-replica1.log", "serve-replica2.log"]
    assert (gateway.http_port, gateway.grpc_port) == (8000, 8001)
    assert gateway.max_requests == gw.requests_within_objective(None) * 3


def test_fleet_plan_never_picks_a_port_the_options_name():
    """Replica and admin ports picked at start avoid the gateway's and every replica's metrics port
    (none of which is bound yet), and one another; ports are never handed out twice."""
    from ensemble.base.machine import free_ports

    seen: set[int] = set()
    for _ in range(30):
        # The fleet serves replica metrics on metrics..metrics+3: the user's ports are chosen apart from
        # that range, or the plan rightly refuses them as serving twice.
        (metrics,) = free_ports(1)
        http, grpc = free_ports(2, avoid={metrics + i for i in range(4)})
        servers, gateway = plan(FleetOptions(ServerOptions(Path("repo"), http_port=http, grpc_port=grpc,
                                                           metrics_port=metrics), replicas=4))
        picked = [p for s in servers for p in (s.http_port, s.grpc_port)] + [gateway.admin_port]
        named = {http, grpc, *(metrics + i for i in range(4))}
        assert len(set(picked)) == len(picked) and not set(picked) & named
        assert not set(picked) & seen
        seen |= set(picked) | {http, grpc, metrics}
    lots = free_ports(200, avoid=seen)
    assert len(set(lots)) == 200 and not set(lots) & seen


def test_one_exposed_server_is_triton_on_loopback_behind_the_gateway():
    """The door: a fleet of one on a public address puts tritonserver on loopback ports of its own,
    and the gateway takes the user's HTTP, gRPC and metrics ports."""
    from ensemble.base.machine import free_ports

    http, grpc, metrics = free_ports(3)
    (server,), gateway = plan(FleetOptions(ServerOptions(Path("repo"), host="0.0.0.0", http_port=http, grpc_port=grpc,
                                                         metrics_port=metrics, admin_key="k"), replicas=1))
    assert server.host == "127.0.0.1" and server.admin_key == "k"
    assert not {server.http_port, server.grpc_port, server.metrics_port} & {http, grpc, metrics}
    assert (gateway.host, gateway.http_port, gateway.grpc_port, gateway.metrics_port) == ("0.0.0.0", http, grpc, metrics)
    assert gateway.replicas[0].metrics_port == server.metrics_port
    assert set(gateway.listeners()) == {("0.0.0.0", http), ("0.0.0.0", grpc), ("0.0.0.0", metrics),
                                        ("127.0.0.1", gateway.admin_port)}
    config = ec.envoy_config(gateway)
    listener = next(item for item in config["static_resources"]["listeners"] if item["name"] == "metrics")
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["path"] == "/metrics" and routes[0]["route"]["cluster"] == "replica_metrics"
    assert routes[-1]["direct_response"]["status"] == 404
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "replica_metrics"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert endpoint == {"address": "127.0.0.1", "port_value": server.metrics_port}
    # a fleet of several keeps each replica's metrics on its own port, without a metrics listener
    servers, several = plan(FleetOptions(ServerOptions(Path("repo"), http_port=http, grpc_port=grpc,
                                                       metrics_port=metrics), replicas=2))
    assert several.metrics_port is None and [s.metrics_port for s in servers] == [metrics, metrics + 1]
    with pytest.raises(gw.GatewayError, match="metrics for one replica"):
        replace(TWO, metrics_port=9000).check()


@pytest.mark.parametrize("options, message", [
    (FleetOptions(ServerOptions(Path("r")), replicas=0), "1 to 32 replicas"),
    (FleetOptions(ServerOptions(Path("r"), host="0.0.0.0"), replicas=1), "needs ENSEMBLE_ADMIN_KEY"),
    (FleetOptions(ServerOptions(Path("r"), host="0.0.0.0"), replicas=3), "needs ENSEMBLE_ADMIN_KEY"),
    (FleetOptions(ServerOptions(Path("r")), replicas=2, replica_ports=8000), "8000, 8001, 8002, 8003 would serve twice"),
    (FleetOptions(ServerOptions(Path("r")), replicas=2, replica_ports=65534), "no room"),
])
def test_bad_fleets_are_refused(options, message):
    with pytest.raises(FleetError, match=message):
        plan(options)


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "must be 1 to 32"),
    (["--replicas", "two"], "not a number"),
    (["--replica-ports", "9000"], "apply to a gateway"),
    (["--replicas", "1", "--gateway-admin-port", "9901"], "apply to a gateway"),
    (["--replicas", "2", "--replica-ports", "8000"], "would serve twice"),
])
def test_serve_refuses_bad_fleet_flags_before_starting_anything(capsys, argv, message):
    from ensemble import cli

    try:
        code = cli.main(["serve", "--repository", "no-such-repository", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_pinned_gateway_names_the_release_in_every_ranker_request():
    config = ec.envoy_config(replace(TWO, release=7))
    http = _routes(config, "http")
    pinned = [r for r in http if r["match"].get("path") == "/v2/models/ranker/infer"]
    assert pinned and pinned[0]["route"]["prefix_rewrite"] == "/v2/models/ranker/versions/7/infer"
    versioned = next(r for r in http if "safe_regex" in r["match"] and "models" in r["match"]["safe_regex"]["regex"]
                     and "stats" not in r["match"]["safe_regex"]["regex"])
    assert "prefix_rewrite" not in versioned["route"]  # a request naming its version keeps it
    grpc = _routes(config, "grpc")
    infer = next(r for r in grpc if r["match"].get("path", "").endswith("/ModelInfer"))
    assert infer["metadata"]["filter_metadata"][ec.LUA_FILTER] == {"release": "7"}
    manager = {item["name"]: item["filter_chains"][0]["filters"][0]["typed_config"]
               for item in config["static_resources"]["listeners"]}
    for name in ("http", "grpc"):
        header = manager[name]["route_config"]["virtual_hosts"][0]["request_headers_to_add"][0]["header"]
        assert header == {"key": "ensemble-release", "value": "7"}
    assert [f["name"] for f in manager["grpc"]["http_filters"]][-2:] == [ec.LUA_FILTER, "envoy.filters.http.router"]
    http_lua = [f["typed_config"]["default_source_code"]["inline_string"] for f in manager["http"]["http_filters"]
                if f["name"] == ec.LUA_FILTER]
    assert http_lua == [ec.lua_source(ec.LuaFilter.CLIENT_ERROR)]  # the HTTP listener's only Lua (JSON depth, 500s)
    unpinned = ec.envoy_config(TWO)
    assert "/v2/models/ranker/infer" not in [r["match"].get("path") for r in _routes(unpinned, "http")]


def test_routes_from_files_switch_by_rename(tmp_path):
    gateway = replace(TWO, release=3, routes_dir=str(tmp_path))
    with pytest.raises(gw.GatewayError, match="bootstrap"):
        ec.write_routes(TWO)
    written = ec.write_routes(gateway)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routes-grpc.json", "routes-http.json"] == \
        sorted(p.name for p in written)  # no temporary file left beside them
    import json

    http = json.loads((tmp_path / "routes-http.json").read_text())
    assert http["version_info"] == ec.routes_version(3) and http["resources"][0]["name"] == "http"
    manager = ec.envoy_config(gateway)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    rds = manager["typed_config"]["rds"]
    assert rds["config_source"]["path_config_source"]["path"] == str(tmp_path / "routes-http.json")
    validate(ec.envoy_config(gateway))  # Envoy reads the files
    ec.write_routes(replace(gateway, release=4))
    assert json.loads((tmp_path / "routes-grpc.json").read_text())["version_info"] == ec.routes_version(4)
    # between releases nothing is pinned and the Lua filter is off on every gRPC route (no cost)
    unpinned = ec.route_config("grpc", replace(gateway, release=None), grpc=True)
    forwarded = [r for r in unpinned["virtual_hosts"][0]["routes"] if "route" in r]
    assert forwarded and all(r["typed_per_filter_config"][ec.LUA_FILTER]["disabled"] for r in forwarded)
    assert "request_headers_to_add" not in unpinned["virtual_hosts"][0]


def test_a_grpc_client_is_told_the_status_each_refusal_means():
    """Envoy's own table would answer a gRPC client 413 as UNKNOWN and 400 as INTERNAL; the gateway
    gives each of its own answers the gRPC status its HTTP status means (tests/integration/test_door.py
    sends them)."""
    config = ec.envoy_config(TWO)
    for listener in config["static_resources"]["listeners"][:2]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        mapped = {}
        for mapper in manager["local_reply_config"]["mappers"]:
            status, grpc_only = mapper["filter"]["and_filter"]["filters"]
            assert grpc_only["header_filter"]["header"]["name"] == "content-type"  # HTTP answers are left alone
            mapped[status["status_code_filter"]["comparison"]["value"]["default_value"]] = \
                mapper["headers_to_add"][0]["header"]["value"]
        assert mapped == {400: "3", 403: "7", 404: "12", 413: "8", 415: "12", 503: "14"}, listener["name"]
