"""The gateway: one typed description of the fleet (:class:`Gateway`), from which its Envoy configuration is
generated (:func:`ensemble.fleet.envoy_config.envoy_config` returns the bootstrap as a dict; JSON is YAML, so
Envoy reads the ``json.dumps`` of it as it is). What the gateway does, and why (docs/fleet.md has the long form):

- **Two public listeners.** HTTP (HTTP/1.1 or cleartext HTTP/2) to the replicas' HTTP ports over
  HTTP/1.1 (Triton's HTTP front end speaks only that), gRPC to their gRPC ports over HTTP/2. Every
  request is balanced on its own (least request), so one long-lived gRPC connection spreads over
  all replicas.
- **Health.** Each replica's ``/v2/models/ranker/ready`` is checked every second on its HTTP port;
  two failures take it out of rotation, one success puts it back. A replica whose connections fail
  or reset is also ejected at once (outlier detection on local-origin failures only: a 503 refusal
  for a deadline is the replica's overload policy working, not a fault). The panic threshold is off:
  traffic never goes to a replica known to be down.
- **Retries.** A request that failed to connect, was reset, or got an answer that another replica
  would not give (:data:`RETRIED_HTTP_STATUSES`: a deadline refusal, a ranker being reloaded, a
  broken backend process) is retried up to ``retries`` times on replicas it has not tried yet, within
  a retry budget (a share of the requests in flight) so that retries cannot multiply true overload.
- **Limits at the door.** A body larger than ``max_request_bytes`` (after gzip decompression at the
  gateway, whose inflation ratio is bounded too) is refused with 413 (gRPC RESOURCE_EXHAUSTED)
  before a replica sees it, on its ``Content-Length`` header when it has one.
  Other HTTP content encodings and compressed gRPC messages are refused (Triton would inflate them
  without a bound). Headers must arrive within 10 s and an idle connection closes after 5 minutes.
- **JSON Triton can parse.** A POST whose JSON (the body, or a binary request's JSON header) nests
  deeper than :data:`MAX_JSON_DEPTH` is refused with 400: Triton 2.51's recursive parser dies of a
  deep enough body. Triton's 500 answers to JSON it cannot parse or read are answered 400. The Lua
  filters that do this, and pin gRPC requests, are files of their own (``ensemble/fleet/lua``,
  :mod:`ensemble.fleet.lua_filters`), unit-tested and fuzzed in LuaJIT.
- **Closed routes.** Only health, metadata, config, statistics and inference reach the replicas;
  model control (``/v2/repository/...``, gRPC ``Repository*``), shared-memory registration and trace
  or log settings are refused with 403 (gRPC PERMISSION_DENIED). Operators use a replica's own port.
  Statistics come from the first healthy replica, not a balanced one (cumulative counters that a
  reader diffs must come from one server).
- **One release for all.** With ``release`` set (a fleet pins it only while its replicas hold two
  releases, during a switch: otherwise each replica holds one and nothing needs naming), every
  inference request on the ranker that names no version is sent to that version on whichever
  replica takes it (HTTP: the path is rewritten to ``/v2/models/ranker/versions/<release>/infer``;
  gRPC: a Lua filter adds ``model_version`` to the request message), and every request carries the
  ``ensemble-release`` header, which the replicas pass to their models as a request parameter (the
  ``rank`` model scores with that release's pipeline). With ``routes_dir`` set, the routes are read
  from files there (Envoy's file-based route discovery) and :func:`write_routes` switches every new
  request to another release in one step (:mod:`ensemble.fleet.release`).
- **Metrics of a lone replica.** With ``metrics_port`` set (one replica: ``ensemble serve`` on a
  non-loopback address puts its one tritonserver behind the gateway), a third listener answers
  ``GET /metrics`` from the replica's metrics port and nothing else, so Triton binds no public port.
- **Overload.** Beyond ``max_requests`` requests in flight the gateway refuses at once with 503
  (gRPC UNAVAILABLE), before any replica parses the request. The bound follows the replicas'
  latency objective (:func:`requests_within_objective`): a request past it could not be answered
  within the objective even at the fastest rate measured here, so the replica would refuse it too.
- **Statuses a gRPC client can act on.** Every answer the gateway gives itself carries, to a gRPC
  client, the status its HTTP status means (:data:`GRPC_STATUS_OF_REFUSAL`: 400 INVALID_ARGUMENT,
  403 PERMISSION_DENIED, 413 RESOURCE_EXHAUSTED, 503 UNAVAILABLE), not Envoy's default table's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ensemble.operate.door import HTTP_MAX_INPUT_BYTES

from ensemble.fleet.arms import GatewayError, check_arms

# The fastest any replica answered on the build VM (1-row requests, native layout, one core:
# docs/load-testing.md): with more requests than objective x this rate waiting on a replica, the
# last would miss the objective.
PEAK_REQUESTS_PER_SECOND = 5_000
MIN_REQUESTS_PER_REPLICA = 64
# A gzip body may inflate to at most this many times its size (ordinary v2 JSON compresses 5-20x).
MAX_INFLATE_RATIO = 100
GRPC_SERVICE = "inference.GRPCInferenceService"
# Statistics are cumulative counters of one server: a client that reads them twice and takes the
# difference (perf_analyzer does, around every measurement window) must read the same replica both
# times, so they come from the first healthy replica in order rather than a balanced one.
HTTP_STATS_PATHS = r"/v2/models(/[^/]+(/versions/[0-9]+)?)?/stats"
GRPC_STATS_METHOD = "ModelStatistics"
# What a client may call over gRPC; everything else (Repository*, *SharedMemory*, TraceSetting,
# LogSettings, ModelStreamInfer) is refused at the gateway.
GRPC_CLIENT_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                       "ModelConfig", GRPC_STATS_METHOD, "ModelInfer")
# What a client may call over HTTP: server health and metadata, a model's metadata, readiness,
# config, statistics and inference (optionally of one version).
HTTP_CLIENT_PATHS = ("/v2", "/v2/health/live", "/v2/health/ready")
HTTP_MODEL_PATHS = r"/v2/models/[^/]+(/versions/[0-9]+)?(/(ready|config|infer))?"
REFUSED_TEXT = ("refused at the gateway: model control, shared memory, trace and log settings are not open to "
                "clients (operators use a replica's own port)\n")

_TYPES = "type.googleapis.com/envoy."


@dataclass(frozen=True)
class Replica:
    """One Triton replica's internal ports (on ``host``, loopback by default)."""

    http_port: int
    grpc_port: int
    host: str = "127.0.0.1"
    metrics_port: int | None = None  # Triton's metrics port, for a gateway that serves them (``Gateway.metrics_port``)


