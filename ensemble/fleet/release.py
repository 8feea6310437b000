"""One release across a fleet: ``ensemble deploy --url GATEWAY`` and ``ensemble rollback --url GATEWAY``.

A fleet started by ``ensemble serve --replicas N`` records where it is (:func:`record`, a file named
after the gateway's HTTP port in :func:`run_dir`), so a deploy given the gateway's address finds the
replicas' own ports and the gateway's route files. The switch, from release S to R:

1. The release passes the checks a single server's deploy runs (:func:`ensemble.operate.deploy.
   check_release`: manifests, it loads, finite scores, AUC), once, in this process.
2. The gateway pins every request to S (between releases it names no version: each replica holds
   one release), and the repository declares both S and R (:mod:`ensemble.repository.declared`): a
   replica that starts or restarts from now on loads both.
3. Every replica loads R beside S (the gateway still sends every request to S), and each must
   report both versions ready and score fresh rows on R exactly as this process does (<= 1e-5).
   A replica that fails aborts the release: every replica goes back to S alone, S stays declared,
   the gateway's pin is lifted, and no request was routed to R.
4. The gateway's routes are replaced in one step: every request it takes from then on goes to R
   (Envoy reads the new routes file whole; :func:`ensemble.fleet.envoy_config.write_routes`). A client
   that has seen an answer from R can only get answers from R after it.
5. R is declared; after :data:`RETIRE_AFTER` seconds (requests already routed to S finish) every
   replica unloads S, and then the pin is lifted.

Every answer's ``model_version`` is the release that scored it: a replica's ranker versions are
releases, and while a replica holds two, the gateway names the version in each request it forwards.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ensemble.fleet.gateway import Gateway, Replica
from ensemble.fleet.envoy_config import routes_version, write_routes
from ensemble.repository import declared
from ensemble.operate.control import Control, ControlError
from ensemble.operate.records import run_dir
from ensemble.features.fresh import fresh_rows
from ensemble.operate.deploy import PARITY_ATOL, DeployError, available_releases, check_release

RETIRE_AFTER = 2.0  # seconds between the switch and unloading the old release
APPLY_TIMEOUT = 10.0  # seconds the gateway has to report the new routes


def record_path(http_port: int) -> Path:
    return run_dir() / f"fleet-{http_port}.json"


@dataclass(frozen=True)
class FleetRecord:
    """What a deploy needs to know about a running fleet (the file :func:`record` writes)."""

    gateway: Gateway
    repository: str
    layout: str
    pid: int
    release: int | None  # what the fleet serves (None: a layout without releases)

    def replicas(self) -> list[Control]:
        return [Control.of(f"{r.host}:{r.http_port}", grpc=f"{r.host}:{r.grpc_port}") for r in self.gateway.replicas]

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.admin_port}"


def record(gateway: Gateway, repository: str | Path, layout: str, release: int | None) -> Path:
    """Write (atomically) the record of the fleet this process runs, serving ``release``; returns its path."""
    path = record_path(gateway.http_port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({
        "pid": os.getpid(), "repository": str(Path(repository).resolve()), "layout": layout,
        "release": release,
        "gateway": {"host": gateway.host, "http_port": gateway.http_port, "grpc_port": gateway.grpc_port,
                    "admin_port": gateway.admin_port, "release": gateway.release, "routes_dir": gateway.routes_dir,
                    "max_request_bytes": gateway.max_request_bytes, "max_requests": gateway.max_requests,
                    "retries": gateway.retries, "arms": [list(a) for a in gateway.arms], "arm_key": gateway.arm_key,
                    "shadow": gateway.shadow},
        "replicas": [{"host": r.host, "http_port": r.http_port, "grpc_port": r.grpc_port} for r in gateway.replicas],
    }, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def forget(gateway: Gateway) -> None:
    """Remove the record (the fleet stops)."""
    path = record_path(gateway.http_port)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def find(url: str) -> FleetRecord | None:
    """The running fleet whose gateway serves HTTP on ``url``'s port, or None (a single server, or
    nothing recorded: the record of a fleet whose process has ended does not count)."""
    port = url.split("://", 1)[-1].rstrip("/").rsplit(":", 1)[-1]
    if not port.isdigit():
        return None
    try:
        data = json.loads(record_path(int(port)).read_text())
        os.kill(int(data["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    g = data["gateway"]
    gateway = Gateway(tuple(Replica(r["http_port"], r["grpc_port"], r["host"]) for r in data["replicas"]),
                      host=g["host"], http_port=g["http_port"], grpc_port=g["grpc_port"], admin_port=g["admin_port"],
                      max_request_bytes=g["max_request_bytes"], max_requests=g["max_requests"], retries=g["retries"],
                      release=g["release"], routes_dir=g["routes_dir"],
                      arms=tuple((int(r), float(p)) for r, p in g.get("arms") or ()), arm_key=g.get("arm_key"),
                      shadow=float(g.get("shadow") or 0.0))
    return FleetRecord(gateway, data["repository"], data["layout"], int(data["pid"]), data.get("release"))


def applied_routes(admin_url: str) -> dict[str, str]:
    """Route configuration name -> the ``version_info`` the gateway serves now."""
    with urllib.request.urlopen(f"{admin_url}/config_dump?resource=dynamic_route_configs", timeout=5) as reply:
        dump = json.loads(reply.read())
    return {c.get("route_config", {}).get("name", ""): c.get("version_info", "") for c in dump.get("configs", [])}


def _route(fleet: FleetRecord, pin: int | None, release: int | None = None, arms: tuple[tuple[int, float], ...] = (),
           key: str | None = None, shadow: float = 0.0) -> FleetRecord:
    """Replace the gateway's routes with ones pinned to ``pin`` (None: no pin; with ``arms``, an
    experiment's candidates beside it, chosen by ``key``, shadowing ``shadow`` percent of the
    serving arm), wait until it serves them, and record the fleet as serving ``release`` (default:
    as before)."""
    switched = replace(fleet, gateway=replace(fleet.gateway, release=pin, arms=arms, arm_key=key, shadow=shadow),
                       release=fleet.release if release is None else release)
    write_routes(switched.gateway)
    wanted = routes_version(pin, arms, key, shadow)
    deadline = time.monotonic() + APPLY_TIMEOUT
    while True:
        try:
            applied = applied_routes(fleet.admin_url)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            applied = {"(admin)": str(exc)}
        if applied and all(v == wanted for v in applied.values()):
            break
        if time.monotonic() > deadline:
            raise DeployError(f"the gateway did not report routes {wanted} within {APPLY_TIMEOUT:.0f}s (it reports "
                              f"{applied}); routes file(s) written in {fleet.gateway.routes_dir}")
        time.sleep(0.02)
    _update_record(switched)
    return switched


def _update_record(fleet: FleetRecord) -> None:
    """Write ``fleet``'s release and pin into its record (the replicas and ports stay as the fleet
    wrote them)."""
    path = record_path(fleet.gateway.http_port)
    data = json.loads(path.read_text())
    data["release"], data["gateway"]["release"] = fleet.release, fleet.gateway.release
    data["gateway"]["arms"] = [list(a) for a in fleet.gateway.arms]
    data["gateway"]["arm_key"] = fleet.gateway.arm_key
    data["gateway"]["shadow"] = fleet.gateway.shadow
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _each(controls: list[Control], work: Callable[[int, Control], None]) -> list[str]:
    """Run ``work`` on every replica at once; the problems, one line per replica that failed."""
    def run(i: int) -> str | None:
        try:
            work(i, controls[i])
            return None
        except (ControlError, OSError, ValueError) as exc:
            return f"replica {i} ({controls[i].url}): {exc}"

    with ThreadPoolExecutor(len(controls)) as pool:
        return [p for p in pool.map(run, range(len(controls))) if p]


def parity_checks(pipelines: dict) -> dict:
    """Per release, fresh rows and the scores ``pipelines[release]`` gives them in this process."""
    checks = {}
    for release, pipeline in pipelines.items():
        dense, cats = fresh_rows(seed=7, widths=pipeline.widths)
        checks[release] = (dense, cats, pipeline.score(dense, cats))
    return checks


def load_and_check(control: Control, versions: list[int], checks: dict) -> None:
    """Have a replica hold ``versions``, report them ready and score each release of ``checks`` as
    this process does (within PARITY_ATOL); raises ControlError naming what it did not."""
    control.load_release(versions)
    ready = control.ready_versions()
    if ready != versions:
        raise ControlError(f"reports versions {ready} ready after loading {versions}")
    for release, (dense, cats, local) in checks.items():
        served = control.infer(dense, cats, version=release)
        diff = max(float(abs(served[k] - local[k].ravel()).max()) for k in served)
        if diff > PARITY_ATOL:
            raise ControlError(f"release {release}'s served scores differ from in-process by {diff:.2e}")


def _declare(repository: str, release: int, by: str, versions: list[int] | None, log) -> None:
    try:
        declared.write(repository, release, by, versions)
    except OSError as exc:
        log(f"could not declare release {release} ({exc}): a replica that starts later serves the newest release")


def switch(fleet: FleetRecord, release: int, holdout: str | Path | None = None, log=print,
           compare_auc: bool = True) -> int:
    """Release ``release`` across ``fleet`` (the module docstring's steps); returns it.

    Raises:
        DeployError: a check failed (nothing changed; the message says which replica and why).
    """
    by = "deploy" if compare_auc else "rollback"
    serving = fleet.release
    if serving is None:
        raise DeployError(f"the fleet at port {fleet.gateway.http_port} runs the {fleet.layout} layout, whose ranker "
                          "is not one model version per release (restart the fleet on the new export instead)")
    with _lock(fleet):
        running = declared.experiment(fleet.repository)
        if running is not None:
            raise DeployError(f"an experiment runs on this fleet (candidates {[r for r, _ in running.arms]}): "
                              "`ensemble experiment promote` or `abort` it first")
        if serving == release:
            _declare(fleet.repository, release, by, None, log)
            log(f"release {release} already serves on the fleet")
            return release
        pipeline = check_release(fleet.repository, release, serving, holdout, log, compare_auc)
        controls = fleet.replicas()
        both = sorted({serving, release})
        fleet = _route(fleet, serving)
        _declare(fleet.repository, serving, by, both, log)
        log(f"loading release {release} beside {serving} on {len(controls)} replicas")
        checks = parity_checks({release: pipeline})
        problems = _each(controls, lambda i, control: load_and_check(control, both, checks))
        if problems:
            back = _each(controls, lambda i, c: c.load_release(serving))
            _declare(fleet.repository, serving, by, None, log)
            if not back:
                _route(fleet, None)
            raise DeployError(f"release {release} refused: " + "; ".join(problems) + f". Release {serving} serves "
                              "on every replica, as before" + ("" if not back else "; could not unload release "
                                                               f"{release} from: " + "; ".join(back) + " (the "
                                                               f"gateway keeps every request on {serving})"))
        log(f"release {release} ready on every replica; switching the gateway")
        try:
            fleet = _route(fleet, release, release)
        except (DeployError, OSError) as exc:  # the gateway did not take the new routes: back to S everywhere
            _route(fleet, serving)
            _each(controls, lambda i, c: c.load_release(serving))
            _declare(fleet.repository, serving, by, None, log)
            raise DeployError(f"release {release}: the gateway's switch failed ({exc}); every request stays on "
                              f"release {serving}") from exc
        _declare(fleet.repository, release, by, both, log)
        log(f"the gateway routes every request to release {release}; retiring {serving} in {RETIRE_AFTER:g}s")
        time.sleep(RETIRE_AFTER)
        left = _each(controls, lambda i, c: c.load_release(release))
        _declare(fleet.repository, release, by, None, log)
        if left:
            log(f"release {serving} stays loaded on: " + "; ".join(left) + f" (the gateway keeps every request on "
                f"{release}; it goes at that replica's next restart)")
        else:
            _route(fleet, None)
        log(f"release {release} serves on every replica; declared in {declared.path(fleet.repository)}")
        return release


class _lock:
    """One release at a time per fleet (an exclusive lock on a file beside its record)."""

    def __init__(self, fleet: FleetRecord):
        self.path = record_path(fleet.gateway.http_port).with_suffix(".lock")

    def __enter__(self):
        self.file = open(self.path, "w")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise DeployError("another deploy or rollback is switching this fleet; try again when it ends") from None
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def deploy(fleet: FleetRecord, release: int | None = None, holdout: str | Path | None = None, log=print) -> int:
    """Release the newest exported release (or ``release``) across the fleet."""
    releases = available_releases(fleet.repository)
    if not releases:
        raise DeployError(f"no release in {fleet.repository}: run `ensemble export` first")
    return switch(fleet, releases[-1] if release is None else release, holdout, log)


def rollback(fleet: FleetRecord, log=print) -> int:
    """Release the newest release older than the fleet's (all checks but the AUC one)."""
    serving = fleet.release
    older = [r for r in available_releases(fleet.repository) if serving is None or r < serving]
    if not older:
        raise DeployError(f"no release older than {serving} in {fleet.repository} (export keeps the newest --keep)")
    return switch(fleet, older[-1], log=log, compare_auc=False)
