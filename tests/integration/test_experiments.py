"""Candidates on live traffic: `ensemble experiment start|status|promote|abort` against two real
tritonservers (the native layout) behind a real Envoy gateway.

The fleet serves a private copy of the trained repository holding three releases and starts on the
oldest (declared). Each answer's `model_version` is the release that scored it; with a key, the arm
a request gets must be the one `arm_of` computes for its key here, on both protocols, before and
after a replica is killed and restarted.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import pytest

from benchmarks.fleet_release import _in_rotation, _tritonserver_pid, one_row_inputs
from ensemble import cli, schema
from ensemble.fleet.arms import arm_of
from ensemble.repository import declared
from ensemble.repository.export import TrainedArtifacts, export_repository
from tests.helpers import ReleaseFleet, fresh_rows, release_fleet, run_clients, wait_until

STARTUP_SECONDS = 420
KEY = "x-user"


@dataclass
class ExperimentFleet:
    served: ReleaseFleet
    releases: tuple[int, int, int]

    def __getattr__(self, name):  # the fleet's own: http, grpc, metrics, repository, record()
        return getattr(self.served, name)


@pytest.fixture(scope="module")
def fleet(trained, tmp_path_factory):
    with release_fleet(trained, tmp_path_factory.mktemp("experiments"), timeout=STARTUP_SECONDS) as served:
        third = int(export_repository(TrainedArtifacts.under(trained.workdir), served.repository,
                                      keep=3)[schema.Model.RANKER].name)
        yield ExperimentFleet(served, (served.first, served.new, third))


def _keyed_versions(fleet: ExperimentFleet, protocol: str, keys: list, via: str = "header",
                    binary: bool = True) -> list[int]:
    """The release that answered one 1-row request per key (None: a request without a key), sent with
    plain tritonclient through the gateway: the key in the KEY header, or (``via="parameter"``) in the
    request parameter KEY (an int key: an integer parameter), over HTTP's binary or JSON body."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(fleet.http if protocol == "http" else fleet.grpc)
    inputs = one_row_inputs(module, 3) if binary else one_row_inputs(module, 3, binary=False)
    versions = []
    try:
        for key in keys:
            where = {} if key is None else {"headers": {KEY: str(key)}} if via == "header" else \
                {"parameters": {KEY: key}}
            reply = client.infer(schema.Model.RANKER.value, inputs, **where)
            response = reply.get_response()
            versions.append(int(response["model_version"] if protocol == "http" else response.model_version))
    finally:
        client.close()
    return versions


def _ranking_requests_are_counted_per_arm(fleet: ExperimentFleet, arms, keys: list[str]) -> None:
    """Ranking requests keyed by a parameter (plain tritonclient, the rank model) are scored by their
    arm's release and counted per release: ensemble_arm_requests_total{model="rank", release} and the
    scores they answered, ensemble_arm_score_count, over the replicas."""
    import tritonclient.http as httpclient

    first = fleet.releases[0]
    rank = schema.RANK_MODEL
    dense, cats = fresh_rows(5, seed=47)
    inputs = [httpclient.InferInput(schema.CANDIDATE_DENSE.name, list(dense.shape), "FP32"),
              httpclient.InferInput(schema.CANDIDATE_CATEGORICAL.name, list(cats.shape), "BYTES")]
    inputs[0].set_data_from_numpy(dense.astype(np.float32))
    inputs[1].set_data_from_numpy(cats.astype(object))

    def counts() -> dict:
        return {r: (_metric(fleet, "ensemble_arm_requests_total", model=rank, release=str(r), outcome="answered"),
                    _metric(fleet, "ensemble_arm_score_count", model=rank, release=str(r))) for r in fleet.releases}

    before = counts()
    client = httpclient.InferenceServerClient(fleet.http)
    try:
        for key in keys:
            client.infer(rank, inputs, parameters={KEY: key})
    finally:
        client.close()
    expected = {r: sum(arm_of(k, first, arms) == r for k in keys) for r in fleet.releases}
    assert all(expected.values()), expected  # every arm among the keys
    deadline = time.monotonic() + 5  # counted just after each answer
    while True:
        got = {r: (a - before[r][0], n - before[r][1]) for r, (a, n) in counts().items()}
        if got == {r: (c, c * len(dense)) for r, c in expected.items()} or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == {r: (c, c * len(dense)) for r, c in expected.items()}, (got, expected)
    from ensemble.operate.monitoring import EXPERIMENT_METRIC_PREFIXES, dashboard_metric_names

    panels = {n for n in dashboard_metric_names() if n.startswith(EXPERIMENT_METRIC_PREFIXES[1])}
    assert len(panels) >= 5 and all(_metric(fleet, n, series=True, model=rank) > 0 for n in panels), panels


