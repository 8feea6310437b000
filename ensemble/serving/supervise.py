"""Keep a tritonserver serving by itself: what ``ensemble serve`` runs around the server.

Two faults seen here, and what the supervisor does about them:

- **A backend process dies or stalls** (SIGKILL, SIGSTOP, a profiler pausing it). Triton marks the
  stub unhealthy and answers every request with ``Stub process '<model>_0_0' is not healthy``
  from then on; it never starts a new one, and the model's ready endpoint keeps saying ready.
  The supervisor sends one real 1-row request every ``probe_interval`` seconds; after
  ``failures_to_heal`` failures in a row (at once when the answer is that error: it is not a slow
  answer under load) it SIGKILLs the broken backend process (a stalled one holds its requests,
  and an unload would wait for them forever), unloads the ranker, then loads it again through Triton's model control
  with the served config plus a new ``reload_generation`` parameter (Triton skips a load whose
  config is unchanged). Unloading first makes readiness tell the truth: while the ranker is
  unloaded or loading, ``/v2/health/ready`` and ``/v2/models/ranker/ready`` answer 400, so a load
  balancer routes around this server; inference answers 404 "has no available versions", which
  the clients retry. Nothing is lost by it: the broken instance could only answer errors.
  A probe refused or timed out while the ranker keeps scoring other requests (Triton's success
  count grows) is overload, not a fault: the ranker refuses what would miss its deadline, and a reload
  would only take the ranker away from the requests it does serve.
- **The native layout's ranker stalls.** It runs inside tritonserver (``libtriton_fused.so``), so
  there is no process of its own to end: after ``failures_to_heal`` failed probes with no progress
  the supervisor restarts the server as below (a crash of that code is a crash of the server).
- **tritonserver itself dies.** The supervisor kills what is left of its process group (the
  backend stubs would otherwise stay behind as orphans), then starts a new server on the same
  ports after a backoff that doubles from ``backoff`` up to ``max_backoff``. More than
  ``max_restarts`` restarts within ``restart_window`` seconds means something is wrong that a
  restart will not fix: the supervisor stops and reports the server's log tail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ensemble import schema
from ensemble.models.registry import Layout
from ensemble.serving.control import Control, ControlError
from ensemble.serving.server import ServerError, TritonServer

RELOAD_PARAMETER = "reload_generation"
BROKEN_STUB = "is not healthy"  # Triton's answer once a python-backend process died or stalled


@dataclass(frozen=True)
class SupervisorPolicy:
    probe_interval: float = 1.0
    probe_timeout: float = 2.0
    failures_to_heal: int = 2  # one slow answer under load is not a fault
    load_timeout: float = 120.0
    max_restarts: int = 5
    restart_window: float = 600.0
    backoff: float = 1.0
    max_backoff: float = 30.0


class GaveUp(ServerError):
    """The server kept dying; the message ends with its log tail."""


def _probe_body(widths: schema.Widths = schema.CRITEO_WIDTHS) -> bytes:
    """One valid row: zeros for the dense features, every categorical missing."""
    return schema.v2_json_request(np.zeros((1, widths.dense), np.float32),
                                  np.full((1, widths.categorical), b"", dtype=object))


class Supervisor:
    """Runs one :class:`TritonServer` until told to stop; see the module docstring."""

    def __init__(self, server: TritonServer, policy: SupervisorPolicy = SupervisorPolicy(),
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.server, self.policy, self.log, self.clock = server, policy, log, clock
        self.restarts: list[float] = []
        self.heals = 0
        self._failures = 0
        self._body: bytes | None = None  # sized for the served dataset at the first probe
        self.control = Control.of(server.http_url, key=server.options.admin_key or "", grpc=server.grpc_url)
        self.release: int | None = None  # the release last seen serving: restored after a restart
        self._config: dict | None = None
        self._scored: int | None = None  # successful requests at the last failed probe

    def probe(self) -> str | None:
        """None when a 1-row request is scored, else why not."""
        if self._body is None:
            config = self.served_config()
            self._body = _probe_body(schema.widths_of_config(config) if config else schema.CRITEO_WIDTHS)
        request = urllib.request.Request(f"{self.control.url}{schema.RANKER_INFER_PATH}", self._body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.policy.probe_timeout) as reply:
                reply.read()
                return None
        except urllib.error.HTTPError as exc:
            if exc.code == 400:  # a release of another dataset's widths: size the probe again
                self._body = None
            return f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except (urllib.error.URLError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"

    def serving_release(self) -> int | None:
        return self.control.serving_release()

    def served_config(self) -> dict | None:
        """The ranker's served config; the last one seen when it is not loaded (a heal whose load
        failed left it unloaded), or None when none was ever seen (then the repository's own)."""
        try:
            self._config = self.control.config()
        except ControlError:
            pass
        return None if self._config is None else json.loads(json.dumps(self._config))

    def reload_ranker(self, release: int | None = None, unload_first: bool = False) -> None:
        """Load the ranker again with its served config (pinned to ``release`` when given) and a
        new generation number (Triton skips a load whose config is unchanged).

        Args:
            release: serve this version only.
            unload_first: unload it before loading (a heal: readiness then says not-ready until
                the new instance serves). Without it Triton swaps instances with no gap (a healthy
                server restoring a release).
        """
        config = self.served_config()
        self.heals += 1
        if config is None and not unload_first:
            config = self.control.config()  # raises: nothing to load from
        if config is not None:
            config.setdefault("parameters", {})[RELOAD_PARAMETER] = {"string_value": str(self.heals)}
            if release is not None:
                config["version_policy"] = {"specific": {"versions": [release]}}
        if unload_first:
            self.control.unload(self.policy.load_timeout)
        self.control.load(config, self.policy.load_timeout)

    def _progressing(self) -> bool:
        """Whether the ranker scored any request since the last look (False if unknown)."""
        try:
            scored = self.control.scored()
        except (ControlError, ValueError, TypeError):
            return False
        before, self._scored = self._scored, scored
        return before is not None and scored > before

    def end_broken_stubs(self, problem: str) -> list[str]:
        """SIGKILL the backend processes the probe's answer names as unhealthy (all of them when it
        names none: a timeout cannot tell which step hangs). A stub that was stalled keeps the
        requests it held, and Triton's unload waits for those forever; a dead one releases them.
        Triton never uses an unhealthy stub again, so nothing that works is lost."""
        named = set(re.findall(r"Stub process '(\w+)_\d+_\d+'", problem))
        ended = []
        for model, pid in self.server.stub_pids().items():
            if named and model not in named:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(model)
            except ProcessLookupError:
                pass
        return ended

    def restart(self) -> None:
        """Clear away the dead server's processes and start a new one (after the backoff)."""
        now = self.clock()
        self.restarts = [t for t in self.restarts if now - t < self.policy.restart_window] + [now]
        if len(self.restarts) > self.policy.max_restarts:
            raise GaveUp(f"tritonserver died {len(self.restarts)} times within {self.policy.restart_window:.0f}s; "
                         f"giving up\n{self.server.log_tail()}")
        pause = min(self.policy.backoff * 2 ** (len(self.restarts) - 1), self.policy.max_backoff)
        self.server.kill()
        self.log(f"restarting tritonserver in {pause:.0f}s (restart {len(self.restarts)} of at most "
                 f"{self.policy.max_restarts} per {self.policy.restart_window:.0f}s)")
        time.sleep(pause)
        self.server.start()
        self.log("tritonserver ready again")
        if self.release is not None:
            try:
                if self.serving_release() != self.release:
                    self.reload_ranker(self.release)  # a deployed or rolled-back release, not just the newest
                    self.log(f"release {self.release} restored")
            except ControlError as exc:
                self.log(f"could not restore release {self.release}: {exc}")

    def check(self) -> None:
        """One supervision step: restart a dead server, heal a ranker that stopped answering."""
        if not self.server.alive():
            code = None if self.server.process is None else self.server.process.returncode
            self.log(f"tritonserver exited with code {code}")
            self.restart()
            self._failures = 0
            return
        problem = self.probe()
        if problem is None:
            self._failures, self._scored = 0, None
            try:
                release = self.serving_release()
                if release != self.release or self._config is None:
                    self._config = self.control.config()
                self.release = release
            except ControlError:
                pass
            return
        broken = BROKEN_STUB in problem
        if not broken and self._progressing():
            self._failures = 0  # refused or slow, yet scoring others' requests: overloaded, not broken
            return
        self._failures += 1
        if (self._failures < self.policy.failures_to_heal and not broken) or not self.server.alive():
            return
        if Layout(self.server.options.layout) is Layout.NATIVE:  # no process of its own to end
            self.log(f"ranker not answering ({problem}); it runs inside tritonserver: restarting the server")
            self.restart()
            self._failures = 0
            return
        ended = self.end_broken_stubs(problem)
        self.log(f"ranker not answering ({problem}); ended backend process(es) {ended}, unloading and reloading it")
        started = self.clock()
        try:
            self.reload_ranker(unload_first=True)
        except ControlError as exc:
            self.log(f"reload failed: {exc}")
            return
        self._failures = 0
        self.log(f"ranker reloaded in {self.clock() - started:.1f}s")

    def run(self, stopping: Callable[[], bool]) -> None:
        """Supervise until ``stopping()``; raises :class:`GaveUp` when restarts do not help."""
        while not stopping():
            deadline = self.clock() + self.policy.probe_interval
            while not stopping() and self.clock() < deadline:
                time.sleep(0.1)
            if not stopping():
                self.check()
