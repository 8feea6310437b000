"""One release across a fleet: `ensemble deploy --url GATEWAY` and `rollback` against two real
tritonservers (the native layout) behind a real Envoy gateway, with plain clients (no retries)
sending requests throughout.

The fleet serves a private copy of the trained repository holding two releases; it starts on the
older one (declared). Each answer's `model_version` is recorded per client: once a client has been
answered by the new release it must never be answered by the old one again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from benchmarks.fleet_release import Client, _tritonserver_pid
from ensemble import cli, schema
from ensemble.fleet import release as fleet_release
from ensemble.fleet.gateway import Replica
from ensemble.fleet.envoy_config import routes_version
from ensemble.repository import declared
from ensemble.operate.deploy import DeployError
from ensemble.base.machine import free_port
from tests.helpers import ReleaseFleet, fresh_rows, release_fleet, run_clients

STARTUP_SECONDS = 420


@pytest.fixture(scope="module")
def fleet(trained, tmp_path_factory):
    with release_fleet(trained, tmp_path_factory.mktemp("fleet-release"), timeout=STARTUP_SECONDS) as served:
        yield served


def _versions_seen(clients: list[Client]) -> list[list[int | None]]:
    return [[v for _, v in c.answers] for c in clients]


def _ranks_through_gateway(fleet: ReleaseFleet, protocol: str) -> bool:
    """One ranking request through the gateway orders every candidate."""
    from clients.triton import RankerClient, Retry

    dense, cats = fresh_rows(12, seed=44)
    address = fleet.http if protocol == "http" else fleet.grpc
    ranking = RankerClient(address, protocol, retry=Retry(attempts=1), timeout=30.0).rank(None, (dense, cats))
    return sorted(ranking.order) == list(range(len(dense)))


def test_deploy_and_rollback_through_the_gateway_switch_every_replica_at_once(fleet):
    record = fleet.record()
    assert record.release == fleet.first and record.gateway.release is None  # pinned only during a release
    assert all(c.ready_versions() == [fleet.first] for c in record.replicas())
    assert _ranks_through_gateway(fleet, "http") and _ranks_through_gateway(fleet, "grpc")

    clients, _ = run_clients(fleet, lambda: cli.main(["deploy", "--url", fleet.http]) == 0 or pytest.fail("deploy failed"))
    record = fleet.record()
    assert record.release == fleet.new and record.gateway.release is None
    assert all(c.ready_versions() == [fleet.new] for c in record.replicas())  # the old release retired
    assert declared.read(fleet.repository) == fleet.new and declared.versions(fleet.repository) == [fleet.new]
    assert set(fleet_release.applied_routes(record.admin_url).values()) == {routes_version(None)}
    for client in clients:
        assert not client.errors, client.errors[:3]
        assert client.backwards() == 0, _versions_seen(clients)
        assert client.answers[-1][1] == fleet.new
    assert _ranks_through_gateway(fleet, "http") and _ranks_through_gateway(fleet, "grpc")

    clients, _ = run_clients(fleet, lambda: cli.main(["rollback", "--url", fleet.http]) == 0 or pytest.fail("rollback"))
    record = fleet.record()
    assert record.release == fleet.first
    assert all(c.ready_versions() == [fleet.first] for c in record.replicas())
    for client in clients:
        assert not client.errors, client.errors[:3]
        seen = [v for _, v in client.answers if v is not None]
        # a rollback goes down once: every answer after the first from the old release is from it
        assert seen[-1] == fleet.first and fleet.new not in seen[seen.index(fleet.first):], seen


def test_a_replica_that_cannot_load_the_release_aborts_it_and_nothing_changes(fleet):
    record = fleet.record()
    serving = record.release
    target = fleet.new if serving != fleet.new else fleet.first
    dead = replace(record.gateway, replicas=record.gateway.replicas + (Replica(free_port(), free_port()),))
    with pytest.raises(DeployError, match="replica 2") as refused:
        fleet_release.switch(replace(record, gateway=dead), target, log=lambda _: None, compare_auc=False)
    # the unreachable replica could not be told to drop the new release either: every request stays
    # pinned to the serving release until a release succeeds
    assert f"the gateway keeps every request on {serving}" in str(refused.value)
    record = fleet.record()
    assert record.release == serving and record.gateway.release == serving
    assert set(fleet_release.applied_routes(record.admin_url).values()) == {routes_version(serving)}
    assert all(c.ready_versions() == [serving] for c in record.replicas())
    assert declared.read(fleet.repository) == serving and declared.versions(fleet.repository) == [serving]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_ranking_request_is_scored_by_the_release_its_header_names(fleet, protocol):
    """The gateway's ``ensemble-release`` header reaches the rank model (tritonserver forwards it as
    a request parameter): sent straight to a replica, a loaded release ranks, another is refused."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    record = fleet.record()
    replica = record.gateway.replicas[0]
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(f"{replica.host}:{replica.http_port if protocol == 'http' else replica.grpc_port}")
    dense, cats = fresh_rows(6, seed=45)
    inputs = [module.InferInput(schema.CANDIDATE_DENSE.name, list(dense.shape), "FP32"),
              module.InferInput(schema.CANDIDATE_CATEGORICAL.name, list(cats.shape), "BYTES")]
    inputs[0].set_data_from_numpy(dense.astype(np.float32))
    inputs[1].set_data_from_numpy(cats.astype(object))
    ranked = client.infer(schema.RANK_MODEL, inputs, headers={"ensemble-release": str(record.release)})
    assert sorted(ranked.as_numpy(schema.ORDER.name).reshape(-1)) == list(range(len(dense)))
    with pytest.raises(InferenceServerException, match="release 999 of the ranker is not loaded"):
        client.infer(schema.RANK_MODEL, inputs, headers={"ensemble-release": "999"})
    client.close()


def test_a_replica_killed_after_a_release_comes_back_serving_it(fleet):
    assert cli.main(["deploy", "--url", fleet.http, "--release", str(fleet.new)]) == 0
    record = fleet.record()
    assert record.release == fleet.new and record.gateway.release is None  # a release that succeeds lifts any pin
    replica = record.gateway.replicas[0]
    os.kill(_tritonserver_pid(replica.http_port), signal.SIGKILL)
    control = record.replicas()[0]
    deadline = time.monotonic() + 120
    versions: list[int] | str = "no answer"
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            versions = control.ready_versions()
        except Exception as exc:  # noqa: BLE001 - restarting: no answer yet
            versions = str(exc)
            continue
        if versions:
            break
    assert versions == [fleet.new], "\n".join(fleet.output[-20:])
