"""The Kubernetes manifests (deploy/kubernetes): generated from one source and committed as generated,
valid against pinned Kubernetes schemas (core kinds, kubernetes-validate) and Envoy (the gateway's
config, ``envoy --mode validate``), custom resources with their required fields, and consistent with
each other and with the server: ports, probe paths, selectors, the autoscaler's metric, drain times.
No cluster runs here."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ensemble import cli
from ensemble.fleet import kubernetes as k8s
from ensemble.fleet.envoy import validate as envoy_validate
from ensemble.fleet.gateway import Gateway, GatewayError, Replica
from ensemble.fleet.envoy_config import envoy_config
from ensemble.operate.monitoring import dashboard_metric_names, promql_metric_names

# The oldest and the newest Kubernetes minor the manifests are checked against (schemas shipped in the
# kubernetes-validate wheel pinned in requirements.txt).
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
CUSTOM_KINDS = {"ServiceMonitor", "InferenceService", "ServingRuntime", "Kustomization"}


def _documents() -> dict[str, list[dict]]:
    return {path: list(yaml.safe_load_all(text)) for path, text in k8s.rendered().items()}


def _all() -> list[dict]:
    return [d for docs in _documents().values() for d in docs]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _all() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_committed_files_are_the_generator_output():
    """deploy/kubernetes holds exactly what the generator writes; edit ensemble/fleet/kubernetes.py instead."""
    expected = k8s.rendered()
    committed = {p.relative_to(k8s.FOLDER).as_posix(): p.read_text() for p in k8s.FOLDER.rglob("*") if p.is_file()}
    assert sorted(committed) == sorted(expected), f"files differ: regenerate with `{k8s.COMMAND}`"
    stale = [path for path, text in expected.items() if committed[path] != text]
    assert not stale, f"{stale} differ from the generator: regenerate with `{k8s.COMMAND}`"


def test_the_base_is_the_serving_shape_only():
    kustomization = _documents()["kustomization.yaml"][0]
    assert kustomization["resources"] == list(k8s.BASE)
    assert all((k8s.FOLDER / path).is_file() for path in kustomization["resources"])
    assert not [p for p in kustomization["resources"] if p.startswith(("kserve/", "prometheus-adapter/"))]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", sorted(k8s.files()))
def test_core_kinds_validate_against_the_kubernetes_schema(path, version):
    """Strict: an unknown field fails as well as a wrong type or a missing required field."""
    checked = 0
    for document in k8s.files()[path]:
        if document["kind"] in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # no schema: checked below instead
                kubernetes_validate.validate(document, version, strict=True)
            continue
        kubernetes_validate.validate(document, version, strict=True)
        checked += 1
    assert checked or all(d["kind"] in CUSTOM_KINDS for d in k8s.files()[path])


def test_the_validator_refuses_a_broken_manifest():
    deployment = k8s.triton_deployment(k8s.Shape())
    _container(deployment)["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    deployment = k8s.triton_deployment(k8s.Shape())
    _container(deployment)["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_service_monitors_have_what_the_prometheus_operator_requires():
    """ServiceMonitor (monitoring.coreos.com/v1) is a custom resource: no schema in kubernetes-validate."""
    services = [d for d in _all() if d["kind"] == "Service"]
    monitors = [d for d in _all() if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"ranker-triton", "ranker-gateway"}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"]
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [s for s in services if _selects(selector, s["metadata"]["labels"])]
        assert len(selected) == 1, monitor["metadata"]["name"]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
        assert endpoint["path"].startswith("/") and endpoint["interval"].endswith("s")
    paths = {m["metadata"]["name"]: m["spec"]["endpoints"][0]["path"] for m in monitors}
    assert paths == {"ranker-triton": "/metrics", "ranker-gateway": k8s.GATEWAY_METRICS_PATH}


def test_kserve_example_has_the_required_fields_and_serves_the_same_way():
    """InferenceService (serving.kserve.io/v1beta1) and ServingRuntime (v1alpha1) are custom resources."""
    service = _documents()["kserve/inference-service.yaml"][0]
    runtime = _documents()["kserve/serving-runtime.yaml"][0]
    assert service["apiVersion"] == "serving.kserve.io/v1beta1" and service["kind"] == "InferenceService"
    model = service["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] and model["storageUri"].startswith("pvc://")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1" and runtime["kind"] == "ServingRuntime"
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # KServe finds the model server by this name
    args = cli.build_parser().parse_args(container["args"])
    assert args.repository == "/mnt/models"  # where KServe mounts storageUri
    assert {p["containerPort"] for p in container["ports"]} == {args.http_port, args.grpc_port}
    assert container["readinessProbe"]["httpGet"] == {"path": k8s.READY_PATH, "port": args.http_port}


def test_envoy_accepts_the_config_map():
    config = json.loads(_one("ConfigMap", "ranker-gateway")["data"]["envoy.json"])
    envoy_validate(config)


def test_the_gateway_config_is_the_projects_generator_output_for_the_service():
    config = json.loads(_one("ConfigMap", "ranker-gateway")["data"]["envoy.json"])
    generated = envoy_config(k8s.Shape().gateway())
    count = len(generated["static_resources"]["clusters"])
    assert config["static_resources"]["clusters"][:count] == generated["static_resources"]["clusters"]
    count = len(generated["static_resources"]["listeners"])
    assert config["static_resources"]["listeners"][:count] == generated["static_resources"]["listeners"]


def test_the_gateway_resolves_the_headless_service_on_the_triton_ports():
    config = json.loads(_one("ConfigMap", "ranker-gateway")["data"]["envoy.json"])
    triton = _container(_one("Deployment", "ranker-triton"))
    service = _one("Service", "ranker-triton")
    assert service["spec"]["clusterIP"] == "None"  # DNS answers every ready pod's address
    assert _selects(service["spec"]["selector"], _one("Deployment", "ranker-triton")["spec"]["template"]["metadata"]["labels"])
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    wanted = {"replicas_http": _port(triton, "http"), "replicas_grpc": _port(triton, "grpc")}
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] not in wanted:
            continue
        assert cluster["type"] == "STRICT_DNS" and cluster["ignore_health_on_host_removal"] is True
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert address == {"address": name, "port_value": wanted.pop(cluster["name"])}
        assert endpoint["endpoint"]["health_check_config"]["port_value"] == _port(triton, "http")
        (check,) = cluster["health_checks"]
        assert check["http_health_check"]["path"] == triton["readinessProbe"]["httpGet"]["path"] == k8s.READY_PATH
    assert not wanted, f"no cluster for {wanted}"
    for port in service["spec"]["ports"]:
        assert _port(triton, port["targetPort"]) == port["port"]


def test_the_gateway_service_and_container_agree():
    gateway = _one("Deployment", "ranker-gateway")
    container = _container(gateway)
    config = json.loads(_one("ConfigMap", "ranker-gateway")["data"]["envoy.json"])
    listening = {item["name"]: item["address"]["socket_address"]["port_value"]
                 for item in config["static_resources"]["listeners"]}
    assert listening == {"http": _port(container, "http"), "grpc": _port(container, "grpc"),
                         "stats": _port(container, "metrics")}
    service = _one("Service", "ranker")
    assert _selects(service["spec"]["selector"], gateway["spec"]["template"]["metadata"]["labels"])
    for port in service["spec"]["ports"]:
        assert _port(container, port["targetPort"]) == port["port"]
    assert container["command"][container["command"].index("-c") + 1].startswith(
        next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config"))
    assert gateway["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == "ranker-gateway"


def test_probes_and_ports_match_the_server_arguments():
    triton = _container(_one("Deployment", "ranker-triton"))
    args = cli.build_parser().parse_args(triton["args"])
    assert (args.command, args.host, args.repository) == ("serve", "0.0.0.0", k8s.MODELS_MOUNT)
    assert (_port(triton, "http"), _port(triton, "grpc"), _port(triton, "metrics")) == \
        (args.http_port, args.grpc_port, args.metrics_port)
    assert triton["readinessProbe"]["httpGet"] == {"path": "/v2/models/ranker/ready", "port": "http"}
    assert triton["startupProbe"]["httpGet"] == triton["readinessProbe"]["httpGet"]
    assert triton["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = triton["startupProbe"]["periodSeconds"] * triton["startupProbe"]["failureThreshold"]
    assert startup >= 60, "model load takes seconds; a slow node needs far more"


def test_the_repository_is_read_only_and_the_admin_key_comes_from_a_secret():
    pod = _one("Deployment", "ranker-triton")["spec"]["template"]["spec"]
    triton = _container(_one("Deployment", "ranker-triton"))
    (mount,) = [m for m in triton["volumeMounts"] if m["mountPath"] == k8s.MODELS_MOUNT]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"] == {"claimName": _one("PersistentVolumeClaim")["metadata"]["name"],
                                               "readOnly": True}
    (key,) = [e for e in triton["env"] if e["name"] == "ENSEMBLE_ADMIN_KEY"]
    assert "value" not in key and key["valueFrom"]["secretKeyRef"]["name"]
    assert not [d for d in _all() if d["kind"] == "Secret"], "the key is created in the cluster, never committed"
    # the online store's URL (ranking by ids) comes from an optional Secret: pods start without one
    (store,) = [e for e in triton["env"] if e["name"] == k8s.STORE_URL_ENV]
    assert store["valueFrom"]["secretKeyRef"] == {"name": k8s.STORE_SECRET, "key": "url", "optional": True}
    from ensemble import online

    assert k8s.STORE_URL_ENV == online.ENV["url"]


def test_only_the_gateway_and_the_release_job_reach_the_triton_ports():
    policy = _one("NetworkPolicy")
    pods = _one("Deployment", "ranker-triton")["spec"]["template"]["metadata"]["labels"]
    gateway = _one("Deployment", "ranker-gateway")["spec"]["template"]["metadata"]["labels"]
    assert _selects(policy["spec"]["podSelector"]["matchLabels"], pods)
    open_to_all = {p["port"] for rule in policy["spec"]["ingress"] for peer in rule["from"]
                   if "namespaceSelector" in peer for p in rule["ports"]}
    assert open_to_all == {"metrics"}
    serving = next(rule for rule in policy["spec"]["ingress"] if {"port": "http"} in rule["ports"])
    allowed = [peer["podSelector"]["matchLabels"] for peer in serving["from"]]
    assert any(_selects(a, gateway) for a in allowed) and not any(_selects(a, pods) for a in allowed)
    # and the gateway refuses model control whatever reaches it (tests/unit/test_gateway.py checks the routes)
    config = json.loads(_one("ConfigMap", "ranker-gateway")["data"]["envoy.json"])
    http = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert http["route_config"]["virtual_hosts"][0]["routes"][-1]["direct_response"]["status"] == 403


@pytest.mark.parametrize("kind", ["PodDisruptionBudget", "ServiceMonitor", "HorizontalPodAutoscaler"])
def test_selectors_select_the_deployments_pods(kind):
    deployments = {d["metadata"]["name"]: d for d in _all() if d["kind"] == "Deployment"}
    services = [d for d in _all() if d["kind"] == "Service"]
    for item in [d for d in _all() if d["kind"] == kind]:
        if kind == "HorizontalPodAutoscaler":
            target = item["spec"]["scaleTargetRef"]
            assert target["kind"] == "Deployment" and target["name"] in deployments
            assert "replicas" not in deployments[target["name"]]["spec"], "the HPA owns the replica count"
            continue
        selector = item["spec"]["selector"]["matchLabels"]
        if kind == "ServiceMonitor":  # selects Services, whose selector selects pods
            (service,) = [s for s in services if _selects(selector, s["metadata"]["labels"])]
            selector = service["spec"]["selector"]
        chosen = [n for n, d in deployments.items() if _selects(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert chosen == [item["metadata"]["name"]], f"{kind} {item['metadata']['name']} selects {chosen}"


def test_the_autoscaler_metric_is_served_by_the_adapter_from_metrics_triton_exports():
    hpa = _one("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    rules = yaml.safe_load(_one("ConfigMap", "prometheus-adapter")["data"]["config.yaml"])["rules"]
    (rule,) = [r for r in rules if r["name"]["as"] == name]
    used = promql_metric_names(rule["metricsQuery"].replace("<<.LabelMatchers>>", "").replace("<<.GroupBy>>", "pod"))
    used |= promql_metric_names(rule["seriesQuery"])
    # the dashboard's names are the ones tests/integration/test_metrics.py finds on a real tritonserver
    assert used and used <= dashboard_metric_names(), used - dashboard_metric_names()
    assert "nv_inference_queue_duration_us" in used
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # what a Pods metric is looked up by
    assert hpa["spec"]["minReplicas"] >= 2, "one pod cannot be drained without an outage"


def test_drain_timings_leave_room_for_requests_in_flight():
    shape = k8s.Shape()
    triton_pod = _one("Deployment", "ranker-triton")["spec"]["template"]["spec"]
    sleep = int(_container(_one("Deployment", "ranker-triton"))["lifecycle"]["preStop"]["exec"]["command"][-1])
    # CoreDNS answers with a 5 s TTL; the gateway resolves again every dns_refresh seconds
    assert sleep > 5 + shape.dns_refresh_seconds
    assert triton_pod["terminationGracePeriodSeconds"] > sleep + k8s.SERVER_STOP_SECONDS
    gateway_pod = _one("Deployment", "ranker-gateway")["spec"]["template"]["spec"]
    hook = _container(_one("Deployment", "ranker-gateway"))["lifecycle"]["preStop"]["exec"]["command"]
    settle, timeout = float(hook[hook.index("--settle") + 1]), float(hook[hook.index("--timeout") + 1])
    assert gateway_pod["terminationGracePeriodSeconds"] > settle + timeout + 1


def test_a_dns_gateway_may_share_its_ports_with_the_replicas_but_needs_a_positive_refresh():
    shared = Gateway((Replica(8000, 8001, "ranker.example"),), host="0.0.0.0", dns_refresh=1.0)
    shared.check()
    with pytest.raises(GatewayError, match="more than one listener"):
        Gateway((Replica(8000, 8001),), host="0.0.0.0").check()
    with pytest.raises(GatewayError, match="dns_refresh"):
        Gateway((Replica(8000, 8001, "ranker.example"),), dns_refresh=0).check()
    static = envoy_config(Gateway((Replica(18100, 18101),), http_port=18000, grpc_port=18001, admin_port=18002))
    assert {c["type"] for c in static["static_resources"]["clusters"]} == {"STATIC"}


class _Admin(BaseHTTPRequestHandler):
    """Envoy's admin listener as the drain hook sees it: requests in flight fall to 0 after a drain."""

    calls: list[str] = []
    active = [3, 1, 0]

    def do_POST(self):  # noqa: N802 - http.server's name
        self.calls.append(f"POST {self.path}")
        self._answer("OK\n")

    def do_GET(self):  # noqa: N802
        self.calls.append(f"GET {self.path.split('?')[0]}")
        left = self.active.pop(0) if len(self.active) > 1 else self.active[0]
        self._answer(f"http.http.downstream_rq_active: {left}\nhttp.grpc.downstream_rq_active: 0\n")

    def _answer(self, text: str) -> None:
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


