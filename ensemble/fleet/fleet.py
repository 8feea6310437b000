"""``ensemble serve --replicas N``: N supervised tritonservers behind one Envoy gateway; and the door:
``ensemble serve`` on any address but loopback is a fleet of one.

Each replica is a :class:`~ensemble.operate.server.TritonServer` on loopback with ports of its own
and its own :class:`~ensemble.operate.supervise.Supervisor` (healed and restarted on the same ports
exactly as ``ensemble serve`` does for one server). The gateway takes the ports the user named for
HTTP and gRPC (:mod:`ensemble.fleet.gateway`). Replica ``i`` serves metrics on ``metrics_port + i``;
its HTTP and gRPC ports are ``replica_ports + 2i`` and ``+ 2i + 1``, or free ports picked at start.

**The door.** Triton 2.51's HTTP front end can be crashed by one request (a body in millions of
one-byte chunks: SIGSEGV), refuses valid chunked requests whose BYTES length prefix straddles a
chunk, and bounds neither bodies nor their decompression. So an exposed server is never Triton
itself: with one replica, tritonserver binds loopback on ports of its own and the gateway takes the
user's HTTP, gRPC and metrics ports (the metrics through a listener that serves only ``GET
/metrics``), buffering every body and passing it on re-framed with its length, within the size and
inflation limits, on client routes only (docs/reliability.md, "The door").

Every replica serves one release of the ranker (the repository's declared release, else its
newest). The gateway reads its routes from files in the fleet's own folder, so that ``ensemble
deploy --url GATEWAY`` can switch all replicas at once (:mod:`ensemble.fleet.release`, which finds
the fleet through the record :func:`ensemble.fleet.release.record` writes at start).

Shutdown drains: the gateway stops taking requests and waits for those in flight, then the gateway
ends, then the supervisors, then the replicas.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ensemble.fleet.envoy import Envoy, EnvoyError, validate
from ensemble.fleet import release as fleet_release
from ensemble.fleet.gateway import Gateway, GatewayError, Replica, requests_within_objective
from ensemble.fleet.envoy_config import envoy_config, write_routes
from ensemble.models.registry import Layout
from ensemble.repository import declared
from ensemble.operate.server import ServerError, ServerOptions, TritonServer
from ensemble.base.machine import free_ports, port_free

MAX_REPLICAS = 32
HEALTHY_TIMEOUT = 60.0  # seconds start() waits for the gateway to route to every replica
REPLICA_HOST = "127.0.0.1"  # model control stays on the replicas' own ports, reachable only from this host


class FleetError(ServerError):
    """The fleet cannot start or keep serving; the message says why."""


@dataclass(frozen=True)
class FleetOptions:
    """A fleet of ``replicas`` tritonservers behind the gateway.

    Attributes:
        server: the options ``ensemble serve`` was given: ``host``, ``http_port`` and ``grpc_port``
            are the gateway's, ``metrics_port`` the first replica's; the rest applies to every replica.
        replicas: how many tritonservers (1: the door in front of one server bound elsewhere than
            loopback; its metrics port is the gateway's too).
        replica_ports: replica ``i``'s HTTP port is ``replica_ports + 2i``, gRPC ``+ 2i + 1`` (None:
            free ports picked at start).
        admin_port: the gateway's admin listener on loopback (None: a free port).
        drain_timeout: seconds a shutdown waits for requests in flight at the gateway.
    """

    server: ServerOptions
    replicas: int
    replica_ports: int | None = None
    admin_port: int | None = None
    drain_timeout: float = 30.0

    def check(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise FleetError(f"a fleet has 1 to {MAX_REPLICAS} replicas, got {self.replicas}")
        if not self.server.loopback and not self.server.admin_key:  # the replicas' own ports are keyed too
            raise FleetError(f"binding {self.server.host} needs ENSEMBLE_ADMIN_KEY: the replicas' model control, "
                             "shared memory, trace and log settings answer only requests that carry it")
        if self.replica_ports is not None and not 0 < self.replica_ports <= 65535 - 2 * self.replicas:
            raise FleetError(f"--replica-ports {self.replica_ports} leaves no room for {self.replicas} replicas' "
                             "HTTP and gRPC ports below 65536")
        if not 0 < self.server.metrics_port <= 65535 - self.replicas:
            raise FleetError(f"metrics ports {self.server.metrics_port}..{self.server.metrics_port + self.replicas - 1} "
                             "out of range")


def _log_path(log: Path | None, name: str) -> Path | None:
    return None if log is None else log.with_name(f"{log.stem}-{name}{log.suffix or '.log'}")


def serving_release(options: ServerOptions) -> int | None:
    """The release a fleet on ``options.repository`` serves at start: the declared one, else the
    newest; None when the layout's ranker is not one version per release (the gpu layout's)."""
    from ensemble.operate.deploy import available_releases

    if Layout(options.layout) not in (Layout.FUSED, Layout.NATIVE):
        return None
    declared_release = declared.read(options.repository)
    releases = available_releases(options.repository)
    return declared_release if declared_release is not None else (releases[-1] if releases else None)


def plan(options: FleetOptions) -> tuple[list[ServerOptions], Gateway]:
    """Every replica's server options and the gateway in front of them; raises :class:`FleetError`
    when ports collide or are out of range."""
    options.check()
    o = options.server
    # Ports left to pick are picked apart from every port the options already name (none of which is
    # bound yet, so the system could hand one of them out again).
    named = {o.http_port, o.grpc_port, *(o.metrics_port + i for i in range(options.replicas))}
    if options.replica_ports is not None:
        named |= {options.replica_ports + i for i in range(2 * options.replicas)}
    if options.admin_port is not None:
        named.add(options.admin_port)
    door = options.replicas == 1  # the gateway serves the replica's metrics on the user's port
    picked = iter(free_ports(2 * options.replicas * (options.replica_ports is None) + (options.admin_port is None)
                             + door, avoid=named))
    servers = []
    for i in range(options.replicas):
        if options.replica_ports is None:
            http, grpc = next(picked), next(picked)
        else:
            http, grpc = options.replica_ports + 2 * i, options.replica_ports + 2 * i + 1
        servers.append(replace(o, host=REPLICA_HOST, http_port=http, grpc_port=grpc,
                               metrics_port=next(picked) if door else o.metrics_port + i,
                               log_file=_log_path(o.log_file, f"replica{i}")))
    gateway = Gateway(tuple(Replica(s.http_port, s.grpc_port, REPLICA_HOST, s.metrics_port if door else None)
                            for s in servers), host=o.host,
                      http_port=o.http_port, grpc_port=o.grpc_port,
                      admin_port=options.admin_port if options.admin_port is not None else next(picked),
                      max_requests=requests_within_objective(o.latency_objective_ms) * options.replicas,
                      metrics_port=o.metrics_port if door else None)
    ports = [p for _, p in gateway.listeners()]
    ports += [p for s in servers for p in (s.http_port, s.grpc_port, s.metrics_port)]
    twice = sorted({p for p in ports if ports.count(p) > 1})
    if twice:
        raise FleetError(f"port(s) {', '.join(map(str, twice))} would serve twice: choose --http-port, --grpc-port, "
                         "--metrics-port and --replica-ports apart")
    try:
        gateway.check()
    except GatewayError as exc:
        raise FleetError(str(exc)) from None
    return servers, gateway


class Fleet:
    """Replicas, their supervisors and the gateway; ``start()``, then ``run(stopping)``, then ``stop()``."""

    def __init__(self, options: FleetOptions, log: Callable[[str], None] = print):
        self.options = options
        self.log = log
        server_options, gateway = plan(options)
        self.folder = Path(tempfile.mkdtemp(prefix="ensemble-fleet-"))
        self.release = serving_release(options.server)
        self.gateway = replace(gateway, routes_dir=str(self.folder / "routes"))
        running = declared.experiment(options.server.repository) if self.release is not None else None
        if running is not None:  # a fleet that restarts during an experiment routes to its arms again
            self.gateway = replace(self.gateway, release=self.release, arms=running.arms, arm_key=running.key,
                                   shadow=running.shadow)
        self.servers = [TritonServer(o) for o in server_options]
        self.envoy = Envoy(self.gateway, log_file=_log_path(options.server.log_file, "gateway"))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.gave_up: dict[int, str] = {}

    def start(self) -> "Fleet":
        """Start every replica (in parallel), then the gateway once all are ready."""
        busy = [p for h, p in self.gateway.listeners() if not port_free(h, p)]
        if busy:
            raise FleetError(f"gateway port(s) {', '.join(map(str, busy))} already in use")
        try:
            write_routes(self.gateway)
            validate(envoy_config(self.gateway))
        except EnvoyError as exc:
            raise FleetError(str(exc)) from None
        with ThreadPoolExecutor(len(self.servers)) as pool:
            failures = [f for f in [pool.submit(self._start_replica, i) for i in range(len(self.servers))]
                        if f.exception() is not None]
        if failures:
            self.stop_replicas()
            raise FleetError(f"a replica did not start: {failures[0].exception()}")
        try:
            self.envoy.start()
        except EnvoyError as exc:
            self.stop_replicas()
            raise FleetError(str(exc)) from None
        fleet_release.record(self.gateway, self.options.server.repository, Layout(self.options.server.layout).value,
                             self.release)
        # ready means every replica in rotation: a first health check can time out on a busy machine
        unhealthy = self.envoy.wait_healthy(HEALTHY_TIMEOUT)
        if unhealthy:
            self.log(f"gateway: not yet routing to {', '.join(unhealthy)} after {HEALTHY_TIMEOUT:.0f}s; "
                     "serving with the others")
        return self

    def _start_replica(self, index: int) -> None:
        """Start replica ``index``, a second time if the first fails: on a starved machine Triton
        2.51's python backend can lose a stub at start-up (tritonserver aborts with
        ``boost::interprocess::lock_exception``, or waits for the stub forever)."""
        server = self.servers[index]
        try:
            server.start()
        except ServerError as exc:
            self.log(f"replica {index}: did not start ({str(exc).splitlines()[0]}); starting it again")
            server.kill()
            server.start()

    def _supervise(self, index: int) -> None:
        from ensemble.operate.supervise import GaveUp, Supervisor

        supervisor = Supervisor(self.servers[index], log=lambda line: self.log(f"replica {index}: {line}"))
        try:
            supervisor.run(self._stop.is_set)
        except ServerError as exc:  # GaveUp, or a restart that could not start the server
            self.gave_up[index] = str(exc)
            self.log(f"replica {index}: {'gave up' if isinstance(exc, GaveUp) else 'stopped'}: "
                     f"{str(exc).splitlines()[0]}")

    def run(self, stopping: Callable[[], bool], poll: float = 0.5) -> None:
        """Supervise every replica (a thread each) and the gateway until ``stopping()``.

        Raises:
            FleetError: every replica gave up, or the gateway kept dying.
        """
        self._threads = [threading.Thread(target=self._supervise, args=(i,), name=f"replica-{i}", daemon=True)
                         for i in range(len(self.servers))]
        for thread in self._threads:
            thread.start()
        gateway_restarts: list[float] = []
        while not stopping():
            time.sleep(poll)
            if len(self.gave_up) == len(self.servers):
                raise FleetError("every replica gave up:\n" + "\n".join(self.gave_up.values()))
            if not self.envoy.alive() and not stopping():
                now = time.monotonic()
                gateway_restarts = [t for t in gateway_restarts if now - t < 600] + [now]
                if len(gateway_restarts) > 5:
                    raise FleetError(f"the gateway died {len(gateway_restarts)} times within 600s\n{self.envoy.log_tail()}")
                self.log(f"gateway exited with code {self.envoy.process.returncode}; starting it again")
                try:
                    self.envoy.start()
                except EnvoyError as exc:
                    raise FleetError(f"the gateway did not start again: {exc}") from None
                self.log("gateway ready again")

    def stop(self) -> None:
        """Drain the gateway, end it, then the supervisors, then the replicas."""
        left = self.envoy.drain(self.options.drain_timeout)
        if left:
            self.log(f"gateway: {left} request(s) still in flight after {self.options.drain_timeout:.0f}s; stopping")
        self.envoy.stop()
        fleet_release.forget(self.gateway)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        self.stop_replicas()
        shutil.rmtree(self.folder, ignore_errors=True)

    def stop_replicas(self) -> None:
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.stop(), self.servers))

    def describe(self) -> list[str]:
        """What ``ensemble serve`` prints once the fleet is ready (the last line starts with ``ready:``)."""
        lines = [f"replica {i}: HTTP http://{s.http_url}  gRPC grpc://{s.grpc_url}  metrics {s.metrics_url}  "
                 f"log {s.log_file}" for i, s in enumerate(self.servers)]
        g = self.gateway
        lines.append(f"gateway: admin http://127.0.0.1:{g.admin_port}  log {self.envoy.log_file}")
        if g.metrics_port is not None:  # the door in front of one server
            lines.append(f"ready: HTTP http://{g.host}:{g.http_port}  gRPC grpc://{g.host}:{g.grpc_port}  "
                         f"metrics http://{g.host}:{g.metrics_port}/metrics  (one server behind the gateway)")
        else:
            lines.append(f"ready: HTTP http://{g.host}:{g.http_port}  gRPC grpc://{g.host}:{g.grpc_port}  "
                         f"({len(self.servers)} replicas behind the gateway)")
        return lines
