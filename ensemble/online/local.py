"""A local Redis for the online store (ensemble/online/): one ``redis-server`` on loopback, or a Redis
Cluster of several, started and stopped as the project starts tritonserver and Envoy. The demo and the
tests use them; production names its own store by URL (``ensemble serve --store``).

Debian's ``redis-server`` package provides the binaries (``.ci/run`` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path


class StoreServerError(RuntimeError):
    pass


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise StoreServerError(f"{name} is not installed (Debian: apt-get install redis-server)")
    return found


class LocalRedis:
    """One ``redis-server`` on 127.0.0.1:``port`` holding nothing on disk (no snapshots, no append-only
    file): a restart starts empty. ``cluster``: a node in cluster mode (see :class:`LocalRedisCluster`)."""

    def __init__(self, port: int, folder: Path | None = None, cluster: bool = False, password: str | None = None):
        self.port, self.cluster, self.password = port, cluster, password
        self.folder = (Path(folder) if folder else Path(tempfile.mkdtemp(prefix="redis-"))).resolve()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        cmd = [_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.folder), "--logfile", str(self.folder / f"redis-{self.port}.log")]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                    "--cluster-node-timeout", "2000"]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                log = self.folder / f"redis-{self.port}.log"
                said = log.read_text(errors="replace")[-400:] if log.is_file() else ""
                raise StoreServerError(f"redis-server on port {self.port} exited ({self.process.returncode}): "
                                       f"{self.process.stderr.read().decode(errors='replace')[-400:]}{said}")
            try:
                client = redis.Redis(port=self.port, password=self.password, socket_timeout=1)
                client.ping()
                client.close()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise StoreServerError(f"redis-server on port {self.port} did not answer in {timeout:g} s") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the store vanishes at once, as a crashed node would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None


CLUSTER_BUS_OFFSET = 10_000  # a cluster node also listens on its port + 10,000 (the cluster bus)


def cluster_ports(count: int) -> list[int]:
    """``count`` free ports whose cluster-bus ports (+10,000) are free and valid too."""
    from ensemble.base.machine import free_ports, port_free

    found: list[int] = []
    for _ in range(200):
        found += [p for p in free_ports(count) if p + CLUSTER_BUS_OFFSET < 65536
                  and port_free("127.0.0.1", p + CLUSTER_BUS_OFFSET) and p + CLUSTER_BUS_OFFSET not in found]
        if len(found) >= count:
            return found[:count]
    raise StoreServerError(f"no {count} free ports with free cluster-bus ports")


class LocalRedisCluster:
    """A Redis Cluster of ``len(ports)`` primaries (no replicas) on loopback, its 16,384 hash slots
    spread over them by ``redis-cli --cluster create``; ``url`` names its first node (the client
    discovers the others)."""

    def __init__(self, ports: list[int], folder: Path | None = None):
        if len(ports) < 3:
            raise StoreServerError("a Redis Cluster needs at least 3 primaries")
        if max(ports) + CLUSTER_BUS_OFFSET > 65535:
            raise StoreServerError(f"port {max(ports)}: its cluster-bus port (+{CLUSTER_BUS_OFFSET}) is past 65535")
        self.folder = (Path(folder) if folder else Path(tempfile.mkdtemp(prefix="redis-cluster-"))).resolve()
        self.nodes = [LocalRedis(p, self.folder, cluster=True) for p in ports]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> "LocalRedisCluster":
        import redis

        for node in self.nodes:
            node.start()
        created = subprocess.run([_binary("redis-cli"), "--cluster", "create",
                                  *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas", "0",
                                  "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
        if created.returncode != 0:
            self.stop()
            raise StoreServerError(f"redis-cli --cluster create failed: {created.stdout[-400:]} {created.stderr[-400:]}")
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for node in self.nodes:
                client = redis.Redis(port=node.port, socket_timeout=1)
                states.append(client.cluster("info").get("cluster_state"))
                client.close()
            if all(s == "ok" for s in states):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise StoreServerError(f"the cluster did not reach state ok in {timeout:g} s: {states}")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
