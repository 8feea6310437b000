"""Process lifecycle helpers shared by the server launcher, the load-test runner, the command
line and the demo: readiness polling, terminate-then-kill, and waiting for SIGINT/SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable


def http_ready(base_url: str, timeout: float = 2.0) -> bool:
    """Whether ``<base_url>/v2/health/ready`` answers 200 (Triton's and the baselines' readiness)."""
    try:
        with urllib.request.urlopen(f"{base_url}/v2/health/ready", timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(base_url: str, process: subprocess.Popen | None = None, timeout: float = 180.0, what: str = "server",
               poll: float = 0.5) -> float:
    """Poll readiness every ``poll`` seconds until it answers 200; fail early when ``process`` exits first.
    Returns the seconds waited.

    Raises:
        RuntimeError: the process exited, or readiness did not come within ``timeout`` seconds.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        if http_ready(base_url):
            return time.monotonic() - start
        time.sleep(poll)
    raise RuntimeError(f"{what} at {base_url} not ready after {timeout:.0f}s")


def terminate(process: subprocess.Popen, grace: float = 15.0, group: bool = False) -> int:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; returns the exit code.

    Args:
        group: also SIGKILL the process group afterwards (a process started with
            ``start_new_session=True`` leads its own group; children it left behind die with it).
    """
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
    if group:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return process.wait()


def run_until_signal(keep_going: Callable[[], bool] = lambda: True, poll: float = 0.5,
                     on_tick: Callable[[Callable[[], bool]], None] | None = None) -> int | None:
    """Block until SIGINT or SIGTERM arrives (returns its number) or ``keep_going()`` is false (None).

    Args:
        on_tick: instead of sleeping, call this with a ``stopped()`` predicate and let it run
            (the supervisor's loop); it must return when ``stopped()`` turns true.
    """
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    if on_tick is not None:
        on_tick(lambda: bool(received))
    while not received and keep_going():
        time.sleep(poll)
    return received[0] if received else None
