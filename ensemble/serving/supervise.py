"""Keep a tritonserver serving by itself: what ``ensemble serve`` runs around the server.

Two faults seen here, and what the supervisor does about them:

- **A backend process dies or stalls** (SIGKILL, SIGSTOP, a profiler pausing it). Triton marks the
  stub unhealthy and answers every request with ``Stub process '<model>_0_0' is not healthy``
  from then on; it never starts a new one, and the model's ready endpoint keeps saying ready.
  The supervisor sends one real 1-row request every ``probe_interval`` seconds; after
  ``failures_to_heal`` failures in a row it reloads the ranker through Triton's model control
  with the served config plus a new ``reload_generation`` parameter (Triton skips a load whose
  config is unchanged). Triton builds the new instance while the broken one keeps answering with
  the retryable error above, then swaps.
- **tritonserver itself dies.** The supervisor kills what is left of its process group (the
  backend stubs would otherwise stay behind as orphans), then starts a new server on the same
  ports after a backoff that doubles from ``backoff`` up to ``max_backoff``. More than
  ``max_restarts`` restarts within ``restart_window`` seconds means something is wrong that a
  restart will not fix: the supervisor stops and reports the server's log tail.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ensemble import schema
from ensemble.serving.control import Control, ControlError
from ensemble.serving.server import ServerError, TritonServer

RELOAD_PARAMETER = "reload_generation"


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


def _probe_body() -> bytes:
    """One valid row: zeros for the dense features, every categorical missing."""
    return schema.v2_json_request(np.zeros((1, schema.N_DENSE), np.float32),
                                  np.full((1, schema.N_CATEGORICAL), b"", dtype=object))


class Supervisor:
    """Runs one :class:`TritonServer` until told to stop; see the module docstring."""

    def __init__(self, server: TritonServer, policy: SupervisorPolicy = SupervisorPolicy(),
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.server, self.policy, self.log, self.clock = server, policy, log, clock
        self.restarts: list[float] = []
        self.heals = 0
        self._failures = 0
        self._body = _probe_body()
        self.control = Control.of(server.http_url, key=server.options.admin_key or "")
        self.release: int | None = None  # the release last seen serving: restored after a restart

    def probe(self) -> str | None:
        """None when a 1-row request is scored, else why not."""
        request = urllib.request.Request(f"{self.control.url}{schema.RANKER_INFER_PATH}", self._body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.policy.probe_timeout) as reply:
                reply.read()
                return None
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except (urllib.error.URLError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"

    def serving_release(self) -> int | None:
        return self.control.serving_release()

    def reload_ranker(self, release: int | None = None) -> None:
        """Load the ranker again with its served config (pinned to ``release`` when given) and a
        new generation number (Triton skips a load whose config is unchanged)."""
        config = self.control.config()
        self.heals += 1
        config.setdefault("parameters", {})[RELOAD_PARAMETER] = {"string_value": str(self.heals)}
        if release is not None:
            config["version_policy"] = {"specific": {"versions": [release]}}
        self.control.load(config, self.policy.load_timeout)

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
            self._failures = 0
            try:
                self.release = self.serving_release()
            except ControlError:
                pass
            return
        self._failures += 1
        if self._failures < self.policy.failures_to_heal or not self.server.alive():
            return
        self.log(f"ranker not answering ({problem}); reloading it")
        started = self.clock()
        try:
            self.reload_ranker()
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