def _a_key_of_another_kind_is_refused(fleet: ExperimentFleet, arms) -> None:
    """A key parameter that is neither a string nor an unsigned integer below 2^53 is refused at the
    gateway with the client's error, on both protocols; the header, when present, wins."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    for module, address in ((httpclient, fleet.http), (grpcclient, fleet.grpc)):
        client = module.InferenceServerClient(address)
        inputs = one_row_inputs(module, 3)
        try:
            for bad in (1.5, True, -3, 2**53):
                with pytest.raises(InferenceServerException) as refused:
                    client.infer(schema.Model.RANKER.value, inputs, parameters={KEY: bad})
                assert "arm key parameter" in str(refused.value)
                assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), refused.value.status()
            header_wins = client.infer(schema.Model.RANKER.value, inputs, headers={KEY: "user-7"},
                                       parameters={KEY: 1.5}).get_response()
            version = header_wins["model_version"] if module is httpclient else header_wins.model_version
            assert int(version) == arm_of("user-7", fleet.releases[0], arms)
        finally:
            client.close()
    # odd JSON around the key: answered with a client error (the gateway's or Triton's), never a crash
    import urllib.error
    import urllib.request

    head = '{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], '
    odd = [head + '"parameters": {"x-user": {"id": 1}}}', head + '"parameters": {"x-user": "unterminated}}',
           head + '"parameters": "x-user"}', head + '"parameters": {"x-user": [1, 2]}}', '{"parameters": {"x-user": 1e3}}',
           head + '"parameters": {"x-user": "' + "\\u00e9" * 20000 + '"}}', '"parameters"', "{" * 60 + '"parameters"']
    for body in odd:
        request = urllib.request.Request(f"http://{fleet.http}/v2/models/{schema.Model.RANKER.value}/infer",
                                         data=body.encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                status, text = reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read()
        assert 400 <= status < 500, (status, body[-40:], text)
    assert len(_keyed_versions(fleet, "http", ["user-1"], via="parameter")) == 1


def _kill_and_rejoin(fleet: ExperimentFleet, index: int, versions: list[int]) -> None:
    """Kill replica ``index``'s tritonserver; it must come back holding ``versions`` and be back in
    the gateway's rotation."""
    record = fleet.record()
    replica = record.gateway.replicas[index]
    killed = _tritonserver_pid(replica.http_port)
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: _tritonserver_pid(replica.http_port) != killed, 30,  # dead: it answers no question below
               lambda: "\n".join(fleet.output[-20:]))
    assert _wait_versions(record.replicas()[index], versions) == versions
    # back in the gateway's rotation (its health checks pass again), so what follows reaches this replica
    assert _in_rotation(record.admin_url, replica, time.monotonic(), timeout=60) is not None, \
        "\n".join(fleet.output[-20:])


def _wait_versions(control, versions: list[int], timeout: float = 180.0) -> list[int]:
    deadline, ready = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            ready = control.ready_versions()
            if ready == versions:
                return ready
        except Exception:  # noqa: BLE001 - restarting
            pass
        time.sleep(0.5)
    return ready