@dataclass(frozen=True)
class Gateway:
    """The gateway in front of ``replicas``.

    Attributes:
        replicas: the Triton replicas, at least one.
        host: the address the public listeners bind.
        http_port, grpc_port: the public ports.
        admin_port: Envoy's admin listener (always on loopback: it can drain and stop the gateway).
        max_request_bytes: the largest body (after decompression) passed on; larger gets 413.
        max_requests: requests in flight through the gateway, per protocol, before it refuses
            with 503; None: :func:`requests_within_objective` of the default objective x replicas.
        retries: retries of a failed request, each on a replica not tried yet.
        dns_refresh: None: each replica is one address (STATIC). Seconds: each replica's ``host`` is
            a DNS name whose addresses are replicas on other machines (a Kubernetes headless Service),
            resolved again at this interval (STRICT_DNS); ports may then equal the gateway's own.
        release: the ranker version unversioned requests go to (None: the replica's newest; the
            Lua filter is then off on every route, at no cost).
        routes_dir: read the routes from files in this folder, which :func:`write_routes` replaces
            (None: the routes are part of the bootstrap and never change).
        metrics_port: a public port on ``host`` that answers ``GET /metrics`` from the replica's own
            metrics port (one replica with a ``metrics_port``; None: no metrics listener).
        arms: an experiment's candidates, ``(release, percent)`` each: that share of the inference
            requests goes to the candidate, the rest to ``release`` (:func:`arm_of` chooses).
        arm_key: the request header, or else the request parameter, whose value chooses a request's
            arm (the same value, the same arm); None, or a request with neither: a hash of the
            request's id (random per request).
        shadow: percent of the serving release's requests (during an experiment) that the candidates
            score too, after the answer: the gateway names them in the ``ensemble-shadow`` header, and
            removes that header from every request a client sends.
    """

    replicas: tuple[Replica, ...]
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    admin_port: int = 9901
    max_request_bytes: int = HTTP_MAX_INPUT_BYTES
    max_requests: int | None = None
    retries: int = 2
    dns_refresh: float | None = None
    release: int | None = None
    routes_dir: str | None = None
    metrics_port: int | None = None
    arms: tuple[tuple[int, float], ...] = ()
    arm_key: str | None = None
    shadow: float = 0.0

    def check(self) -> None:
        """Raises :class:`GatewayError` naming the first problem."""
        if not self.replicas:
            raise GatewayError("a gateway needs at least one replica")
        if self.metrics_port is not None and (len(self.replicas) != 1 or self.replicas[0].metrics_port is None):
            raise GatewayError("a gateway serves metrics for one replica with a metrics port, not for "
                               f"{len(self.replicas)} replica(s)")
        # the replicas' metrics ports count only where the gateway serves them
        replicas = [(r.host, p) for r in self.replicas
                    for p in (r.http_port, r.grpc_port, r.metrics_port if self.metrics_port is not None else None)
                    if p is not None]
        bad = [p for p in [p for _, p in self.listeners()] + [p for _, p in replicas] if not 0 < p < 65536]
        if bad:
            raise GatewayError(f"port(s) {', '.join(map(str, bad))} out of range 1-65535")
        listened = self.listeners() + (replicas if self.dns_refresh is None else [])  # resolved: other machines
        seen: set[int] = set()
        twice = sorted({p for _, p in listened if p in seen or seen.add(p)})
        if twice:
            raise GatewayError(f"port(s) {', '.join(map(str, twice))} given to more than one listener")
        if self.max_request_bytes < 1024:
            raise GatewayError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.max_requests is not None and self.max_requests < 1:
            raise GatewayError(f"max_requests must be at least 1, got {self.max_requests}")
        if not 0 <= self.retries <= 5:
            raise GatewayError(f"retries must be 0-5, got {self.retries}")
        if self.dns_refresh is not None and not self.dns_refresh > 0:
            raise GatewayError(f"dns_refresh must be > 0 seconds, got {self.dns_refresh}")
        if self.release is not None and not 0 < self.release < 2**63:
            raise GatewayError(f"release must be a positive version number, got {self.release}")
        check_arms(self.release, self.arms, self.arm_key, self.shadow)

    def listeners(self) -> list[tuple[str, int]]:
        """Every (address, port) this gateway's Envoy binds."""
        public = [self.http_port, self.grpc_port] + ([self.metrics_port] if self.metrics_port is not None else [])
        return [(self.host, p) for p in public] + [("127.0.0.1", self.admin_port)]

    def requests_in_flight(self) -> int:
        return self.max_requests or requests_within_objective(None) * len(self.replicas)


def requests_within_objective(objective_ms: float | None) -> int:
    """Requests one replica can hold and still answer the last within ``objective_ms`` at the
    fastest rate measured here (None: the exported default objective)."""
    from ensemble.repository.configs import DEFAULT_OBJECTIVE_MS

    objective = DEFAULT_OBJECTIVE_MS if objective_ms is None else objective_ms
    return max(MIN_REQUESTS_PER_REPLICA, math.ceil(objective / 1000 * PEAK_REQUESTS_PER_SECOND))
