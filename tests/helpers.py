"""Helpers shared by tests (not fixtures)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from ensemble import schema
from ensemble.data import criteo
from ensemble.operate import processes
from ensemble.operate.supervise import STOPPED_STATES

# Small enough for CI on 2 cores, big enough that every step trains for real.
SYNTH = criteo.SynthConfig(rows=24_000, scale=0.002, seed=11)
# The admin key of the servers the integration suite starts (tests/integration/conftest.py).
ADMIN_KEY = "integration-admin-key-7d3f"
T = TypeVar("T")


def fresh_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The project's fresh rows at the suite's vocabulary scale, the edge cases added."""
    from ensemble.features.fresh import fresh_rows as rows

    return rows(n, seed, scale=SYNTH.scale, edge_cases=True)


def thread_ticks(pid: int) -> dict[str, tuple[int, int]]:
    """Thread id -> (nice, CPU ticks so far) of every thread of ``pid``, from /proc."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[task.name] = (int(fields[16]), int(fields[11]) + int(fields[12]))  # stat's nice, utime + stime
    return found


def tree_thread_ticks(pid: int) -> dict[str, tuple[int, int]]:
    """:func:`thread_ticks` of ``pid`` and of every process descending from it (a python backend's
    stub processes are tritonserver's children)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    found = {}
    for member in tree:
        try:
            found.update({f"{member}/{tid}": value for tid, value in thread_ticks(member).items()})
        except OSError:
            continue
    return found


def post_infer(base_url: str, body: bytes) -> tuple[int, dict]:
    """POST a v2 JSON inference body to the ranker's infer endpoint under ``base_url``: (status, reply)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base_url}{schema.RANKER_INFER_PATH}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def decodes_as_utf8(value: bytes) -> bool:
    """Whether a categorical value can travel in JSON (which carries text)."""
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def modules_loaded(code: str, watched: tuple[str, ...]) -> list[str]:
    """Run ``code`` in a fresh interpreter; return which of ``watched`` modules it left imported."""
    import subprocess
    import sys

    probe = f"{code}\nimport sys\nprint(','.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


class Load:
    """Four threads sending 1-row requests (HTTP, with the client's retries) until stopped;
    counts what was sent, what failed after the retries, and apart from those what the ranker
    refused (load shedding, ``schema.OVERLOAD_REFUSAL``) when it was the last answer."""

    def __init__(self, url: str, rows, attempts: int = 12):
        self.url, self.dense, self.cats, self.attempts = url, *rows, attempts
        self.sent = self.failed = self.refused = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(4)]

    def _run(self, k: int) -> None:
        from clients.triton import RankerClient, Retry

        client = RankerClient(self.url, "http", timeout=5.0, retry=Retry(attempts=self.attempts, backoff=0.25,
                                                                                 max_sleep=2.0))
        i = k
        try:
            while not self._stop.is_set():
                row = i % len(self.dense)
                try:
                    got = client.score(self.dense[row:row + 1], self.cats[row:row + 1])
                    assert got.shape == (1,) and np.isfinite(got).all()
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    if schema.OVERLOAD_REFUSAL in str(exc):
                        self.refused += 1
                    else:
                        self.failed += 1
                        self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                self.sent += 1
                i += 4
        finally:  # an open keep-alive connection holds tritonserver's shutdown for its exit timeout
            client.close()

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def learnable_tensors(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Model-ready rows whose label depends on one dense feature and one category (so a DLRM
    learns it within an epoch): (dense [n x 13] f32, ids [n x 26] i64 in 0..4, labels [n] i8)."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, schema.N_DENSE)).astype(np.float32)
    ids = rng.integers(0, 5, (n, schema.N_CATEGORICAL)).astype(np.int64)
    labels = (rng.random(n) < 1 / (1 + np.exp(-(2 * dense[:, 0] + (ids[:, 3] == 1))))).astype(np.int8)
    return dense, ids, labels


def fleet_ports(replicas: int = 2) -> tuple[int, int, int]:
    """Free ports for a fleet's gateway (HTTP, gRPC) and its first replica's metrics port, chosen so
    that replica i's metrics port (the first + i) is free and is neither gateway port."""
    from ensemble.base.machine import free_ports, port_free

    for _ in range(50):
        http, grpc, metrics = free_ports(3)
        derived = [metrics + i for i in range(1, replicas)]
        if not {http, grpc} & set(derived) and all(port_free("127.0.0.1", p) for p in derived):
            return http, grpc, metrics
    raise RuntimeError(f"no free metrics port with {replicas - 1} free ports after it")


def wait_until(condition: Callable[[], T], timeout: float, what: str | Callable[[], str], every: float = 0.1) -> T:
    """Call ``condition`` every ``every`` seconds until it returns something true, and return that.
    The test fails saying ``what`` (a text, or a function giving one, called then) when ``timeout``
    seconds pass first: a wait for a state, where a fixed sleep would be too short on a slow machine
    and too long on a fast one."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what() if callable(what) else what}")
        time.sleep(every)
    return found


def stop_process(pid: int, bound: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until /proc shows every one of its threads stopped. The signal is not
    synchronous: the kernel wakes one thread, which stops the others once it is scheduled, so a
    request sent right after ``kill`` can still be answered (seen in a clean-clone run: a
    tritonserver probe scored 0.0 s after its SIGSTOP)."""
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    while time.monotonic() - started < bound:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(processes.stat_fields(int(task.name))[0])
            except (OSError, IndexError):
                continue  # a thread that ended meanwhile
        if states and all(state in STOPPED_STATES for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} not stopped {bound:.0f}s after SIGSTOP")


def start_serving(argv: list[str], env: dict | None = None, timeout: float = 420.0):
    """Run ``python -m ensemble serve ARGV`` as a user would; return (process, output lines, read on)
    once it prints its ``ready:`` line. The test fails with the output when it exits or times out."""
    import subprocess
    import sys

    import pytest

    process = subprocess.Popen([sys.executable, "-m", "ensemble", "serve", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    threading.Thread(target=lambda: [output.append(line.rstrip("\n")) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while not any(line.startswith("ready:") for line in output):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("ensemble serve did not start:\n" + "\n".join(output))
        time.sleep(0.2)
    return process, output


def stop_serving(process) -> None:
    """SIGTERM an ``ensemble serve`` process and wait; kill it and what it started if it lingers."""
    import subprocess

    process.send_signal(signal.SIGTERM)
    try:
        process.wait(90)
    except subprocess.TimeoutExpired:
        for pid in processes.tree(process.pid)[1:]:
            os.kill(pid, signal.SIGKILL)
        process.kill()
        process.wait()


def http_exchange(address: str, data: bytes, timeout: float = 120.0) -> bytes:
    """Send ``data`` on a new connection to ``host:port`` and read until the server closes it or one
    HTTP reply (headers and a Content-Length body) has arrived; the raw reply."""
    import socket

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            head, sep, body = reply.partition(b"\r\n\r\n")
            lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
            if sep and lengths and len(body) >= lengths[0]:
                break
    return reply


def http_post(address: str, path: str, body: bytes, headers: dict | None = None, chunk: int | None = None,
              timeout: float = 120.0) -> tuple[int, bytes]:
    """POST ``body`` to ``path`` as raw HTTP/1.1, in one piece (Content-Length) or in chunks of
    ``chunk`` bytes; (status, reply body). A header's value may be bytes (sent as they are)."""
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: ranker", b"Content-Type: application/octet-stream",
             *(k.encode() + b": " + (v if isinstance(v, bytes) else str(v).encode()) for k, v in (headers or {}).items())]
    if chunk is None:
        request = b"\r\n".join(lines + [b"Content-Length: %d" % len(body)]) + b"\r\n\r\n" + body
    else:
        parts = [b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk]) for i in range(0, len(body), chunk)]
        request = b"\r\n".join(lines + [b"Transfer-Encoding: chunked"]) + b"\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"
    reply = http_exchange(address, request, timeout)
    return int(reply.split(b" ", 2)[1]), reply.partition(b"\r\n\r\n")[2]


def http_announce(address: str, path: str, length: int, headers: dict | None = None) -> tuple[int, bytes]:
    """Send only the headers of a POST of ``length`` bytes with ``Expect: 100-continue`` and return
    the final answer, body unsent. (A client that sends a body the gateway refuses part way can see
    the connection reset before it reads the 413: this one sends none.)"""
    import socket

    host, port = address.rsplit(":", 1)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        reply = b""
        while True:
            while b"\r\n\r\n" not in reply and (chunk := sock.recv(65536)):
                reply += chunk
            if not reply.startswith(b"HTTP/1.1 100 "):
                break
            reply = reply.split(b"\r\n\r\n", 1)[1]  # Envoy says 100 itself; the route's answer follows
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
    return status, reply


def two_releases(trained, root: Path, keep: int = 2) -> tuple[Path, int, int]:
    """A private copy of the trained repository under ``root`` with a second release exported into it
    and the first declared (what a server started on it serves): (repository, first, second)."""
    import shutil

    from ensemble.repository.export import TrainedArtifacts, export_repository
    from ensemble.repository import declared
    from ensemble.operate.deploy import available_releases

    repository = root / "repository"
    shutil.copytree(trained.repository, repository)
    first = available_releases(repository)[-1]
    declared.write(repository, first, "test")
    second = int(export_repository(TrainedArtifacts.under(trained.workdir), repository, keep=keep)[schema.Model.RANKER].name)
    return repository, first, second


@dataclass
class ReleaseFleet:
    """``ensemble serve --replicas 2`` on a private repository of two releases, the older declared
    (:func:`release_fleet`); ``metrics``: replica i serves its metrics on this port + i."""

    process: object
    repository: Path
    http: str
    grpc: str
    metrics: int
    first: int
    new: int
    output: list[str]

    def record(self):
        from ensemble.fleet import release as fleet_release

        found = fleet_release.find(self.http)
        assert found is not None, "the fleet's record is missing:\n" + "\n".join(self.output[-20:])
        return found


@contextlib.contextmanager
def release_fleet(trained, root: Path, keep: int = 3, timeout: float = 420.0):
    """A :class:`ReleaseFleet` under ``root``, with this process's run directory set to the fleet's
    (so deploys and experiments run here find it) until it stops."""
    from ensemble.operate import records

    repository, first, new = two_releases(trained, root, keep=keep)
    run = root / "run"
    env = {**os.environ, records.RUN_DIR_ENV: str(run)}
    http, grpc, metrics = fleet_ports(2)
    process, output = start_serving(["--repository", str(repository), "--replicas", "2", "--http-port", str(http),
                                     "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                     "--log-file", str(root / "logs" / "serve.log")], env, timeout=timeout)
    previous = os.environ.get(records.RUN_DIR_ENV)
    os.environ[records.RUN_DIR_ENV] = str(run)
    try:
        yield ReleaseFleet(process, repository, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", metrics, first, new, output)
    finally:
        if previous is None:
            os.environ.pop(records.RUN_DIR_ENV, None)
        else:
            os.environ[records.RUN_DIR_ENV] = previous
        stop_serving(process)


def run_clients(fleet: ReleaseFleet, action) -> tuple[list, float]:
    """Run ``action()`` while one HTTP and one gRPC client (no retries) send 1-row requests through
    ``fleet``'s gateway; returns the clients (``benchmarks.fleet_release.Client``: each answer's time
    and release) and when the action returned."""
    from benchmarks.fleet_release import Client

    stop = threading.Event()
    clients = [Client(0, "http", fleet.http, 0.002, stop), Client(1, "grpc", fleet.grpc, 0.002, stop)]
    for client in clients:
        client.start()
    time.sleep(0.5)
    try:
        action()
        returned = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=30)
    return clients, returned


_DOCKERFILE_PARSE = ("import json, sys, dockerfile\n"
                     "print(json.dumps([{f: getattr(c, f) for f in ('cmd', 'value', 'flags', 'original')} "
                     "for c in dockerfile.parse_file(sys.argv[1])]))")


def dockerfile_instructions(path: Path):
    """The Dockerfile's instructions (cmd, value, flags, original), parsed by the `dockerfile` package in a
    child process: its Go runtime crashes (SIGSEGV inside dockerfile.abi3.so) in a process that has
    loaded OpenVINO's CPU runtime, as this one has once a release was exported."""
    import json
    import subprocess
    import sys
    import types

    done = subprocess.run([sys.executable, "-c", _DOCKERFILE_PARSE, str(path)], capture_output=True, text=True, check=True)
    return [types.SimpleNamespace(**c) for c in json.loads(done.stdout)]


def requirement_pins(root: Path, names) -> dict[str, str | None]:
    """The versions requirements.txt pins for ``names`` (None where it pins none): what an adapter of a library's
    private API (clients/adapter.py, ensemble/online/redis_adapter.py) was written for must be what is pinned."""
    import re

    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", (root / "requirements.txt").read_text(), re.M))
    return {name: pins.get(name) for name in names}


def lines_matching(root: Path, skip: str, matches: Callable[[str], bool]) -> list[str]:
    """``path:line`` of every line of the project's code (clients, loadtest, benchmarks, ensemble) but the file
    named ``skip`` for which ``matches`` holds (its comment left out)."""
    return [f"{path.relative_to(root)}:{number}"
            for folder in ("clients", "loadtest", "benchmarks", "ensemble")
            for path in sorted((root / folder).rglob("*.py")) if path.name != skip
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if matches(line.split("#")[0])]
