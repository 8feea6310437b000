"""More requests than the ranker can score in time: what would miss its deadline is refused with a
retryable status, the accepted requests are scored correctly, the server keeps serving, and the
clients' retries carry every request through. The policy is the fused ranker's admission
(ensemble/serving/admission.py); a server started with a tight latency objective
(``ServerOptions.latency_objective_ms``, what ``ensemble serve --latency-objective-ms`` sets)
shows it at loads one machine can offer. No timing is asserted: the figures are printed (run with
-s) and measured by ``python -m loadtest.openloop``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from clients.triton import AsyncRankerClient, RankerClient, Retry, ScoringError, grpc_outputs
from ensemble import schema
from ensemble.repository.configs import LATENCY_OBJECTIVE_PARAMETER
from ensemble.serving.admission import BULK
from ensemble.schema import Priority
from ensemble.models.registry import Layout
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_port
from tests.helpers import fresh_rows, tree_thread_ticks, wait_until

# Requests of 4,096 rows (batch scoring's size), more at once than one model call takes.
ROWS = 4096
IN_FLIGHT = 16
REFUSAL = schema.OVERLOAD_REFUSAL
OBJECTIVE_MS = 20.0


@pytest.fixture(scope="module", params=[Layout.FUSED, Layout.NATIVE], ids=lambda layout: layout.value)
def tight_server(trained, tmp_path_factory, request):
    """A server whose ranker has a 20 ms latency objective, in the python backend and in the
    project's own (the same admission code runs in both)."""
    log = tmp_path_factory.mktemp(f"server-objective-{request.param.value}") / "tritonserver.log"
    server = TritonServer(ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), log_file=log, latency_objective_ms=OBJECTIVE_MS,
                                        layout=request.param))
    server.start()
    yield server
    alive = server.alive() and server.ready()
    tail = server.log_tail(80)
    server.stop()
    assert alive, f"server stopped serving:\n{tail}"


def test_the_objective_is_in_the_served_config(tight_server):
    with urllib.request.urlopen(f"http://{tight_server.http_url}/v2/models/{schema.Model.RANKER.value}/config") as reply:
        parameters = json.load(reply)["parameters"]
    assert float(parameters[LATENCY_OBJECTIVE_PARAMETER]["string_value"]) == OBJECTIVE_MS


async def _burst(url: str, dense, cats, retry: Retry):
    client = AsyncRankerClient(url, retry=retry, max_in_flight=IN_FLIGHT, priority=Priority.BATCH)

    async def one(k: int):
        rows = slice(k % 2 * ROWS, k % 2 * ROWS + ROWS)
        started = time.perf_counter()
        try:
            return k, await client.score(dense[rows], cats[rows]), time.perf_counter() - started
        except ScoringError as exc:
            return k, exc, time.perf_counter() - started

    try:
        return await asyncio.gather(*(one(k) for k in range(IN_FLIGHT)))
    finally:
        await client.close()


def test_a_burst_of_bulk_requests_is_scored_without_refusals(tight_server, pipeline):
    """Batch scoring marks its requests bulk: held to their own timeout, never to the objective
    (16 of them queue for seconds here, far past 20 ms), so none is refused."""
    dense, cats = fresh_rows(2 * ROWS, seed=61)
    dense, cats = dense[:2 * ROWS], cats[:2 * ROWS]
    expected = pipeline.score(dense, cats)["score"].ravel()
    results = asyncio.run(_burst(tight_server.http_url, dense, cats, Retry(attempts=1)))
    refused = [r for _, r, _ in results if isinstance(r, ScoringError)]
    print(f"\nburst of {IN_FLIGHT} {ROWS}-row requests: {len(refused)} refused; "
          f"latency max {max(t for *_, t in results):.2f} s")
    assert not refused, {str(r.cause)[:120] for r in refused}
    for k, scores, _ in results:
        np.testing.assert_allclose(scores, expected[k % 2 * ROWS:k % 2 * ROWS + ROWS], atol=1e-5)