def test_keyed_arms_are_sticky_across_protocols_and_restarts_then_abort_under_load(fleet):
    first, second, third = fleet.releases
    arms = ((second, 20.0), (third, 10.0))
    assert cli.main(["experiment", "start", "--url", fleet.http, "--candidate", str(second), "--share", "20",
                     "--candidate", str(third), "--share", "10", "--key", KEY]) == 0
    record = fleet.record()
    assert record.gateway.arms == arms and record.gateway.arm_key == KEY and record.gateway.release == first
    assert all(c.ready_versions() == [first, second, third] for c in record.replicas())
    running = declared.experiment(fleet.repository)
    assert running is not None and running.arms == arms and running.key == KEY

    keys = [f"user-{i}" for i in range(300)]
    expected = [arm_of(k, first, arms) for k in keys]
    assert {second, third, first} == set(expected)  # every arm drawn among the keys
    for protocol in ("http", "grpc"):  # the gateway's Lua and arm_of agree on every key, twice over
        assert _keyed_versions(fleet, protocol, keys) == expected
        assert _keyed_versions(fleet, protocol, keys[::-1]) == expected[::-1]
        # the same keys as a request parameter get the same arms; integer ids hash as their digits
        assert _keyed_versions(fleet, protocol, keys, via="parameter") == expected
        numbers = list(range(10**12, 10**12 + 100))
        assert _keyed_versions(fleet, protocol, numbers, via="parameter") == [arm_of(str(n), first, arms)
                                                                              for n in numbers]
    odd = ["é-ü", "😀 user", 'quo"te\\slash', ""]  # JSON escapes, decoded at the gateway
    for binary in (True, False):
        assert _keyed_versions(fleet, "http", odd, via="parameter", binary=binary) == [arm_of(k, first, arms)
                                                                                       for k in odd]
    assert _keyed_versions(fleet, "grpc", odd, via="parameter") == [arm_of(k, first, arms) for k in odd]
    _a_key_of_another_kind_is_refused(fleet, arms)
    _ranking_requests_are_counted_per_arm(fleet, arms, keys[:40])

    # without the header: each request drawn at random, in the set shares
    unkeyed = _keyed_versions(fleet, "http", [None] * 600)
    shares = {r: unkeyed.count(r) / len(unkeyed) * 100 for r in (first, second, third)}
    print(f"\n600 unkeyed requests: {shares}")
    assert abs(shares[second] - 20) < 7 and abs(shares[third] - 10) < 6 and abs(shares[first] - 70) < 8

    # a ranking request through the gateway during the experiment is answered
    from clients.triton import RankerClient, Retry

    dense, cats = fresh_rows(12, seed=45)
    ranking = RankerClient(fleet.http, "http", retry=Retry(attempts=1), timeout=30.0).rank(None, (dense, cats))
    assert sorted(ranking.order) == list(range(len(dense)))

    assert cli.main(["experiment", "status", "--url", fleet.http]) == 0
    assert cli.main(["deploy", "--url", fleet.http]) == 1  # refused while the experiment runs

    def kill_then_abort() -> None:
        """Under the clients' load: a replica killed mid-experiment comes back holding every arm, keys
        keep their arms, then the abort."""
        _kill_and_rejoin(fleet, 0, [first, second, third])
        assert _keyed_versions(fleet, "grpc", keys) == expected
        assert cli.main(["experiment", "abort", "--url", fleet.http]) == 0, "abort failed"

    clients, aborted = run_clients(fleet.served, kill_then_abort)
    for client in clients:
        assert not client.errors, client.errors[:3]
        after = [v for t, v in client.answers if t > aborted]
        assert after and set(after) == {first}, after[:10]
    record = fleet.record()
    assert record.gateway.arms == () and record.release == first
    assert all(c.ready_versions() == [first] for c in record.replicas())
    assert declared.experiment(fleet.repository) is None and declared.versions(fleet.repository) == [first]


def test_promote_under_load_switches_every_replica_to_the_candidate(fleet):
    first, second, _ = fleet.releases
    assert declared.experiment(fleet.repository) is None
    assert cli.main(["experiment", "start", "--url", fleet.http, "--candidate", str(second), "--share", "50"]) == 0
    seen = _keyed_versions(fleet, "http", [None] * 200)
    assert set(seen) == {first, second}
    assert cli.main(["experiment", "start", "--url", fleet.http, "--candidate", str(second), "--share", "5"]) == 1

    def kill_then_promote() -> None:
        """Under the clients' load: the other replica killed mid-experiment comes back holding both
        arms, then the promote."""
        _kill_and_rejoin(fleet, 1, [first, second])
        assert cli.main(["experiment", "promote", "--url", fleet.http]) == 0, "promote failed"

    clients, promoted = run_clients(fleet.served, kill_then_promote)
    for client in clients:
        assert not client.errors, client.errors[:3]
        after = [v for t, v in client.answers if t > promoted]
        assert after and set(after) == {second}, after[:10]
    record = fleet.record()
    assert record.release == second and record.gateway.release is None and record.gateway.arms == ()
    assert all(c.ready_versions() == [second] for c in record.replicas())
    assert declared.read(fleet.repository) == second and declared.experiment(fleet.repository) is None
    assert set(_keyed_versions(fleet, "grpc", [None] * 20)) == {second}
    assert cli.main(["experiment", "abort", "--url", fleet.http]) == 1  # nothing runs any more


