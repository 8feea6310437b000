"""`ensemble serve --replicas 2`: two real tritonservers (fused layout) behind a real Envoy gateway,
on free ports.

One fleet serves the whole module (started through the command line, as a user would); the last
test shuts it down and checks the drain. Each replica's share of the traffic is read from Triton's
own statistics: a test sends requests of a batch size nothing else sends (the supervisors' probes are
1-row requests straight to the replicas), and counts the executions of that batch size.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ensemble import schema
from ensemble.operate import processes
from ensemble.operate.control import admin_headers
from ensemble.base.machine import free_port
from tests.helpers import fleet_ports, fresh_rows, http_announce, start_serving, stop_serving

REPLICA_LINE = re.compile(r"replica (\d+): HTTP http://([\d.]+:\d+)\s+gRPC grpc://([\d.]+:\d+)")
STARTUP_SECONDS = 420  # two replicas starting together on a busy 2-core machine


@dataclass
class Fleet:
    process: subprocess.Popen
    http: str  # the gateway's public addresses
    grpc: str
    replicas: list[tuple[str, str]]  # each replica's (HTTP, gRPC) address
    output: list[str]
    log: Path

    def replica_pid(self, index: int) -> int | None:
        """The tritonserver process of replica ``index`` (found by its HTTP port on its command line)."""
        port = self.replicas[index][0].rsplit(":", 1)[1]
        for pid in processes.tree(self.process.pid)[1:]:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(b"tritonserver") for arg in cmdline[:1]) and f"--http-port={port}".encode() in cmdline:
                return pid
        return None

    def text(self) -> str:
        return "\n".join(self.output)


@pytest.fixture(scope="module")
def fleet(trained, tmp_path_factory):
    log = tmp_path_factory.mktemp("fleet") / "serve.log"
    http, grpc, metrics = fleet_ports(2)
    # the fused layout: its ranker is a python-backend process of its own, which a test kills
    process, output = start_serving(["--repository", str(trained.repository), "--replicas", "2", "--layout", "fused",
                                     "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                     "--log-file", str(log)], timeout=STARTUP_SECONDS)
    replicas = sorted((int(m.group(1)), m.group(2), m.group(3)) for m in map(REPLICA_LINE.match, output) if m)
    started = Fleet(process, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", [(h, g) for _, h, g in replicas], output, log)
    yield started
    if process.poll() is None:  # the last test stops it itself
        stop_serving(process)


def _rows(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    dense, categorical = fresh_rows(rows, seed)  # with edge-case rows after the first ``rows``
    return dense[:rows], categorical[:rows]


def _inputs(module, rows: int, seed: int):
    return _tensors(module, *_rows(rows, seed))


def _tensors(module, dense: np.ndarray, categorical: np.ndarray):
    d = module.InferInput(schema.DENSE.name, list(dense.shape), "FP32")
    d.set_data_from_numpy(dense)
    c = module.InferInput(schema.CATEGORICAL.name, list(categorical.shape), "BYTES")
    c.set_data_from_numpy(categorical)
    return [d, c]


def _executions(replica_http: str, batch_size: int) -> int:
    """How many times replica's ranker executed a batch of exactly ``batch_size`` rows (its statistics)."""
    with urllib.request.urlopen(f"http://{replica_http}/v2/models/ranker/stats", timeout=30) as reply:
        stats = json.load(reply)
    return sum(int(b["compute_infer"]["count"]) for m in stats["model_stats"] for b in m.get("batch_stats", [])
               if int(b["batch_size"]) == batch_size)