# the first case returns as soon as nothing is in flight: its timeout only bounds a slow machine
@pytest.mark.parametrize("active, timeout, left", [([3, 1, 0], 30.0, 0), ([2], 0.5, 2)])
def test_gateway_drain_hook_drains_then_waits_for_requests_in_flight(active, timeout, left):
    _Admin.calls, _Admin.active = [], list(active)
    server = HTTPServer(("127.0.0.1", 0), _Admin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert k8s.drain_gateway(server.server_address[1], settle=0, timeout=timeout, poll=0.01) == left
    finally:
        server.shutdown()
    assert _Admin.calls[:2] == ["POST /drain_listeners?graceful", "POST /drain_listeners"]
    assert set(_Admin.calls[2:]) == {"GET /stats"}


def test_gateway_drain_hook_returns_when_envoy_is_gone():
    assert k8s.drain_gateway(1, settle=0, timeout=1) == 0


def test_write_creates_every_file(tmp_path: Path):
    written = k8s.write(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(k8s.rendered())
    assert all(p.read_text().startswith(k8s.HEADER) for p in written)


def test_the_release_job_writes_the_repository_and_is_admitted_to_the_triton_ports():
    job = _one("Job", "ranker-export")
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = cli.build_parser().parse_args(container["args"])
    assert (args.command, args.repository) == ("export", k8s.MODELS_MOUNT)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == k8s.MODELS_MOUNT]
    assert not mount.get("readOnly")
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == _one("PersistentVolumeClaim")["metadata"]["name"]
    policy = _one("NetworkPolicy")
    assert any(_selects(peer.get("podSelector", {}).get("matchLabels", {}), pod["metadata"]["labels"])
               for rule in policy["spec"]["ingress"] for peer in rule["from"])


def test_another_namespace_reaches_the_dns_name_and_every_manifest(tmp_path: Path):
    assert k8s.main(["--write", str(tmp_path), "--namespace", "ranking", "--image", "registry.example/ensemble:1"]) == 0
    documents = [d for p in tmp_path.rglob("*.yaml") for d in yaml.safe_load_all(p.read_text())]
    spaces = {d["metadata"].get("namespace") for d in documents if d["kind"] not in ("Kustomization", "Namespace")}
    assert spaces == {"ranking", "monitoring"}  # monitoring: prometheus-adapter's own
    gateway = (tmp_path / "gateway.yaml").read_text()
    assert '"address": "ranker-triton.ranking.svc.cluster.local"' in gateway
    assert "image: registry.example/ensemble:1" in (tmp_path / "triton.yaml").read_text()