def _metric(fleet: ExperimentFleet, name: str, series: bool = False, **labels: str) -> float:
    """``name`` summed over the replicas' metrics endpoints and every series carrying ``labels`` (with
    ``series``: how many such series there are)."""
    import urllib.request

    total = 0.0
    for i in range(2):
        with urllib.request.urlopen(f"http://127.0.0.1:{fleet.metrics + i}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += 1.0 if series else float(line.rsplit(" ", 1)[1])
    return total


def test_shadow_scoring_records_the_candidates_score_differences(fleet):
    """Every request the serving release answers is shadowed (--shadow 100): the candidate scores it
    too after the answer, and the replicas' histograms count one difference per row, whose sum is
    the offline difference of the two releases on those rows (0 here: both releases were exported
    from the same trained models, so their scores are equal); ranking requests report a top-k
    overlap of 1. The answers are the serving release's."""
    serving, candidate = fleet.record().release, fleet.releases[2]
    labels = {"model": schema.Model.RANKER.value, "version": str(serving), "candidate": str(candidate)}
    before = _metric(fleet, "ensemble_shadow_score_difference_count", **labels)
    assert cli.main(["experiment", "start", "--url", fleet.http, "--candidate", str(candidate), "--share", "10",
                     "--shadow", "100"]) == 0
    versions = _keyed_versions(fleet, "http", [None] * 150) + _keyed_versions(fleet, "grpc", [None] * 150)
    answered = versions.count(serving)
    assert 0 < answered < len(versions) and set(versions) == {serving, candidate}

    from clients.triton import RankerClient, Retry

    dense, cats = fresh_rows(40, seed=46)
    ranker = RankerClient(fleet.http, "http", retry=Retry(attempts=1), timeout=30.0)
    for _ in range(6):
        order = ranker.rank(None, (dense, cats), k=10).order
        assert len(order) == 10 and len(set(order.tolist())) == 10
    deadline = time.monotonic() + 30  # the shadow work runs after each answer
    while time.monotonic() < deadline and \
            _metric(fleet, "ensemble_shadow_score_difference_count", **labels) - before < answered:
        time.sleep(0.2)
    shadowed = _metric(fleet, "ensemble_shadow_score_difference_count", **labels) - before
    outcomes = {o: _metric(fleet, "ensemble_shadow_requests_total", outcome=o, **labels)
                for o in ("scored", "missing", "failed")}
    print(f"\n{answered} of {len(versions)} requests answered by the serving release; {shadowed:.0f} rows shadowed; "
          f"shadowed requests by outcome {outcomes}")
    assert shadowed == answered
    assert _metric(fleet, "ensemble_shadow_score_difference_sum", **labels) <= 1e-6 * shadowed
    assert _metric(fleet, "ensemble_shadow_requests_total", outcome="scored", **labels) >= answered
    assert _metric(fleet, "ensemble_shadow_requests_total", outcome="missing", **labels) == 0
    rank = {"model": schema.RANK_MODEL, "candidate": str(candidate)}
    overlaps = _metric(fleet, "ensemble_shadow_top_k_overlap_count", **rank)
    assert overlaps >= 1 and _metric(fleet, "ensemble_shadow_top_k_overlap_sum", **rank) == overlaps
    # what the dashboard's shadow panels read is there, per candidate
    from ensemble.operate.monitoring import EXPERIMENT_METRIC_PREFIXES, dashboard_metric_names

    panels = {n for n in dashboard_metric_names() if n.startswith(EXPERIMENT_METRIC_PREFIXES[0])}
    assert len(panels) >= 5, panels
    counts = {n: _metric(fleet, n, candidate=str(candidate)) for n in panels if not n.endswith("_sum")}
    assert all(v > 0 for v in counts.values()), counts  # the sums: 0 here, the releases score alike
    assert all(_metric(fleet, n, candidate=str(candidate), series=True) > 0 for n in panels), panels
    # each arm's served scores: the rows each version answered, from the replicas' own counts
    for version in (serving, candidate):
        rows = _metric(fleet, "ensemble_served_score_count", model=schema.Model.RANKER.value, version=str(version))
        everything = _metric(fleet, "ensemble_served_score_bucket", model=schema.Model.RANKER.value,
                             version=str(version), le="+Inf")
        assert rows >= versions.count(version) and everything == rows, (version, rows, everything)
    assert cli.main(["experiment", "abort", "--url", fleet.http]) == 0

    # a client cannot ask for shadow scoring: the gateway removes the header (both protocols)
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    counted = sum(_metric(fleet, "ensemble_shadow_requests_total", outcome=o) for o in ("scored", "missing", "failed"))
    for module, address in ((httpclient, fleet.http), (grpcclient, fleet.grpc)):
        client = module.InferenceServerClient(address)
        for _ in range(20):
            client.infer(schema.Model.RANKER.value, one_row_inputs(module, 5), headers={"ensemble-shadow": str(candidate)})
        client.close()
    time.sleep(1.0)
    assert sum(_metric(fleet, "ensemble_shadow_requests_total", outcome=o)
               for o in ("scored", "missing", "failed")) == counted