def _post(address: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{address}{path}", body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _ready(replica_http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{replica_http}/v2/models/ranker/ready", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _rss(fleet: Fleet) -> int:
    """Resident memory of both replicas and their backend processes."""
    return sum(processes.rss(pid) for i in range(len(fleet.replicas))
               for pid in processes.tree(fleet.replica_pid(i) or -1) if pid > 0)


def test_one_replica_is_one_server_without_a_gateway(trained):
    """``--replicas 1`` is ``ensemble serve`` as it always was: one tritonserver on the named ports."""
    http, grpc, metrics = fleet_ports(2)
    process = subprocess.Popen([sys.executable, "-m", "ensemble", "serve", "--repository", str(trained.repository),
                                "--replicas", "1", "--http-port", str(http), "--grpc-port", str(grpc),
                                "--metrics-port", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        if not line.startswith(f"ready: HTTP http://127.0.0.1:{http}  gRPC grpc://127.0.0.1:{grpc}"):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
            pytest.fail(f"no ready line: {line!r}, exit code {process.poll()}\n{process.stderr.read()}")
        names = []
        for pid in processes.tree(process.pid)[1:]:
            try:
                names.append(Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name)
            except OSError:
                continue
        assert names.count("tritonserver") == 1 and "envoy" not in names, names
        assert _ready(f"127.0.0.1:{http}")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_requests_are_balanced_over_the_replicas(fleet, pipeline):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    assert len(fleet.replicas) == 2
    for module, address, rows in ((httpclient, fleet.http, 3), (grpcclient, fleet.grpc, 5)):
        dense, categorical = _rows(60 * rows, rows)
        expected = pipeline.score(dense, categorical)[schema.SCORE.name].reshape(60, rows)
        before = [_executions(http, rows) for http, _ in fleet.replicas]
        client = module.InferenceServerClient(address)
        for i in range(60):
            part = slice(i * rows, (i + 1) * rows)
            inputs = _tensors(module, dense[part], categorical[part])
            score = client.infer("ranker", inputs).as_numpy(schema.SCORE.name).reshape(-1)
            np.testing.assert_allclose(score, expected[i], rtol=1e-5, atol=1e-6)
        shares = [_executions(http, rows) - b for (http, _), b in zip(fleet.replicas, before)]
        assert sum(shares) == 60, shares
        assert min(shares) >= 10, f"{module.__name__}: per-replica executions {shares}"  # binomial(60, 1/2) < 10: ~1e-7


def test_model_control_is_refused_at_the_gateway(fleet):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for path in ("/v2/repository/models/ranker/load", "/v2/repository/models/ranker/unload", "/v2/repository/index",
                 "/v2//repository/index", "/v2/models/ranker/../../repository/index"):
        status, reply = _post(fleet.http, path, b"{}")
        assert status == 403 and b"refused at the gateway" in reply, (path, status, reply)
    client = grpcclient.InferenceServerClient(fleet.grpc)
    for call in (lambda: client.load_model("ranker"), lambda: client.unload_model("ranker"),
                 client.get_model_repository_index):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED", refused.value
    # nothing changed, and the operator (with the key) still reaches model control on a replica's own port
    assert client.is_model_ready("ranker")
    status, reply = _post(fleet.replicas[0][0], "/v2/repository/index", b"{}", admin_headers(grpc=False))
    assert status == 200 and any(m["name"] == "ranker" and m.get("state") == "READY" for m in json.loads(reply))


def test_oversized_bodies_and_gzip_bombs_are_refused_before_the_replicas(fleet):
    dense, categorical = _rows(2, 7)
    body = schema.v2_json_request(dense, categorical)
    status, plain = _post(fleet.http, schema.RANKER_INFER_PATH, body)
    assert status == 200
    status, packed = _post(fleet.http, schema.RANKER_INFER_PATH, gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(packed)["outputs"] == json.loads(plain)["outputs"]

    rss = _rss(fleet)
    bomb = gzip.compress(b" " * (256 * 2**20), 9)  # about 255 KB that inflates to 256 MiB
    status, reply = _post(fleet.http, schema.RANKER_INFER_PATH, bomb, {"Content-Encoding": "gzip"})
    assert status == 413, (status, reply[:200])
    # a client that announces its 20 MiB body and waits for `100 Continue` before sending it
    status, reply = http_announce(fleet.http, schema.RANKER_INFER_PATH, 20 * 2**20)
    assert status == 413, (status, reply[:200])
    status, reply = _post(fleet.http, schema.RANKER_INFER_PATH, body, {"Content-Encoding": "deflate"})
    assert status == 415, (status, reply[:200])
    grown = _rss(fleet) - rss
    assert grown < 50 * 2**20, f"replicas grew by {grown / 2**20:.0f} MiB"  # the bomb inside Triton: ~217 MiB

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(fleet.grpc)
    with pytest.raises(InferenceServerException) as refused:  # Triton would inflate it without a bound
        client.infer("ranker", _tensors(grpcclient, dense, categorical), compression_algorithm="gzip")
    assert refused.value.status() == "StatusCode.UNIMPLEMENTED", refused.value
    client.infer("ranker", _tensors(grpcclient, dense, categorical))


def test_the_gateway_refuses_past_its_bound_before_the_replica(server, tmp_path):
    """A gateway with room for 2 requests in flight, in front of the session's real server: of 24
    concurrent 2,048-row requests, those past the bound get 503 from Envoy itself (it says so in
    ``x-envoy-overloaded``), the replica's deadline refusals aside; HTTP and gRPC alike."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from ensemble.fleet.envoy import Envoy
    from ensemble.fleet.gateway import Gateway, Replica

    gateway = Gateway((Replica(server.options.http_port, server.options.grpc_port),), http_port=free_port(),
                      grpc_port=free_port(), admin_port=free_port(), max_requests=2)
    envoy = Envoy(gateway, log_file=tmp_path / "envoy.log").start()
    try:
        dense, categorical = _rows(2048, 9)
        body = schema.v2_json_request(dense, categorical)
        answers: list[tuple[int, str]] = []

        def send() -> None:
            request = urllib.request.Request(f"http://127.0.0.1:{gateway.http_port}{schema.RANKER_INFER_PATH}", body)
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    answers.append((reply.status, ""))
            except urllib.error.HTTPError as exc:
                answers.append((exc.code, exc.headers.get("x-envoy-overloaded", "")))

        workers = [threading.Thread(target=send) for _ in range(24)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert {status for status, _ in answers} <= {200, 503}, answers
        assert any(status == 200 for status, _ in answers), answers
        assert ("503", "true") in {(str(status), flag) for status, flag in answers}, answers

        grpc_errors: list[str] = []
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.grpc_port}")
        inputs = _tensors(grpcclient, dense, categorical)
        done = threading.Barrier(24)

        def infer() -> None:
            done.wait()
            try:
                client.infer("ranker", inputs, client_timeout=120)
            except InferenceServerException as exc:
                grpc_errors.append(str(exc.status()))

        workers = [threading.Thread(target=infer) for _ in range(24)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert grpc_errors and set(grpc_errors) == {"StatusCode.UNAVAILABLE"}, grpc_errors
        overflow = envoy.stats("cluster[.]replicas_grpc[.]upstream_rq_(active|pending)_overflow")
        assert sum(overflow.values()) > 0, overflow  # refused by the gateway, not (only) by the replica
        assert httpclient.InferenceServerClient(server.http_url).is_model_ready("ranker")
    finally:
        envoy.stop()


def _closed_loop(module, address: str, threads: int, seconds: float) -> tuple[int, list[str]]:
    """``threads`` plain tritonclient clients (no retries), each sending 1-row requests back to back."""
    done, errors = [0] * threads, []
    stop = time.monotonic() + seconds

    def loop(index: int) -> None:
        client = module.InferenceServerClient(address)
        inputs = _inputs(module, 1, index)
        while time.monotonic() < stop:
            try:
                client.infer("ranker", inputs)
                done[index] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append(repr(exc)[:300])

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done), errors


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ordinary_concurrent_load_is_never_refused(fleet, protocol):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module, address = (httpclient, fleet.http) if protocol == "http" else (grpcclient, fleet.grpc)
    done, errors = _closed_loop(module, address, threads=32, seconds=4)
    assert errors == [] and done > 0, errors[:5]


class _LightLoad:
    """One HTTP and one gRPC plain tritonclient client (no retries), each sending ``rows``-row
    requests about every 10 ms until the block ends; ``errors`` holds every failure."""

    def __init__(self, fleet: Fleet, rows: int):
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        self.errors: list[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._loop, args=(module, address, rows))
                         for module, address in ((httpclient, fleet.http), (grpcclient, fleet.grpc))]

    def _loop(self, module, address: str, rows: int) -> None:
        client = module.InferenceServerClient(address)
        inputs = _inputs(module, rows, 3)
        while not self._stop.is_set():
            try:
                client.infer("ranker", inputs)
                self.sent += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported, with what the server said
                status = getattr(exc, "status", lambda: None)()
                self.errors.append(f"{module.__name__.rsplit('.', 1)[-1]} {type(exc).__name__} {status}: {exc}"[:300])
            time.sleep(0.01)

    def __enter__(self) -> "_LightLoad":
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join()


def test_perf_analyzer_through_the_gateway_measures_without_an_error(fleet):
    """Triton's benchmark client reads the model's statistics around every window and takes the
    difference: through the gateway they must come from one replica (a balanced read mixes two
    servers' counters and perf_analyzer fails). Errors are what this checks, not figures."""
    from loadtest import perf_analyzer

    tool = perf_analyzer.install()
    for protocol, url in (("http", fleet.http), ("grpc", fleet.grpc)):
        point = perf_analyzer.measure(tool, url, protocol, rows=100, concurrency=8, window_ms=1000,
                                      stability_percent=10_000)
        assert point.measured, point.error


def test_a_killed_backend_process_costs_no_request(fleet):
    """The ranker's python-backend process of replica 1 is SIGKILLed: Triton answers "not healthy"
    until the supervisor unloads and reloads the ranker, and "no available versions" meanwhile; the
    gateway retries both on replica 0."""
    healed = sum("replica 1: ranker reloaded" in line for line in fleet.output)
    with _LightLoad(fleet, rows=6) as load:
        time.sleep(1)
        stub = processes.stub_pids(fleet.replica_pid(1)).get("ranker")
        assert stub is not None, fleet.text()
        os.kill(stub, signal.SIGKILL)
        deadline = time.monotonic() + STARTUP_SECONDS
        while sum("replica 1: ranker reloaded" in line for line in fleet.output) == healed:
            assert time.monotonic() < deadline, f"replica 1 not healed:\n{fleet.text()}"
            time.sleep(0.5)
        time.sleep(2)
    assert load.errors == [], load.errors[:5]
    assert load.sent > 0


def test_a_killed_replica_costs_no_request_and_comes_back(fleet):
    rows = 7
    with _LightLoad(fleet, rows) as load:
        time.sleep(1)
        victim = fleet.replica_pid(0)
        assert victim is not None, fleet.text()
        os.kill(victim, signal.SIGKILL)
        back = time.monotonic() + STARTUP_SECONDS
        while not (fleet.replica_pid(0) not in (None, victim) and _ready(fleet.replicas[0][0])):
            assert time.monotonic() < back, f"replica 0 not back:\n{fleet.text()}"
            time.sleep(0.5)
        # back in rotation: the restarted replica executes the load's requests again
        served = time.monotonic() + 120
        while _executions(fleet.replicas[0][0], rows) < 5:
            assert time.monotonic() < served, f"replica 0 gets no traffic:\n{fleet.text()}"
            time.sleep(0.5)
    assert load.errors == [], load.errors[:5]
    assert load.sent > 0
    # The supervisor says so once its start() returns, which also reloads the ranker with the
    # served overrides: the replica already answers (above) while that reload runs.
    said = time.monotonic() + 120
    while not any("replica 0: tritonserver ready again" in line for line in fleet.output):
        assert time.monotonic() < said, fleet.text()
        time.sleep(0.5)


def test_a_killed_gateway_is_started_again(fleet):
    import tritonclient.http as httpclient

    def configs() -> dict[int, str]:  # each gateway process and the config file it was started with
        return processes.arguments_ending(fleet.process.pid, "envoy.json")

    envoys = configs()
    assert len(envoys) == 1, fleet.text()
    (victim, config), = envoys.items()
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not any("gateway ready again" in line for line in fleet.output):
        assert time.monotonic() < deadline, fleet.text()
        time.sleep(0.2)
    client = httpclient.InferenceServerClient(fleet.http)
    assert client.infer("ranker", _inputs(httpclient, 2, 4)).as_numpy(schema.SCORE.name).shape == (2, 1)
    # started again from the same folder, which its shutdown removes (a second folder was left behind)
    assert list(configs().values()) == [config], (config, configs())


def test_shutdown_drains_requests_in_flight(fleet):
    """Last in the module: SIGTERM while large requests are in flight; every one is answered, then
    the gateway's ports close and every replica process is gone."""
    import tritonclient.http as httpclient

    answers: list[str] = []
    replicas = [fleet.replica_pid(i) for i in range(len(fleet.replicas))]
    started = threading.Barrier(5)
    rows = _rows(schema.MAX_BATCH_SIZE, 5)

    def big() -> None:
        client = httpclient.InferenceServerClient(fleet.http, network_timeout=300, connection_timeout=300)
        inputs = _tensors(httpclient, *rows)
        started.wait()
        try:
            answers.append(str(client.infer("ranker", inputs).as_numpy(schema.SCORE.name).shape))
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            answers.append(repr(exc)[:300])

    workers = [threading.Thread(target=big) for _ in range(4)]
    for worker in workers:
        worker.start()
    started.wait()
    time.sleep(0.5)  # the bodies are on their way (about 4 MB each)
    fleet.process.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join()
    assert fleet.process.wait(120) == 0, fleet.text()
    assert answers == [f"({schema.MAX_BATCH_SIZE}, 1)"] * 4, answers
    assert fleet.output[-1] == "stopped"
    gone = time.monotonic() + 30
    while any(pid is not None and Path(f"/proc/{pid}").exists() for pid in replicas):
        assert time.monotonic() < gone, "a replica outlived the fleet"
        time.sleep(0.2)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{fleet.http}/v2/health/ready", timeout=5)
