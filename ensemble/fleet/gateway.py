"""The gateway's Envoy configuration, generated from one typed description of the fleet.

``envoy_config(Gateway(...))`` returns the bootstrap as a dict (JSON is YAML, so Envoy reads the
``json.dumps`` of it as it is). What the gateway does, and why (docs/fleet.md has the long form):

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

import json
import math
import os
import re
from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path

from ensemble import schema
from ensemble.fleet import lua_filters
from ensemble.operate.control import RELEASE_HEADER, SHADOW_HEADER
from ensemble.operate.door import HTTP_MAX_INPUT_BYTES

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


class GatewayError(ValueError):
    """A fleet description the gateway cannot serve; the message says what is wrong."""


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


ARM_POINTS = 10_000  # an arm's share is counted in hundredths of a percent
HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")  # lower case: HTTP/2 and Envoy see header names so


def check_arms(release: int | None, arms: tuple[tuple[int, float], ...], key: str | None, shadow: float = 0.0) -> None:
    """Raises :class:`GatewayError` when ``arms`` (an experiment's candidates beside ``release``)
    cannot be served: unknown or repeated releases, shares outside (0, 100) or summing to 100 or
    more, a key that is no header name, or a shadow share outside [0, 100]."""
    if not 0 <= shadow <= 100:
        raise GatewayError(f"the shadow share must be 0-100 percent, got {shadow}")
    if not arms:
        if key is not None or shadow:
            raise GatewayError("an arm key or a shadow share needs an experiment's arms")
        return
    if release is None:
        raise GatewayError("an experiment needs the serving release (the arm that takes the rest)")
    releases = [r for r, _ in arms]
    if release in releases or len(set(releases)) != len(releases) or any(not 0 < r < 2**63 for r in releases):
        raise GatewayError(f"an experiment's candidates must be distinct releases other than {release}: {releases}")
    shares = [p for _, p in arms]
    if any(not 0 < p < 100 for p in shares) or sum(shares) >= 100:
        raise GatewayError(f"candidate shares must each be in (0, 100) percent and sum below 100: {shares}")
    if any(round(p * ARM_POINTS / 100) < 1 for p in shares):
        raise GatewayError(f"a share must be at least {100 / ARM_POINTS:g} percent: {shares}")
    if key is not None and not HEADER_NAME.match(key):
        raise GatewayError(f"the arm key must be a lower-case request header or parameter name, got {key!r}")


def arm_bounds(release: int, arms: tuple[tuple[int, float], ...]) -> list[tuple[int, int]]:
    """(release, upper bound in :data:`ARM_POINTS`) in order: the candidates, then the serving
    release up to the whole."""
    bounds, upto = [], 0
    for candidate, percent in arms:
        upto += round(percent * ARM_POINTS / 100)
        bounds.append((candidate, upto))
    return bounds + [(release, ARM_POINTS)]


def arm_point(value: str | bytes, rounds: int = 3) -> int:
    """Where ``value`` (an arm key's value) falls in [0, ARM_POINTS): a polynomial hash of its bytes,
    mixed by ``rounds`` Lehmer steps (3 for the arm; 5 for the shadow sample, drawn from the request
    id), all exact in doubles. The gateway's Lua computes the same (``lua/arm.lua``), so a key's arm
    is known here, the same on every gateway and after restarts."""
    h = 0
    for byte in value.encode() if isinstance(value, str) else value:
        h = (h * 31 + byte) % 2147483647
    for _ in range(rounds):
        h = (h * 48271 + 11) % 2147483647
    return h % ARM_POINTS


def arm_of(value: str | bytes, release: int, arms: tuple[tuple[int, float], ...]) -> int:
    """The release a request whose arm key is ``value`` is scored by."""
    point = arm_point(value)
    return next(r for r, upto in arm_bounds(release, arms) if point < upto)


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _cluster(name: str, gateway: Gateway, grpc: bool, pinned: bool = False) -> dict:
    """The replicas as one upstream cluster: their gRPC ports over HTTP/2, or their HTTP ports.

    Args:
        pinned: every request goes to the first healthy replica in order (replica ``i`` is Envoy
            priority ``i``), not to the least loaded.
    """
    limit = gateway.requests_in_flight()
    endpoints = [{"endpoint": {"address": _address(r.host, r.grpc_port if grpc else r.http_port),
                               # health is read on the HTTP port for both protocols
                               "health_check_config": {"port_value": r.http_port}}}
                 for r in gateway.replicas]
    groups = ([{"priority": i, "lb_endpoints": [e]} for i, e in enumerate(endpoints)] if pinned
              else [{"lb_endpoints": endpoints}])
    protocol = {"http2_protocol_options": {}} if grpc else {"http_protocol_options": {}}
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "per_connection_buffer_limit_bytes": gateway.max_request_bytes,
        "load_assignment": {"cluster_name": name, "endpoints": groups},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPES + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": protocol}},
        "health_checks": [{
            # a replica under full load still answers readiness, but late: a generous timeout
            "timeout": "3s", "interval": "1s", "no_traffic_interval": "1s", "unhealthy_interval": "1s",
            "unhealthy_threshold": 2, "healthy_threshold": 1,
            "http_health_check": {"path": f"/v2/models/{schema.Model.RANKER.value}/ready"}}],
        "outlier_detection": {
            # only failures of the connection count (refused, reset, timed out); HTTP answers do not
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1, "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_local_origin_success_rate": 0, "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0, "enforcing_success_rate": 0,
            "enforcing_failure_percentage": 0, "enforcing_failure_percentage_local_origin": 0,
            "interval": "1s", "base_ejection_time": "2s", "max_ejection_percent": 50},
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT", "max_connections": limit, "max_pending_requests": limit,
            "max_requests": limit,
            "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 8}}]},
    }
    if gateway.dns_refresh is not None:
        cluster.update(_dns_discovery(gateway.dns_refresh))
    return cluster


def _dns_discovery(refresh: float) -> dict:
    """Every address the replicas' DNS name resolves to is a replica. A replica that leaves the
    answer (a pod being deleted) stops taking requests at once, even while its health check still
    passes, rather than when the check fails."""
    return {"type": "STRICT_DNS", "dns_refresh_rate": _seconds(refresh), "respect_dns_ttl": False,
            "dns_lookup_family": "V4_PREFERRED", "ignore_health_on_host_removal": True}


# What a replica answers while it cannot score, and another replica can: a refusal for its deadline
# (503 / UNAVAILABLE), a ranker being healed or reloaded ("has no available versions": 404 /
# NOT_FOUND, until the health check takes the replica out), a broken backend process ("Stub process
# ... is not healthy": 500 / INTERNAL, until its supervisor heals it).
RETRIED_HTTP_STATUSES = (503, 404, 500)
RETRIED_GRPC = "unavailable,internal"
GRPC_NOT_FOUND = "5"  # grpc-status of an error sent without a message: in the response headers


def _retry_policy(gateway: Gateway, grpc: bool) -> dict:
    policy = {"retry_on": "reset,connect-failure,refused-stream,"
                          + (f"{RETRIED_GRPC},retriable-headers" if grpc else "retriable-status-codes"),
              "num_retries": gateway.retries,
              "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                  "@type": _TYPES + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
              "host_selection_retry_max_attempts": 5,
              "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"}}
    if grpc:
        policy["retriable_headers"] = [{"name": "grpc-status", "string_match": {"exact": GRPC_NOT_FOUND}}]
    else:
        policy["retriable_status_codes"] = list(RETRIED_HTTP_STATUSES)
    return policy


def _forward(cluster: str, gateway: Gateway, grpc: bool) -> dict:
    return {"cluster": cluster,
            "timeout": "0s",  # the client's timeout governs (Triton's `timeout` parameter, gRPC deadlines)
            "max_stream_duration": {"grpc_timeout_header_max": "0s"},
            "retry_policy": _retry_policy(gateway, grpc)}


def _refuse(status: int, text: str) -> dict:
    """A route answered by the gateway itself, on the request's headers (the buffer and Lua filters,
    which would wait for the whole body first, are off on it)."""
    return {"direct_response": {"status": status, "body": {"inline_string": text}},
            "typed_per_filter_config": {
                "envoy.filters.http.buffer": {"@type": _TYPES + "extensions.filters.http.buffer.v3.BufferPerRoute",
                                              "disabled": True},
                LUA_FILTER: {"@type": _TYPES + "extensions.filters.http.lua.v3.LuaPerRoute", "disabled": True}}}


LUA_FILTER = "envoy.filters.http.lua"

# The deepest JSON nesting the gateway passes to Triton. Triton 2.51's JSON parser recurses once per
# level: a body of ~150,000 nested brackets (300 KB) kills tritonserver (SIGSEGV, seen on the AMD EPYC
# VM), while a v2 inference request nests 4 levels plus its tensor's rank.
MAX_JSON_DEPTH = 64


class LuaFilter(str, Enum):
    """The gateway's two Lua filters (``ensemble/fleet/lua/<value>.lua``, each after ``arm.lua``)."""

    PIN_VERSION = "pin_version"  # the gRPC listener: ModelInfer requests get their arm's release as model_version
    CLIENT_ERROR = "client_error"  # the HTTP listener: JSON too deep, the arm key parameter, Triton's 500s for bad JSON


def lua_config() -> dict[str, str | int]:
    """The values the Lua filters take from Python (their ``CONFIG`` table)."""
    return {"ranker": schema.Model.RANKER.value, "release_header": RELEASE_HEADER, "shadow_header": SHADOW_HEADER,
            "points": ARM_POINTS, "max_json_depth": MAX_JSON_DEPTH}


def lua_source(which: LuaFilter) -> str:
    """The Lua source Envoy runs for ``which`` (:func:`ensemble.fleet.lua_filters.program`)."""
    return lua_filters.program(("arm", which.value), lua_config())


def _has_lua(gateway: Gateway) -> bool:
    """Whether the gRPC listener carries the pinning filter (routes that change, or a pinned release)."""
    return gateway.release is not None or gateway.routes_dir is not None


def _arm_metadata(gateway: Gateway, path: str | None) -> dict:
    """A route's metadata for the Lua filters (``lua/arm.lua``): the serving release, and during an
    experiment the arms and key; ``path``: the HTTP path the arm's version is appended to."""
    meta = {"release": str(gateway.release)}
    if gateway.arms:
        meta["arms"] = ";".join(f"{r}:{upto}" for r, upto in arm_bounds(gateway.release, gateway.arms)[:-1])
        meta["key"] = gateway.arm_key or ""
        if gateway.shadow:
            meta["shadow"] = str(round(gateway.shadow * ARM_POINTS / 100))
            meta["candidates"] = ",".join(str(r) for r, _ in gateway.arms)
        if path is not None:
            meta["path"] = path
    return {"metadata": {"filter_metadata": {LUA_FILTER: meta}}}


def _lua_off(route: dict) -> dict:
    return {**route, "typed_per_filter_config": {LUA_FILTER: {
        "@type": _TYPES + "extensions.filters.http.lua.v3.LuaPerRoute", "disabled": True}}}


def _pinned(route: dict, gateway: Gateway, grpc: bool) -> dict:
    """``route`` (a forwarded one) sending unversioned ranker requests to ``gateway.release``."""
    if gateway.release is None:
        return _lua_off(route) if grpc and _has_lua(gateway) else route
    if grpc:
        return {**route, **_arm_metadata(gateway, None)}
    if gateway.arms:  # the Lua filter rewrites the path to the request's arm
        return {**route, **_arm_metadata(gateway, f"/v2/models/{schema.Model.RANKER.value}/versions/")}
    return {**route, "route": {**route["route"],
                               "prefix_rewrite": f"/v2/models/{schema.Model.RANKER.value}/versions/{gateway.release}/infer"}}


def _http_routes(gateway: Gateway) -> list[dict]:
    return [
        # refused on its headers, before a byte of the body is read: a client that waits for
        # `100 Continue` (curl with a large body) then sends none of it
        {"match": {"prefix": "/", "headers": [{"name": "content-length", "range_match": {
            "start": gateway.max_request_bytes + 1, "end": 2**62}}]},
         **_refuse(413, f"refused at the gateway: the body is larger than {gateway.max_request_bytes} bytes\n")},
        # gzip bodies are inflated by the decompressor filter, within its ratio; any other encoding is refused
        {"match": {"prefix": "/", "headers": [{"name": "content-encoding", "invert_match": True,
                                               "string_match": {"exact": "gzip"}}]},
         **_refuse(415, "refused at the gateway: only gzip or unencoded bodies are accepted\n")},
        *({"match": {"path": path}, "route": _forward("replicas_http", gateway, grpc=False)}
          for path in HTTP_CLIENT_PATHS),
        {"match": {"safe_regex": {"regex": HTTP_STATS_PATHS}},
         "route": _forward("replicas_http_stats", gateway, grpc=False)},
        *([_pinned({"match": {"path": schema.RANKER_INFER_PATH}, "route": _forward("replicas_http", gateway, False)},
                   gateway, grpc=False)] if gateway.release is not None else []),
        # during an experiment a ranking request carries its arm's release (the rank model scores with it)
        *([{"match": {"path": f"/v2/models/{schema.RANK_MODEL}/infer"},
            "route": _forward("replicas_http", gateway, grpc=False), **_arm_metadata(gateway, None)}]
          if gateway.arms else []),
        {"match": {"safe_regex": {"regex": HTTP_MODEL_PATHS}},
         "route": _forward("replicas_http", gateway, grpc=False)},
        {"match": {"prefix": "/"}, **_refuse(403, REFUSED_TEXT)},
    ]


def _grpc_routes(gateway: Gateway) -> list[dict]:
    paths = [f"/{GRPC_SERVICE}/{method}" for method in GRPC_CLIENT_METHODS] + ["/grpc.health.v1.Health/Check"]
    return [
        # Triton's gRPC server inflates compressed messages without a bound; the gateway cannot bound them
        {"match": {"prefix": "/", "headers": [{"name": "grpc-encoding", "invert_match": True,
                                               "string_match": {"exact": "identity"}}]},
         **_refuse(404, "refused at the gateway: send gRPC messages uncompressed\n")},
        *(_grpc_route(path, gateway) for path in paths),
        {"match": {"prefix": "/"}, **_refuse(403, REFUSED_TEXT)},
    ]


def _grpc_route(path: str, gateway: Gateway) -> dict:
    route = {"match": {"path": path, "grpc": {}},
             "route": _forward("replicas_grpc_stats" if path.endswith(GRPC_STATS_METHOD) else "replicas_grpc",
                               gateway, grpc=True)}
    if path.endswith("/ModelInfer"):
        return _pinned(route, gateway, grpc=True)
    return _lua_off(route) if _has_lua(gateway) else route


class GrpcStatus(IntEnum):
    """The gRPC status codes the gateway answers with itself (numbered as in gRPC's status.h)."""

    INVALID_ARGUMENT = 3
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    UNAVAILABLE = 14


# What each HTTP status the gateway answers itself means to a gRPC client: a request Envoy will not
# take (400: an encoded slash in the path), a closed route (403), a compressed message or body (404,
# 415: gRPC's status for a compression the server does not take), the size limit (413), the overload
# bound and no healthy replica (503). Left to itself, Envoy gives a local reply to a gRPC request the
# grpc-status of its own table, which sends 413 to UNKNOWN and 400 to INTERNAL: statuses that
# clients and retry policies cannot act on.
GRPC_STATUS_OF_REFUSAL = {400: GrpcStatus.INVALID_ARGUMENT, 403: GrpcStatus.PERMISSION_DENIED,
                          404: GrpcStatus.UNIMPLEMENTED, 413: GrpcStatus.RESOURCE_EXHAUSTED,
                          415: GrpcStatus.UNIMPLEMENTED, 503: GrpcStatus.UNAVAILABLE}
GRPC_CONTENT_TYPE = r"application/grpc([+;].*)?"  # the requests Envoy answers in gRPC's form


def _local_replies(gateway: Gateway) -> dict:
    """The ``local_reply_config`` of a listener: a gRPC request the gateway refuses itself gets the
    grpc-status its HTTP status means (:data:`GRPC_STATUS_OF_REFUSAL`), and one past the size limit
    is told the limit. Answers to HTTP requests, and the replicas' own answers, are left as they are."""
    mappers = []
    for status, grpc_status in GRPC_STATUS_OF_REFUSAL.items():
        mapper = {"filter": {"and_filter": {"filters": [
                      {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                          "default_value": status, "runtime_key": f"gateway.grpc_status_of_{status}"}}}},
                      {"header_filter": {"header": {"name": "content-type", "string_match": {
                          "safe_regex": {"regex": GRPC_CONTENT_TYPE}}}}}]}},
                  "headers_to_add": [{"header": {"key": "grpc-status", "value": str(int(grpc_status))},
                                      "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}
        if status == 413:
            mapper["body"] = {"inline_string": f"refused at the gateway: the message is larger than "
                                               f"{gateway.max_request_bytes} bytes"}
        mappers.append(mapper)
    return {"mappers": mappers}


def _switch(key: str, on: bool) -> dict:
    return {"default_value": on, "runtime_key": key}


def _connection_manager(name: str, gateway: Gateway, grpc: bool) -> dict:
    filters = []
    if not grpc:
        filters.append({"name": "envoy.filters.http.decompressor", "typed_config": {
            "@type": _TYPES + "extensions.filters.http.decompressor.v3.Decompressor",
            "decompressor_library": {"name": "gzip", "typed_config": {
                "@type": _TYPES + "extensions.compression.gzip.decompressor.v3.Gzip",
                "max_inflate_ratio": MAX_INFLATE_RATIO}},
            "request_direction_config": {"common_config": {"enabled": _switch("gateway.inflate_requests", True)},
                                         "advertise_accept_encoding": False},
            "response_direction_config": {"common_config": {"enabled": _switch("gateway.inflate_responses", False)}}}})
    filters.append({"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": _TYPES + "extensions.filters.http.buffer.v3.Buffer",
        "max_request_bytes": gateway.max_request_bytes}})
    if grpc and _has_lua(gateway):
        filters.append({"name": LUA_FILTER, "typed_config": {
            "@type": _TYPES + "extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua_source(LuaFilter.PIN_VERSION)}}})
    if not grpc:
        filters.append({"name": LUA_FILTER, "typed_config": {
            "@type": _TYPES + "extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua_source(LuaFilter.CLIENT_ERROR)}}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": _TYPES + "extensions.filters.http.router.v3.Router"}})
    if gateway.routes_dir is not None:
        routes = {"rds": {"route_config_name": name, "config_source": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(_routes_file(gateway.routes_dir, name)),
                                   "watched_directory": {"path": str(gateway.routes_dir)}}}}}
    else:
        routes = {"route_config": route_config(name, gateway, grpc)}
    return {
        "@type": _TYPES + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "codec_type": "HTTP2" if grpc else "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "request_headers_timeout": "10s",
        "common_http_protocol_options": {"idle_timeout": "300s", "headers_with_underscores_action": "REJECT_REQUEST"},
        "local_reply_config": _local_replies(gateway),
        **routes,
        "http_filters": filters,
    }


def route_config(name: str, gateway: Gateway, grpc: bool) -> dict:
    """The routes of the listener ``name`` (``http`` or ``grpc``)."""
    host = {"name": name, "domains": ["*"], "routes": _grpc_routes(gateway) if grpc else _http_routes(gateway)}
    if not (gateway.arms and gateway.shadow):  # a client's own shadow header goes (else the Lua filters remove it)
        host["request_headers_to_remove"] = [SHADOW_HEADER]
    if gateway.release is not None and not gateway.arms:  # during an experiment the Lua filter sets it per request
        host["request_headers_to_add"] = [{"header": {"key": RELEASE_HEADER, "value": str(gateway.release)},
                                           "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    return {"name": name, "virtual_hosts": [host]}


def _routes_file(directory: str | Path, name: str) -> Path:
    return Path(directory) / f"routes-{name}.json"


def routes_version(release: int | None, arms: tuple[tuple[int, float], ...] = (), key: str | None = None,
                   shadow: float = 0.0) -> str:
    """The ``version_info`` a routes file pinned to ``release`` (with an experiment's ``arms``,
    ``key`` and ``shadow``) carries (Envoy reports it once applied)."""
    if release is None:
        return "unpinned"
    if not arms:
        return f"release-{release}"
    return (f"experiment-{release}-" + "-".join(f"{r}x{p:g}" for r, p in arms) + (f"-by-{key}" if key else "")
            + (f"-shadow-{shadow:g}" if shadow else ""))


def write_routes(gateway: Gateway) -> list[Path]:
    """Write both listeners' routes of ``gateway`` (its ``release``) into ``gateway.routes_dir``,
    each file replaced by a rename: Envoy reads the new file whole and every request it takes after
    that uses the new routes."""
    if gateway.routes_dir is None:
        raise GatewayError("this gateway's routes are part of its bootstrap: no routes_dir to write")
    gateway.check()
    directory = Path(gateway.routes_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, grpc in (("http", False), ("grpc", True)):
        target = _routes_file(directory, name)
        tmp = directory / f".{target.name}.tmp"
        version = routes_version(gateway.release, gateway.arms, gateway.arm_key, gateway.shadow)
        tmp.write_text(json.dumps({"version_info": version, "resources": [
            {"@type": _TYPES + "config.route.v3.RouteConfiguration", **route_config(name, gateway, grpc)}]}))
        os.replace(tmp, target)
        written.append(target)
    return written


def _listener(name: str, port: int, gateway: Gateway, grpc: bool) -> dict:
    return {"name": name, "address": _address(gateway.host, port),
            "per_connection_buffer_limit_bytes": 1 << 20,
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": _connection_manager(name, gateway, grpc)}]}]}


METRICS_PATH = "/metrics"
METRICS_BODY_BYTES = 4096  # a metrics request has no body: anything larger is refused at the gateway


def _metrics_listener(gateway: Gateway) -> dict:
    """``GET /metrics`` of the one replica, on the gateway's ``metrics_port``; anything else 404."""
    routes = [{"match": {"path": METRICS_PATH, "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
               "route": {"cluster": "replica_metrics", "timeout": "10s"}},
              {"match": {"prefix": "/"}, "direct_response": {
                  "status": 404, "body": {"inline_string": f"only GET {METRICS_PATH} is served on this port\n"}}}]
    manager = {
        "@type": _TYPES + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "metrics", "codec_type": "HTTP1", "use_remote_address": True, "normalize_path": True,
        "request_headers_timeout": "10s", "common_http_protocol_options": {"idle_timeout": "60s"},
        "route_config": {"name": "metrics", "virtual_hosts": [{"name": "metrics", "domains": ["*"], "routes": routes}]},
        "http_filters": [{"name": "envoy.filters.http.buffer", "typed_config": {
                              "@type": _TYPES + "extensions.filters.http.buffer.v3.Buffer",
                              "max_request_bytes": METRICS_BODY_BYTES}},
                         {"name": "envoy.filters.http.router", "typed_config": {
                              "@type": _TYPES + "extensions.filters.http.router.v3.Router"}}]}
    return {"name": "metrics", "address": _address(gateway.host, gateway.metrics_port),
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": manager}]}]}


def _metrics_cluster(gateway: Gateway) -> dict:
    replica = gateway.replicas[0]
    return {"name": "replica_metrics", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "replica_metrics", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(replica.host, replica.metrics_port)}}]}]}}


def envoy_config(gateway: Gateway) -> dict:
    """The Envoy bootstrap of ``gateway`` (see the module docstring); raises :class:`GatewayError`."""
    gateway.check()
    metrics = gateway.metrics_port is not None
    return {
        "node": {"id": "gateway", "cluster": "ensemble-gateway"},  # file-based route discovery needs both
        "admin": {"address": _address("127.0.0.1", gateway.admin_port)},
        "static_resources": {
            "listeners": [_listener("http", gateway.http_port, gateway, grpc=False),
                          _listener("grpc", gateway.grpc_port, gateway, grpc=True),
                          *([_metrics_listener(gateway)] if metrics else [])],
            "clusters": [_cluster("replicas_http", gateway, grpc=False),
                         _cluster("replicas_grpc", gateway, grpc=True),
                         _cluster("replicas_http_stats", gateway, grpc=False, pinned=True),
                         _cluster("replicas_grpc_stats", gateway, grpc=True, pinned=True),
                         *([_metrics_cluster(gateway)] if metrics else [])],
        },
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": _TYPES + "extensions.resource_monitors.downstream_connections.v3."
                                               "DownstreamConnectionsConfig",
                             "max_active_downstream_connections": 10_000}}]},
    }
