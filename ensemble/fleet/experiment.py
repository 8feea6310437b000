"""Candidates on live traffic behind a gateway: ``ensemble experiment start|status|promote|abort``.

An experiment runs on a gateway's replicas (a fleet of ``ensemble serve --replicas N``, or one
server exposed through its door, ``--host``): the serving release S keeps the requests no candidate
takes, and each candidate C takes its share P of the inference requests (A/B/N: several candidates,
each with its share). The gateway chooses a request's arm (:func:`ensemble.fleet.arms.arm_of`):
with a key (``--key NAME``: the request header NAME or, in a request without that header, the
request parameter NAME, such as a user id) the arm is a hash of its value, the same on every
gateway, replica and restart; without one (or for a request with neither) it is a hash of Envoy's
random request id. Each answer's ``model_version`` names the release
that scored it, and Triton's per-version statistics and metrics are the arms' requests, latency and
refusals.

``start`` (from S serving alone):

1. Each candidate passes the checks a deploy runs (:func:`ensemble.operate.deploy.check_release`:
   manifests, it loads, finite scores, AUC).
2. The gateway pins every request to S; every replica loads the candidates beside S and must
   report them ready and score fresh rows on each exactly as this process does (<= 1e-5). A
   replica that fails aborts the start: every replica goes back to S alone and nothing was routed
   to a candidate.
3. The experiment is declared (:mod:`ensemble.repository.declared`: a replica that restarts loads the
   candidates, a fleet that restarts routes to them again), then the gateway's routes are replaced
   in one step by the experiment's.

``abort`` routes every new request to S in one step, then unloads the candidates; ``promote C``
routes every new request to C in one step, declares C, then unloads the others. Requests already
routed finish on the release they were routed to; no request is routed to a candidate after an
abort, or to S after a promote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ensemble import schema
from ensemble.fleet.gateway import GatewayError
from ensemble.fleet.arms import check_arms
from ensemble.fleet.release import (RETIRE_AFTER, FleetRecord, _declare, _each, _lock, _route, load_and_check,
                                    parity_checks)
from ensemble.repository import declared
from ensemble.operate.control import ControlError
from ensemble.operate.deploy import DeployError, check_release


def _serving(fleet: FleetRecord) -> int:
    if fleet.release is None:
        raise DeployError(f"the fleet at port {fleet.gateway.http_port} runs the {fleet.layout} layout, whose ranker "
                          "is not one model version per release: experiments need the native or fused layout")
    return fleet.release


def start(fleet: FleetRecord, arms: list[tuple[int, float]], key: str | None = None, holdout=None,
          log=print, shadow: float = 0.0) -> declared.Experiment:
    """Start an experiment of ``arms`` (``(candidate release, percent)``) beside the serving
    release (the module docstring's steps); returns it.

    Raises:
        DeployError: a check failed or an experiment already runs (nothing changed; the message says why).
    """
    serving = _serving(fleet)
    arms = [(int(r), float(p)) for r, p in arms]
    try:
        check_arms(serving, tuple(arms), key, shadow)
    except GatewayError as exc:
        raise DeployError(str(exc)) from None
    if shadow:
        _check_shadow(fleet, serving)
    with _lock(fleet):
        running = declared.experiment(fleet.repository)
        if running is not None:
            raise DeployError(f"an experiment already runs (candidates {[r for r, _ in running.arms]}): "
                              "promote or abort it first")
        pipelines = {r: check_release(fleet.repository, r, serving, holdout, log, True) for r, _ in arms}
        every = sorted({serving, *pipelines})
        controls = fleet.replicas()
        fleet = _route(fleet, serving)
        _declare(fleet.repository, serving, "experiment", every, log)
        log(f"loading candidate(s) {sorted(pipelines)} beside release {serving} on {len(controls)} replica(s)")
        checks = parity_checks(pipelines)
        problems = _each(controls, lambda i, control: load_and_check(control, every, checks))
        if problems:
            back = _each(controls, lambda i, c: c.load_release(serving))
            _declare(fleet.repository, serving, "experiment", None, log)
            if not back:
                _route(fleet, None)
            raise DeployError("experiment refused: " + "; ".join(problems) + f". Release {serving} serves every "
                              "request, as before")
        experiment = declared.Experiment(tuple(arms), key, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), shadow)
        declared.write(fleet.repository, serving, "experiment", every, experiment)
        try:
            _route(fleet, serving, arms=tuple(arms), key=key, shadow=shadow)
        except (DeployError, OSError) as exc:
            _route(fleet, serving)
            _each(controls, lambda i, c: c.load_release(serving))
            _declare(fleet.repository, serving, "experiment", None, log)
            raise DeployError(f"the gateway did not take the experiment's routes ({exc}); release {serving} serves "
                              "every request") from exc
        log("experiment under way: " + ", ".join(f"release {r} takes {p:g}%" for r, p in arms)
            + f", release {serving} the rest; arms chosen by " + (f"the '{key}' header or parameter" if key else "request")
            + (f"; {shadow:g}% of release {serving}'s requests shadowed" if shadow else ""))
        return experiment


def _check_shadow(fleet: FleetRecord, serving: int) -> None:
    """Shadow scoring is the native backend's: refused, naming why, on another layout or when the
    serving release's own copy of the backend was built before it (its requests would go unshadowed)."""
    from ensemble.models.registry import Layout
    from ensemble.native.backend import FILE_NAME, capabilities

    if fleet.layout != Layout.NATIVE.value:
        raise DeployError(f"shadow scoring needs the native layout; this fleet runs {fleet.layout}")
    library = Path(fleet.repository) / schema.Model.RANKER.value / str(serving) / FILE_NAME
    try:
        built_with = "shadow" in capabilities(library).features
    except OSError:
        built_with = False
    if not built_with:
        raise DeployError(f"release {serving}'s backend ({library}) was built before shadow scoring: export the "
                          "serving release again, or start without --shadow")


def _end(fleet: FleetRecord, winner: int, by: str, log) -> int:
    """Route every new request to ``winner`` in one step, declare it, unload the others."""
    serving = _serving(fleet)
    with _lock(fleet):
        running = declared.experiment(fleet.repository)
        if running is None:
            raise DeployError("no experiment runs on this fleet")
        every = sorted({serving, *(r for r, _ in running.arms)})
        if winner not in every:
            raise DeployError(f"release {winner} is not in the experiment (releases {every})")
        fleet = _route(fleet, winner, winner)
        _declare(fleet.repository, winner, by, every, log)
        log(f"the gateway routes every request to release {winner}; unloading the others in {RETIRE_AFTER:g}s")
        time.sleep(RETIRE_AFTER)
        left = _each(fleet.replicas(), lambda i, c: c.load_release(winner))
        _declare(fleet.repository, winner, by, None, log)
        if left:
            log("other releases stay loaded on: " + "; ".join(left) + f" (the gateway keeps every request on "
                f"{winner}; they go at that replica's next restart)")
        else:
            _route(fleet, None)
        return winner


def abort(fleet: FleetRecord, log=print) -> int:
    """End the experiment: every new request to the serving release; the candidates unloaded."""
    return _end(fleet, _serving(fleet), "experiment abort", log)


def promote(fleet: FleetRecord, candidate: int | None = None, log=print) -> int:
    """End the experiment with ``candidate`` (may be omitted with one candidate) serving every request."""
    running = declared.experiment(fleet.repository)
    if running is None:
        raise DeployError("no experiment runs on this fleet")
    candidates = [r for r, _ in running.arms]
    if candidate is None:
        if len(candidates) != 1:
            raise DeployError(f"the experiment has candidates {candidates}: name the one to promote (--candidate)")
        candidate = candidates[0]
    if candidate not in candidates:
        raise DeployError(f"release {candidate} is not a candidate of the experiment ({candidates})")
    return _end(fleet, candidate, "experiment promote", log)


@dataclass(frozen=True)
class ArmStatistics:
    """One arm, summed over the replicas: Triton's statistics of that ranker version."""

    release: int
    share: float  # percent of requests routed to it
    requests: int  # answered
    failures: int  # refused or failed
    mean_ms: float  # request time, mean over the answered ones (nan: none)


def status(fleet: FleetRecord) -> tuple[declared.Experiment | None, list[ArmStatistics]]:
    """The declared experiment (None: none runs) and every arm's statistics so far."""
    running = declared.experiment(fleet.repository)
    serving = _serving(fleet)
    if running is None:
        return None, []
    shares = {serving: 100.0 - sum(p for _, p in running.arms), **dict(running.arms)}
    totals = {r: [0, 0, 0] for r in shares}
    for control in fleet.replicas():
        for release in shares:
            try:
                stats = control.version_statistics(release)
            except (ControlError, ValueError):
                continue
            success, fail = stats.get("success", {}), stats.get("fail", {})
            totals[release][0] += int(success.get("count", 0))
            totals[release][1] += int(fail.get("count", 0))
            totals[release][2] += int(success.get("ns", 0))
    return running, [ArmStatistics(r, shares[r], n, f, ns / n / 1e6 if n else float("nan"))
                     for r, (n, f, ns) in sorted(totals.items())]

