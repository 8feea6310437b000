"""A gateway's Envoy bootstrap (what :mod:`ensemble.fleet.gateway` describes and why): its listeners, routes,
clusters, Lua filters and local replies, and the route files a fleet switches releases with."""

from __future__ import annotations

import json
import os
from enum import Enum, IntEnum
from pathlib import Path

from ensemble import schema
from ensemble.fleet import lua_filters
from ensemble.operate.control import RELEASE_HEADER, SHADOW_HEADER

from ensemble.fleet.arms import ARM_POINTS, arm_bounds

from ensemble.fleet.gateway import (GRPC_CLIENT_METHODS, GRPC_SERVICE, GRPC_STATS_METHOD, HTTP_CLIENT_PATHS,
                                     HTTP_MODEL_PATHS, HTTP_STATS_PATHS, MAX_INFLATE_RATIO, REFUSED_TEXT, _TYPES, Gateway,
                                     GatewayError)


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
