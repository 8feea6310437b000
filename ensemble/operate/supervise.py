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
  would only take the ranker away from the requests it does serve. A probe *refused by the ranker's
  admission* (503 ``refused: ...``: its code ran and answered) counts as a failure only once no
  request at all has been scored for ``refusing_stall`` seconds: a server starved of CPU (its HTTP
  front end parsing a flood of large requests) can go half a second without finishing a call while
  it refuses the rest, and healing it, in the native layout a restart of the whole server, would
  turn refusals into connection errors.
- **A backend process is stopped** (SIGSTOP, a debugger or profiler holding it: state ``T``/``t`` in
  ``/proc``). Each step looks at the backend processes' states before probing (and again after
  a failed probe); one still stopped ``stop_confirm`` seconds later is ended and healed as above
  at once, without waiting for probes to fail. Waiting would risk the whole server: Triton 2.51's
  python backend gives up on a request after one second without a sign of life from the stub, frees
  that request's shared memory and sends the next, but the stopped stub still holds the first
  one's handle; when it resumes it runs the stale request and frees the same shared memory again,
  and the stub and/or tritonserver then die (SIGSEGV in the stub's shared-memory allocator,
  ``terminate called after throwing an instance of 'boost::interprocess::lock_exception'`` and
  SIGABRT in tritonserver, or SIGBUS). A stub ended while stopped never resumes. A stall that is
  not a stop (a call that hangs, then returns after Triton gave up) can still take the server
  down that way: the supervisor then restarts it, as for any exit of tritonserver.
- **The python ``rank`` model's process dies or stalls** (the python-backend layouts' ranking
  requests). After each good probe of the ranker the supervisor sends ``rank`` a one-candidate
  request; when its answer is the broken-stub error or none comes (or its process is stopped), it
  SIGKILLs that stub, unloads ``rank`` and loads it again. When its answer names the ranker's
  process (``rank`` calls the ranker, which broke after its own probe), the ranker is healed
  instead. A heal of the ranker ends the ranker's processes, never ``rank``'s.
- **The native layout's ranker stalls.** It runs inside tritonserver (``libtriton_native.so``), so
  there is no process of its own to end: after ``failures_to_heal`` failed probes with no progress
  the supervisor restarts the server as below (a crash of that code is a crash of the server).
  Every question the supervisor asks the server waits no longer than ``probe_timeout``.
- **tritonserver is stopped** (SIGSTOP, a debugger holding it). Before each probe the supervisor
  looks at the server's state; one still stopped ``stop_confirm`` seconds later is restarted as
  below at once, in any layout: it answers nothing, and every probe and question would wait out
  its timeout first.
- **tritonserver itself dies.** The supervisor kills what is left of its process group (the
  backend stubs would otherwise stay behind as orphans), then starts a new server on the same
  ports after a backoff that doubles from ``backoff`` up to ``max_backoff``. More than
  ``max_restarts`` restarts within ``restart_window`` seconds means something is wrong that a
  restart will not fix: the supervisor stops and reports the server's log tail.
