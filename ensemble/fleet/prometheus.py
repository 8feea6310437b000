"""A real Prometheus scraping a fleet: its scrape config, the binary, and PromQL queries.

Debian's Prometheus (pinned as a ``# tool: deb prometheus`` line of requirements.txt) is fetched
with ``apt-get download`` and unpacked under ``build/tools/prometheus`` on first use (no root
needed), like perf_analyzer's libraries. :func:`scrape_config` names one job for the replicas'
Triton metrics ports (job ``triton``, each replica its own ``instance``) and one for the gateway's
Envoy statistics (job ``gateway``, from its loopback admin listener). The dashboard's queries and
the autoscaler's are evaluated against it in ``tests/integration/test_fleet_metrics.py``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from ensemble.base.pins import ROOT, tool_pins

TOOLS = ROOT / "build" / "tools" / "prometheus"
PACKAGE = "prometheus"
TRITON_JOB = "triton"
GATEWAY_JOB = "gateway"


class PrometheusError(RuntimeError):
    """Prometheus could not be installed, started or queried; the message says why."""


def install(dest: Path = TOOLS, log=print) -> Path:
    """The ``prometheus`` binary under ``dest`` (downloaded and unpacked on first use)."""
    binary = dest / "prometheus"
    if binary.is_file():
        return binary
    if tool_pins().get(PACKAGE) != "deb":
        raise PrometheusError(f"requirements.txt has no '# tool: deb {PACKAGE}' line")
    log(f"installing Debian's {PACKAGE} into {dest} ...")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(["apt-get", "download", PACKAGE], cwd=scratch, capture_output=True, text=True)
        debs = list(Path(scratch).glob(f"{PACKAGE}_*.deb"))
        if done.returncode != 0 or not debs:
            raise PrometheusError(f"apt-get download {PACKAGE} failed: {done.stderr.strip()[-300:]}")
        unpacked = Path(scratch) / "unpacked"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True)
        found = unpacked / "usr" / "bin" / "prometheus"
        if not found.is_file():
            raise PrometheusError(f"{debs[0].name} has no usr/bin/prometheus")
        tmp = dest / "prometheus.partial"
        tmp.write_bytes(found.read_bytes())
        tmp.chmod(0o755)
        tmp.rename(binary)
    return binary


def scrape_config(replica_metrics: list[str], gateway_admin: str | None, interval_s: float = 5.0) -> dict:
    """Prometheus's configuration for a fleet.

    Args:
        replica_metrics: every replica's metrics endpoint as ``host:port``.
        gateway_admin: the gateway's admin listener as ``host:port`` (None: no gateway).
        interval_s: the scrape interval.
    """
    interval = f"{interval_s:g}s"
    jobs = [{"job_name": TRITON_JOB, "scrape_interval": interval,
             "static_configs": [{"targets": list(replica_metrics)}]}]
    if gateway_admin:
        jobs.append({"job_name": GATEWAY_JOB, "scrape_interval": interval, "metrics_path": "/stats/prometheus",
                     "static_configs": [{"targets": [gateway_admin]}]})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


class Prometheus:
    """One Prometheus process on loopback with its own data folder."""

    def __init__(self, config: dict, port: int, workdir: Path, binary: Path | None = None):
        self.config, self.port, self.workdir = config, port, Path(workdir)
        self.binary = binary or install()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "Prometheus":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps(self.config, indent=1))  # JSON is YAML
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [str(self.binary), f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PrometheusError(f"prometheus exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def _get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (each: ``metric`` labels and ``value``)."""
        data = self._get("/api/v1/query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def targets(self) -> list[dict]:
        """The active scrape targets with their health (``up`` / ``down``) and last error."""
        return self._get("/api/v1/targets")["activeTargets"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "log", None):
            self.log.close()
