"""An experiment's arms as the gateway serves them: the checks, the hash that chooses an arm, the
routes written for it, and the declaration that outlives a restart. (Envoy's Lua computing the same
arm as :func:`arm_of` is tested against a real gateway in tests/integration/test_experiments.py.)"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ensemble.fleet.arms import ARM_POINTS, arm_bounds, arm_of, arm_point, check_arms
from ensemble.fleet.envoy_config import route_config, routes_version, write_routes
from ensemble.fleet.gateway import Gateway, GatewayError, Replica
from ensemble.repository import declared
from ensemble.schema import Model


@pytest.mark.parametrize("release, arms, key, problem", [
    (None, ((2, 10.0),), None, "serving release"),
    (1, ((1, 10.0),), None, "distinct"),
    (1, ((2, 10.0), (2, 5.0)), None, "distinct"),
    (1, ((2, 0.0),), None, "(0, 100)"),
    (1, ((2, 60.0), (3, 40.0)), None, "sum below 100"),
    (1, ((2, 0.001),), None, "at least"),
    (1, ((2, 10.0),), "X-User", "lower-case"),
    (1, ((2, 10.0),), "x user", "lower-case"),
    (1, (), "x-user", "needs an experiment"),
])
def test_arms_that_cannot_be_served_are_refused(release, arms, key, problem):
    with pytest.raises(GatewayError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        check_arms(release, arms, key)


def test_a_key_always_gets_the_same_arm_and_the_shares_hold():
    arms = ((2, 10.0), (3, 5.0))
    keys = [f"user-{i}" for i in range(100_000)]
    first = [arm_of(k, 1, arms) for k in keys]
    assert first == [arm_of(k, 1, arms) for k in keys]  # no state: the same on any gateway, after restarts
    counts = Counter(first)
    assert abs(counts[2] / len(keys) - 0.10) < 0.005 and abs(counts[3] / len(keys) - 0.05) < 0.005
    assert arm_of(b"user-7", 1, arms) == arm_of("user-7", 1, arms)
    assert all(0 <= arm_point(k) < ARM_POINTS for k in keys[:1000])
    assert arm_bounds(1, arms) == [(2, 1000), (3, 1500), (1, ARM_POINTS)]


def test_the_routes_of_an_experiment_carry_the_arms_for_the_lua_filters(tmp_path):
    gateway = Gateway((Replica(9100, 9101),), http_port=9200, grpc_port=9201, admin_port=9202, release=1,
                      arms=((2, 10.0), (3, 5.0)), arm_key="x-user", routes_dir=str(tmp_path))
    write_routes(gateway)
    http = json.loads((tmp_path / "routes-http.json").read_text())
    assert http["version_info"] == routes_version(1, gateway.arms, "x-user") == "experiment-1-2x10-3x5-by-x-user"
    routes = http["resources"][0]["virtual_hosts"][0]
    assert "request_headers_to_add" not in routes  # the filter sets the release per request
    ranker = next(r for r in routes["routes"] if r["match"].get("path") == f"/v2/models/{Model.RANKER.value}/infer")
    meta = ranker["metadata"]["filter_metadata"]["envoy.filters.http.lua"]
    assert meta == {"release": "1", "arms": "2:1000;3:1500", "key": "x-user",
                    "path": f"/v2/models/{Model.RANKER.value}/versions/"}
    assert "prefix_rewrite" not in ranker["route"]
    assert any(r["match"].get("path") == "/v2/models/rank/infer" and "metadata" in r for r in routes["routes"])
    grpc = route_config("grpc", gateway, grpc=True)["virtual_hosts"][0]["routes"]
    infer = next(r for r in grpc if r["match"].get("path", "").endswith("/ModelInfer"))
    assert infer["metadata"]["filter_metadata"]["envoy.filters.http.lua"]["arms"] == "2:1000;3:1500"
    pinned = Gateway((Replica(9100, 9101),), release=1)  # a pin alone: the header from the routes, no arms
    assert route_config("http", pinned, grpc=False)["virtual_hosts"][0]["request_headers_to_add"]
    # a client's own ensemble-shadow header never reaches a replica: removed by the routes, or during an
    # experiment with a shadow share by the Lua filters, which then set their own
    for g in (pinned, gateway, Gateway((Replica(9100, 9101),))):
        for grpc in (False, True):
            assert route_config("grpc" if grpc else "http", g, grpc)["virtual_hosts"][0][
                "request_headers_to_remove"] == ["ensemble-shadow"]
    shadowed = Gateway((Replica(9100, 9101),), release=1, arms=((2, 10.0),), shadow=10.0)
    assert "request_headers_to_remove" not in route_config("http", shadowed, grpc=False)["virtual_hosts"][0]
    meta = route_config("grpc", shadowed, grpc=True)["virtual_hosts"][0]["routes"]
    infer = next(r for r in meta if r["match"].get("path", "").endswith("/ModelInfer"))
    assert infer["metadata"]["filter_metadata"]["envoy.filters.http.lua"]["shadow"] == "1000"
    assert infer["metadata"]["filter_metadata"]["envoy.filters.http.lua"]["candidates"] == "2"


def test_the_declared_experiment_outlives_a_restart_and_ends_with_a_deploy(tmp_path):
    folder = tmp_path / Model.RANKER.value
    for version in (1, 2, 3):
        (folder / str(version)).mkdir(parents=True)
    running = declared.Experiment(((2, 10.0), (3, 5.0)), "x-user", "2026-01-01T00:00:00Z")
    declared.write(tmp_path, 1, "experiment", None, running)
    assert declared.experiment(tmp_path) == running
    assert declared.versions(tmp_path) == [1, 2, 3]  # a restarted replica loads every arm
    (folder / "3").rmdir()
    assert declared.experiment(tmp_path) is None  # a candidate gone: no experiment to rejoin
    declared.write(tmp_path, 2, "deploy")
    assert declared.experiment(tmp_path) is None and declared.versions(tmp_path) == [2]