"""

from __future__ import annotations

import dataclasses
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
from ensemble.operate import processes
from ensemble.operate.control import Control, ControlError
from ensemble.operate.server import ServerError, TritonServer

RELOAD_PARAMETER = "reload_generation"
STOPPED_STATES = ("T", "t")  # /proc/<pid>/stat: stopped by a signal, stopped by a tracer
BROKEN_STUB = "is not healthy"  # Triton's answer once a python-backend process died or stalled
STUB_NAME = r"Stub process '(\w+)_\d+_\d+'"  # the model whose process Triton's answer names


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
    stop_confirm: float = 0.2  # a backend process stopped this long is stalled, not a profiler's sample
    refusing_stall: float = 5.0  # seconds of refused probes with nothing scored before they count as failures


class GaveUp(ServerError):
    """The server kept dying; the message ends with its log tail."""


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (False when it is gone: a probe or ``alive()`` tells what that means)."""
    try:
        return processes.stat_fields(pid)[0] in STOPPED_STATES
    except (OSError, IndexError):
        return False


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
        # Its questions (stats, config, versions) wait no longer than a probe: a stopped or hung server
        # would hold each for the default 10 s and delay its restart by as much.
        self.control = dataclasses.replace(
            Control.of(server.http_url, key=server.options.admin_key or "", grpc=server.grpc_url),
            timeout=self.policy.probe_timeout)
        self.versions: list[int] = []  # the ranker versions last seen serving: restored after a restart
        self._config: dict | None = None
        self._rank_request: bytes | None = None  # the rank model's probe, sized at its first use
        self._rank_failures, self._rank_scored = 0, None
        self._scored: int | None = None  # successful requests at the last failed probe
        self._refusing_since: float | None = None  # first refused probe since a request was last scored

    def probe(self) -> str | None:
        """None when a 1-row request is scored, else why not."""
        if self._body is None:
            config = self.served_config()
            self._body = _probe_body(schema.widths_of_config(config) if config else schema.CRITEO_WIDTHS)
        failure = self._post(schema.RANKER_INFER_PATH, self._body)
        if failure is None:
            return None
        status, text = failure
        if status == 400:  # a release of another dataset's widths: size the probe again
            self._body = None
        return f"HTTP {status}: {text}" if status else text

    def _post(self, path: str, body: bytes) -> tuple[int, str] | None:
        """POST a probe request: None when it is answered, else (the HTTP status, or 0 when nothing
        answered; what came back or went wrong)."""
        request = urllib.request.Request(f"{self.control.url}{path}", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.policy.probe_timeout) as reply:
                reply.read()
                return None
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()[:300].decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    def served_config(self) -> dict | None:
        """The ranker's served config; the last one seen when it is not loaded (a heal whose load
        failed left it unloaded), or None when none was ever seen (then the repository's own)."""
        try:
            self._config = self.control.config()
        except ControlError:
            pass
        return None if self._config is None else json.loads(json.dumps(self._config))

    def reload_ranker(self, release: int | list[int] | None = None, unload_first: bool = False) -> None:
        """Load the ranker again with its served config (pinned to ``release`` when given) and a
        new generation number (Triton skips a load whose config is unchanged).

        Args:
            release: serve this version only (a list: these versions).
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
                config["version_policy"] = {"specific": {"versions": release if isinstance(release, list) else [release]}}
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

    def server_stopped(self) -> bool:
        """Whether tritonserver is stopped now and still so ``stop_confirm`` seconds later."""
        if self.server.process is None or not _is_stopped(self.server.process.pid):
            return False
        time.sleep(self.policy.stop_confirm)
        return _is_stopped(self.server.process.pid)

    def stopped_stubs(self, rank: bool = False) -> dict[str, int]:
        """Model -> pid of the backend processes stopped now and still stopped ``stop_confirm``
        seconds later (the ranker's; with ``rank``, the rank model's only)."""
        def stopped() -> dict[str, int]:
            found = {}
            for model, pid in self.server.stub_pids().items():
                if (model == schema.RANK_MODEL) == rank and _is_stopped(pid):
                    found[model] = pid
            return found

        first = stopped()
        if not first:
            return {}
        time.sleep(self.policy.stop_confirm)
        return {model: pid for model, pid in stopped().items() if first.get(model) == pid}

    def end_broken_stubs(self, problem: str, models: set[str] | None = None) -> list[str]:
        """SIGKILL the backend processes of ``models``, else those the probe's answer names as
        unhealthy (all of them when it names none: a timeout cannot tell which step hangs). A
        stub that was stalled keeps the requests it held, and Triton's unload waits for those
        forever; a dead one releases them. Triton never uses an unhealthy stub again, so nothing
        that works is lost; a stopped one must not resume (see the module docstring)."""
        named = set(models) if models else set(re.findall(STUB_NAME, problem))
        ended = []
        for model, pid in self.server.stub_pids().items():
            if (named and model not in named) or (not named and model == schema.RANK_MODEL):
                continue  # the rank model is not one of the ranker's processes
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(model)
            except ProcessLookupError:
                pass
        return ended

    def _rank_body(self) -> bytes | None:
        """A one-candidate ranking request sized from the served ``rank`` config (None: no rank model)."""
        try:
            config = dataclasses.replace(self.control, model=schema.RANK_MODEL).config()
        except ControlError:
            return None
        inputs = []
        for tensor in config.get("input", []):
            if tensor.get("optional"):
                continue
            dims = [1 if int(d) < 0 else int(d) for d in tensor["dims"]]
            size = int(np.prod(dims))
            data = [""] * size if tensor["data_type"] == schema.DType.STRING.value else [0.0] * size
            inputs.append({"name": tensor["name"], "shape": dims,
                           "datatype": schema.DType(tensor["data_type"]).wire, "data": data})
        return json.dumps({"inputs": inputs}).encode()

    def probe_rank(self) -> str | None:
        """None when the python ``rank`` model answers (or there is none to ask), else why not."""
        if Layout(self.server.options.layout) is Layout.NATIVE:
            return None  # served inside tritonserver: the ranker's probe covers it
        if self._rank_request is None:
            self._rank_request = self._rank_body()
            if self._rank_request is None:
                return None
        failure = self._post(f"/v2/models/{schema.RANK_MODEL}/infer", self._rank_request)
        if failure is None:
            return None
        status, text = failure
        if status:
            return text if BROKEN_STUB in text else None  # refused or unloaded: not this fault
        return text

    def _check_rank(self) -> None:
        """Heal the rank model at once when Triton calls its stub unhealthy; after unanswered probes
        only when it also stopped answering others (a busy rank model is not a broken one)."""
        stopped = self.stopped_stubs(rank=True)
        if stopped:
            self._rank_failures = 0
            self.heal_rank(f"its backend process {list(stopped.values())} is stopped")
            return
        problem = self.probe_rank()
        if problem is None:
            self._rank_failures, self._rank_scored = 0, None
            return
        named = set(re.findall(STUB_NAME, problem))
        stopped = self._stopped_ranker_stubs()
        if stopped or (named and schema.RANK_MODEL not in named):
            # rank calls the ranker: its answer is about the ranker's process, stalled or dead since
            # the ranker's probe. Ending rank's would leave the ranker's to resume and crash Triton.
            self._rank_failures = 0
            self._heal(problem, set(stopped) or None)
            return
        if BROKEN_STUB not in problem:
            try:
                scored = dataclasses.replace(self.control, model=schema.RANK_MODEL).scored()
            except (ControlError, ValueError, TypeError):
                scored = None
            before, self._rank_scored = self._rank_scored, scored
            if scored is not None and before is not None and scored > before:
                self._rank_failures = 0
                return
            self._rank_failures += 1
            if self._rank_failures < self.policy.failures_to_heal:
                return
        self._rank_failures = 0
        self.heal_rank(problem)

    def heal_rank(self, problem: str) -> None:
        """End the rank model's stub and load it again."""
        pid = self.server.stub_pids().get(schema.RANK_MODEL)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log(f"rank model not answering ({problem}); ended its backend process, unloading and reloading it")
        rank = dataclasses.replace(self.control, model=schema.RANK_MODEL)
        try:
            rank.unload()
            rank.load(None)
        except ControlError as exc:
            self.log(f"rank reload failed: {exc}")
            return
        self.log("rank model reloaded")

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
        if self.versions and self.server.declared_versions() is None:  # else start() loaded what is declared
            try:
                if self.control.ready_versions() != self.versions:
                    self.reload_ranker(list(self.versions))  # a deployed or rolled-back release, not just the newest
                    self.log(f"release(s) {self.versions} restored")
            except ControlError as exc:
                self.log(f"could not restore release(s) {self.versions}: {exc}")

    def check(self) -> None:
        """One supervision step: restart a dead server, heal a ranker that stopped answering."""
        if not self.server.alive():
            code = None if self.server.process is None else self.server.process.returncode
            self.log(f"tritonserver exited with code {code}")
            self.restart()
            self._failures = 0
            return
        if self._restart_if_stopped():
            return
        stopped = self._stopped_ranker_stubs()
        if stopped:
            self._heal(f"backend process(es) {stopped} stopped", set(stopped))
            return
        problem = self.probe()
        if problem is None:
            self._failures, self._scored, self._refusing_since = 0, None, None
            self._check_rank()
            try:
                versions = self.control.ready_versions()
                if versions != self.versions or self._config is None:
                    self._config = self.control.config()
                self.versions = versions
            except ControlError:
                pass
            return
        if self._restart_if_stopped():  # the probe may have waited on a server stopped meanwhile
            return
        stopped = self._stopped_ranker_stubs()  # or on a backend process stopped meanwhile
        if stopped:
            self._heal(f"{problem}; backend process(es) {stopped} stopped", set(stopped))
            return
        broken = BROKEN_STUB in problem
        if not broken and self._progressing():
            self._failures, self._refusing_since = 0, None  # refused or slow, yet scoring others' requests: overloaded
            return
        if not broken and schema.OVERLOAD_REFUSAL in problem:  # the ranker's admission answered: its code runs
            now = self.clock()
            self._refusing_since = now if self._refusing_since is None else self._refusing_since
            if now - self._refusing_since < self.policy.refusing_stall:
                return
        self._failures += 1
        if (self._failures < self.policy.failures_to_heal and not broken) or not self.server.alive():
            return
        if Layout(self.server.options.layout) is Layout.NATIVE:  # no process of its own to end
            self.log(f"ranker not answering ({problem}); it runs inside tritonserver: restarting the server")
            self.restart()
            self._failures = 0
            return
        self._heal(problem)

    def _restart_if_stopped(self) -> bool:
        if not self.server_stopped():
            return False
        self.log(f"tritonserver {self.server.process.pid} is stopped: restarting it")
        self.restart()
        self._failures = 0
        return True

    def _stopped_ranker_stubs(self) -> dict[str, int]:
        if Layout(self.server.options.layout) is Layout.NATIVE:
            return {}  # no backend process of the ranker's (tritonserver's own stop: server_stopped)
        return self.stopped_stubs()

    def _heal(self, problem: str, models: set[str] | None = None) -> None:
        """End the ranker's broken backend processes (``models``', else those ``problem`` names),
        unload the ranker and load it again."""
        ended = self.end_broken_stubs(problem, models)
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