def test_interactive_requests_beside_bulk_ones_are_answered_correctly(tight_server, pipeline):
    """Bulk and interactive requests in the same calls: the interactive answers go out first
    (through the response sender), the bulk ones after; every answer is the in-process score. Beside
    interactive traffic a bulk request that would end past its own scoring plus half the objective
    is refused (admission.py, "Bulk yields"): the bulk client retries, as batch scoring does."""
    dense, cats = fresh_rows(ROWS, seed=62)
    dense, cats = dense[:ROWS], cats[:ROWS]
    expected = pipeline.score(dense, cats)["score"].ravel()
    bulk = RankerClient(tight_server.http_url, retry=Retry(attempts=40, backoff=0.02, max_sleep=0.2),
                        priority=Priority.BATCH)
    answers: list[tuple[int, np.ndarray]] = []
    refusals: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def interactive(k: int) -> None:
        client = RankerClient(tight_server.http_url, retry=Retry(attempts=1))
        i = k
        while not stop.is_set():
            try:
                answers.append((i, client.score(dense[i:i + 1], cats[i:i + 1])))
            except ScoringError as exc:  # what queued behind a bulk call misses 20 ms: refused
                refused = str(getattr(exc.cause, "status", lambda: "")()) == "503" and REFUSAL in str(exc.cause)
                (refusals if refused else errors).append(str(exc))
            i = (i + 4) % ROWS

    threads = [threading.Thread(target=interactive, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            np.testing.assert_allclose(bulk.score(dense, cats), expected, atol=1e-5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    print(f"\n{len(answers)} interactive answers beside 3 bulk requests, {len(refusals)} refused")
    assert answers and not errors, errors[:3]
    for i, scores in answers:
        np.testing.assert_allclose(scores, expected[i:i + 1], atol=1e-5)


def test_a_bulk_flood_yields_to_interactive_requests(tight_server, pipeline):
    """Six clients send 4,096-row bulk requests with a 600 s timeout back to back (each refusal sent
    again at once); 1-row interactive requests sent beside them, one at a time without retries, are
    answered. Were bulk requests queued ahead of them and held to their timeout only, each
    interactive request would wait for the flood, past its 20 ms objective, and be refused. Both CPU
    layouts hand them to their bulk lane, a thread at nice 19 (backend.c; model.py in the fused
    layout), which scores them correctly behind the interactive requests."""
    dense, cats = fresh_rows(ROWS, seed=63)
    dense, cats = dense[:ROWS], cats[:ROWS]
    bulk_expected = pipeline.score(dense, cats)["score"].ravel()
    expected = bulk_expected[:50]
    stop = threading.Event()
    bulk_refusals: list[str] = []
    bulk_answers: list[bool] = []

    def flood() -> None:
        client = RankerClient(tight_server.http_url, retry=Retry(attempts=1), priority=Priority.BATCH, timeout=600.0)
        while not stop.is_set():
            try:
                scores = client.score(dense, cats)
                bulk_answers.append(bool(np.allclose(scores, bulk_expected, atol=1e-5)))
            except ScoringError as exc:
                bulk_refusals.append(str(exc.cause))
        client.close()

    before = tree_thread_ticks(tight_server.process.pid)
    threads = [threading.Thread(target=flood, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    answered, refused = 0, 0
    try:
        # the flood has arrived: the bulk lane (the server's nice-19 thread) is scoring it
        wait_until(lambda: _lane_busy(before, tree_thread_ticks(tight_server.process.pid)), 120,
                   lambda: f"the bulk lane scored nothing; {len(bulk_answers)} bulk answers, {bulk_refusals[:3]}")
        client = RankerClient(tight_server.http_url, retry=Retry(attempts=1))
        for i in range(50):
            try:
                np.testing.assert_allclose(client.score(dense[i:i + 1], cats[i:i + 1]), expected[i:i + 1], atol=1e-5)
                answered += 1
            except ScoringError as exc:
                assert REFUSAL in str(exc.cause), exc
                refused += 1
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    after = tree_thread_ticks(tight_server.process.pid)
    print(f"\nbeside a flood of 6 bulk clients: {answered} of 50 interactive answered, {refused} refused; "
          f"{len(bulk_answers)} bulk answers, {len(bulk_refusals)} bulk refusals")
    assert answered >= 40, (answered, refused)
    assert bulk_answers and all(bulk_answers), f"{bulk_answers.count(False)} of {len(bulk_answers)} bulk answers wrong"
    assert _lane_busy(before, after), after  # the lane scored bulk rows, at nice 19
    assert all(BULK in text or "bulk lane" in text for text in bulk_refusals), bulk_refusals[:3]
    if tight_server.options.layout is Layout.NATIVE:
        assert _lane_counts(tight_server).get("scored", 0) > 0, _lane_counts(tight_server)


def _lane_busy(before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> bool:
    """Whether a server thread at nice 19 (the bulk lane) used CPU between two
    :func:`tree_thread_ticks` of the server."""
    return any(nice == 19 and ticks > before.get(thread, (0, 0))[1] for thread, (nice, ticks) in now.items())


SENT_AT_ONCE = 128  # twice the lane's limit: more arrive than it drains meanwhile


def test_the_bulk_lane_holds_a_bounded_number_of_requests(tight_server, pipeline):
    """Beside interactive traffic, 128 bulk requests of 4,096 rows sent at once: the bulk lane holds at
    most 64 (LANE_REQUESTS, ensemble/serving/lane.py, which both lanes read); the rest are refused at once,
    retryably, naming the lane's limit, and every bulk request it took is answered with the right scores."""
    dense, cats = fresh_rows(ROWS, seed=67)
    dense, cats = dense[:ROWS], cats[:ROWS]
    expected = pipeline.score(dense, cats)["score"].ravel()
    stop, go, served = threading.Event(), threading.Barrier(SENT_AT_ONCE), threading.Event()
    outcomes: list[str] = []

    def interactive() -> None:
        client = RankerClient(tight_server.http_url, retry=Retry(attempts=1))
        while not stop.is_set():
            try:
                client.score(dense[:1], cats[:1])
                served.set()
            except ScoringError:
                pass
            time.sleep(0.01)
        client.close()

    def bulk() -> None:
        client = RankerClient(tight_server.http_url, retry=Retry(attempts=1), priority=Priority.BATCH, timeout=600.0)
        go.wait()
        try:
            scores = client.score(dense, cats)
            outcomes.append("right" if np.allclose(scores, expected, atol=1e-5) else "wrong")
        except ScoringError as exc:
            outcomes.append(str(exc.cause))
        client.close()

    beside = threading.Thread(target=interactive, daemon=True)
    beside.start()
    # The premise: interactive traffic is being served (an answer within the last moment) when the bulk
    # requests arrive; on a loaded machine the first interactive answers can take longer than the sleep.
    assert served.wait(60), "no interactive request was answered"
    served.clear()
    assert served.wait(60), "no interactive request was answered"
    senders = [threading.Thread(target=bulk, daemon=True) for _ in range(SENT_AT_ONCE)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(300)
    stop.set()
    beside.join(30)
    refusals = [o for o in outcomes if o not in ("right", "wrong")]
    print(f"\n{SENT_AT_ONCE} bulk requests at once beside interactive traffic: {outcomes.count('right')} answered, "
          f"{len(refusals)} refused ({sum('bulk lane' in o for o in refusals)} at the lane's limit)")
    assert len(outcomes) == SENT_AT_ONCE and "wrong" not in outcomes
    assert all(REFUSAL in o or BULK in o or "bulk lane" in o for o in refusals), refusals[:3]
    assert any("64 bulk requests already wait" in o for o in refusals), refusals[:3]
    assert outcomes.count("right") >= 64
    if tight_server.options.layout is Layout.NATIVE:  # the native lane's metrics
        counts = _lane_counts(tight_server)
        assert counts.get("refused_full", 0) >= sum("bulk lane" in o for o in refusals) > 0, counts


def test_bulk_requests_join_the_lane_while_it_holds_requests(tight_server, pipeline):
    """One interactive request, then 60 gRPC clients sending 4,096-row bulk requests back to back
    for 2.5 s: the first go to the lane (beside interactive traffic), and every later one joins the lane
    while it still holds requests, long after the last interactive request (1 s), so bulk requests
    are scored in arrival order and never on the model thread beside the lane. The native lane
    counts what it scored; the fused lane has no metrics."""
    import gc

    if tight_server.options.layout is not Layout.NATIVE:
        pytest.skip("the lane's outcomes are counted by the native backend's metrics only")
    dense, cats = fresh_rows(ROWS, seed=71)
    dense, cats = dense[:ROWS], cats[:ROWS]
    expected = pipeline.score(dense, cats)["score"].ravel()
    before = _lane_counts(tight_server).get("scored", 0.0)
    outcomes: list[str] = []
    go = threading.Barrier(61)

    def bulk(client, call) -> None:
        go.wait()
        while time.monotonic() < end:
            try:
                scores = grpc_outputs(client._grpc_infer(call), (schema.SCORE,))[schema.SCORE.name]
                outcomes.append("right" if np.allclose(scores, expected, atol=1e-5) else "wrong")
            except Exception as exc:  # noqa: BLE001 - any failure is an outcome the test reports
                outcomes.append(str(exc))
        client.close()

    # Each client's request is serialized once, before the start, and 60 of them keep up to 60 in the
    # server (the lane holds 64): the lane must not empty between requests, which would make a quiet
    # server whose bulk requests are rightly scored in the call. The collector is off while they run:
    # a full collection in this large process can stall every client at once.
    senders = []
    for _ in range(60):
        client = RankerClient(tight_server.grpc_url, "grpc", retry=Retry(attempts=1), priority=Priority.BATCH,
                              timeout=600.0)
        senders.append(threading.Thread(target=bulk, args=(client, client._grpc_ranker_call(dense, cats, False)),
                                        daemon=True))
        senders[-1].start()
    RankerClient(tight_server.http_url, retry=Retry(attempts=1)).score(dense[:1], cats[:1])
    end = time.monotonic() + 2.5
    gc.disable()
    try:
        go.wait()
        for t in senders:
            t.join(300)
    finally:
        gc.enable()
    scored = _lane_counts(tight_server).get("scored", 0.0) - before
    print(f"\n{len(outcomes)} bulk requests in 2.5 s after one interactive request: the lane scored {scored:.0f}")
    assert outcomes and set(outcomes) == {"right"}, outcomes[:3]
    assert scored == len(outcomes)


def _lane_counts(server) -> dict[str, float]:
    """The ranker's ensemble_bulk_lane_requests_total by outcome, summed over versions, from Triton's
    metrics endpoint."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ensemble_bulk_lane_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = counts.get(outcome, 0.0) + float(value)
    return counts


OVERLOAD_MULTIPLE = 3.0  # of the closed-loop capacity: clearly more than the server takes, even if
# the short capacity run underestimates it on a busy machine


def test_open_loop_overload_refuses_the_excess_retryably_and_keeps_serving(tight_server, pipeline):
    from ensemble.operate.supervise import Supervisor, SupervisorPolicy
    from loadtest.openloop import (UNSENT, closed_loop, open_loop, request_bodies, server_counters, server_view,
                                   summarize)

    server = tight_server
    # 96-row requests: the model (not the HTTP front end, which parses every request before any
    # policy can see it) is what runs out. Three times the native layout's capacity can be more
    # than one asyncio generator sends in time: what it could not send is left out below.
    bodies, arrays = request_bodies(rows=96, count=64, seed=71, timeout_s=1.0)
    expected = [pipeline.score(d, c)["score"].ravel() for d, c in arrays]
    lines: list[str] = []
    supervisor = Supervisor(server, SupervisorPolicy(probe_interval=0.5, probe_timeout=1.0), log=lines.append)
    stop = threading.Event()
    watching = threading.Thread(target=supervisor.run, args=(stop.is_set,), daemon=True)
    watching.start()
    try:
        capacity = asyncio.run(closed_loop(server.http_url, bodies, 8, 2.0))
        # A closed loop of 8 underestimates what batching absorbs: raise the offered load until
        # requests miss the objective (on a busy machine the first multiple already does).
        for multiple in (OVERLOAD_MULTIPLE, 2 * OVERLOAD_MULTIPLE, 4 * OVERLOAD_MULTIPLE):
            before = server_counters(server.http_url)
            outcomes = asyncio.run(open_loop(server.http_url, bodies, multiple * capacity, 3.0))
            view = server_view(before, server_counters(server.http_url))
            result = summarize(multiple * capacity, 3.0, outcomes)
            if result.refused:
                break
    finally:
        stop.set()
        watching.join(30)
    print(f"\ncapacity {capacity:.0f} req/s; offered {result.rate:.0f} req/s: {result.accepted} accepted "
          f"(p99 {result.accepted_p99_ms:.1f} ms), {result.refused} refused (p99 {result.refused_p99_ms:.1f} ms), "
          f"{result.errors} errors; generator late p99 {result.late_p99_ms:.1f} ms; {result.refusal_reasons}; "
          f"server view {view}; supervisor: {lines}")
    # on a failure: what the supervisor did and the server's own last words
    assert result.errors == 0, (result.error_samples, lines, server.log_tail(40))
    assert result.accepted and result.refused, result
    # refused = 503 from the ranker's admission: retryable, and it says why
    # (UNSENT: requests the generator itself could not send in time, never seen by the server)
    assert {o.status for o in outcomes if o.status not in (200, UNSENT)} == {503}
    assert all(REFUSAL in r for r in result.refusal_reasons), result.refusal_reasons
    # Triton's own statistics saw the same run: refusals come with calls of several requests
    assert view["requests_per_call"] > 1 and view["server_call_ms"] > 0 and view["server_queue_ms"] >= 0, view
    for k, outcome in enumerate(outcomes):
        if outcome.status == 200:
            scores = json.loads(outcome.body)["outputs"][0]["data"]
            np.testing.assert_allclose(scores, expected[k % len(bodies)], atol=1e-5)
    # overload is not a fault: the supervisor did not reload or restart the busy ranker
    assert supervisor.heals == 0 and not supervisor.restarts, lines
    assert server.ready() and supervisor.probe() is None


def test_grpc_refusals_are_unavailable_and_retried(tight_server):
    """128 interactive 1-row requests at once over gRPC: what would miss the 20 ms objective is
    refused UNAVAILABLE (retryable); with retries every request is scored."""
    from clients.triton import is_transient

    dense, cats = fresh_rows(128, seed=73)

    async def burst(retry: Retry):
        client = AsyncRankerClient(tight_server.grpc_url, "grpc", retry=retry, max_in_flight=128)
        try:
            async def one(k: int):
                try:
                    return await client.score(dense[k:k + 1], cats[k:k + 1])
                except ScoringError as exc:
                    return exc
            return await asyncio.gather(*(one(k) for k in range(128)))
        finally:
            await client.close()

    once = asyncio.run(burst(Retry(attempts=1)))
    refused = [r for r in once if isinstance(r, ScoringError)]
    print(f"\ngRPC burst of 128: {len(refused)} refused")
    for r in refused:
        assert str(r.cause.status()) == "StatusCode.UNAVAILABLE" and is_transient(r.cause), r
        assert REFUSAL in str(r.cause), r
    again = asyncio.run(burst(Retry(attempts=10, backoff=0.02, max_sleep=0.5)))
    assert not [r for r in again if isinstance(r, ScoringError)]
