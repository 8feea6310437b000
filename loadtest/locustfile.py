"""Locust users for the ranker: Triton over HTTP JSON or gRPC, and the CPU baselines.

Run it like any locustfile (web UI, headless, or master + workers)::

    locust -f loadtest/locustfile.py JsonUser --host http://127.0.0.1:8000 --rows-per-request 100
    locust -f loadtest/locustfile.py TritonGrpcUser --host grpc://127.0.0.1:8001 --headless -u 8 -t 30s

``JsonUser`` posts Triton's v2 JSON body, which Triton and both baselines accept, so the same
bytes go to every HTTP target. Requests are drawn from a held-out Criteo TSV
(``--data-file``); each carries ``--rows-per-request`` rows (1 = one item, 100 = a ranking
request). ``--fail-ratio-stop`` ends the run when too many requests fail. A refused request (HTTP
503 / gRPC UNAVAILABLE) counts as a failure, and its user backs off before its next request as the
project's clients do (``clients.triton.Retry``), so an overloaded server is not measured under a
retry storm of its own making.
"""

from __future__ import annotations

# tritonclient.grpc must run on gevent's loop inside locust; patch before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import random  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
from locust import FastHttpUser, User, events, task  # noqa: E402

from clients.triton import Retry  # noqa: E402
from ensemble import schema  # noqa: E402
from loadtest.payloads import Payloads  # noqa: E402

BACKOFF = Retry()  # the project's clients' pauses: 0.25 s, doubling, at most 4 s


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    parser.add_argument("--data-file", default="build/loadtest/holdout.tsv", help="Criteo TSV to draw rows from")
    parser.add_argument("--rows-per-request", type=int, default=1, help="rows in each request")
    parser.add_argument("--fail-ratio-stop", type=float, default=0.2, help="stop when this share of requests fails")
    parser.add_argument("--strict-json", action="store_true",
                        help="missing dense values as 0, not NaN (for a server whose JSON parser refuses NaN)")


_payloads: dict = {}


def payloads(environment) -> Payloads:
    options = environment.parsed_options
    key = (options.data_file, options.rows_per_request, 0, options.strict_json)
    if key not in _payloads:
        _payloads[key] = Payloads(*key)
    return _payloads[key]


@events.test_start.add_listener
def _start_fail_ratio_watch(environment, **_kwargs) -> None:
    from locust.runners import WorkerRunner

    if isinstance(environment.runner, WorkerRunner) or environment.parsed_options is None:
        return
    limit = environment.parsed_options.fail_ratio_stop

    def watch() -> None:
        while environment.runner.state not in ("stopped", "stopping"):
            gevent.sleep(1.0)
            total = environment.runner.stats.total
            if total.num_requests >= 50 and total.fail_ratio > limit:
                print(f"fail ratio {total.fail_ratio:.2f} > {limit}: stopping", flush=True)
                environment.process_exit_code = 3
                environment.runner.quit()
                return

    gevent.spawn(watch)


_environment: list = []


@events.init.add_listener
def _remember_environment(environment, **_kwargs) -> None:
    _environment[:] = [environment]


def _write_final_csv(environment) -> None:
    """Rewrite ``<prefix>_stats.csv`` and friends with the final numbers.

    Locust's CSV writer refreshes the files once a second from a greenlet and never again after
    the run stops, so without this the files can miss up to the last second of requests."""
    import csv

    from locust.runners import WorkerRunner
    from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if not prefix or isinstance(environment.runner, WorkerRunner):
        return
    table = StatsCSV(environment, PERCENTILES_TO_REPORT)
    for suffix, write in (("_stats.csv", table.requests_csv), ("_failures.csv", table.failures_csv),
                          ("_exceptions.csv", table.exceptions_csv)):
        with open(f"{prefix}{suffix}", "w", newline="") as handle:
            write(csv.writer(handle))


@events.quit.add_listener
def _exit_without_finalizers(exit_code, **_kwargs) -> None:
    """Write the final CSVs, then leave before interpreter finalization.

    With gevent-patched gRPC channels, the garbage collection that runs during interpreter
    shutdown can block forever on a mutex inside grpc's Cython layer while holding the GIL (seen
    here about one run in ten: summary printed, process never exits, SIGTERM ignored). `quit`
    fires after locust has printed its summary; locust then closes its CSV files and calls
    sys.exit. An atexit hook runs after that and before the collection: it writes the final
    CSVs, flushes, and leaves with locust's exit code. A faulthandler timer backs it up: it runs
    in a C thread that needs no GIL and ends the process if anything else on the way stalls.
    """
    import atexit
    import faulthandler
    import os
    import sys

    def leave() -> None:
        code = exit_code
        try:
            if _environment:
                _write_final_csv(_environment[0])
        except Exception as exc:  # noqa: BLE001 - report it, still leave
            print(f"could not write the final CSV files: {exc}", file=sys.stderr)
            code = code or 2
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep us alive
                pass
        os._exit(code)

    atexit.register(leave)
    faulthandler.dump_traceback_later(30.0, exit=True)


class BacksOff:
    """No pause between requests, except after a refusal: then the project's clients' backoff,
    doubling while refusals follow each other; an answer resets it."""

    _pause = 0.0

    def wait_time(self) -> float:
        return self._pause

    def answered(self, refused: bool) -> None:
        self._pause = min(max(2 * self._pause, BACKOFF.backoff), BACKOFF.max_sleep) if refused else 0.0


class JsonUser(BacksOff, FastHttpUser):
    """Triton's HTTP endpoint or a baseline server: the same JSON body."""

    @task
    def infer(self) -> None:
        body = random.choice(payloads(self.environment).json)
        with self.client.post(schema.RANKER_INFER_PATH, data=body, headers={"Content-Type": "application/json"},
                              name=f"infer {self.environment.parsed_options.rows_per_request} rows",
                              catch_response=True) as response:
            error = getattr(response, "error", None)  # set only when no HTTP answer came back
            self.answered(response.status_code == 503)
            if error is not None and not response.status_code:
                response.failure(f"no response: {error}")
            elif response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
            elif b'"score"' not in (response.content or b""):
                response.failure("no score in the response")


class TritonGrpcUser(BacksOff, User):
    """Wraps tritonclient.grpc and reports each call to locust with its timing."""

    abstract = False

    def on_start(self) -> None:
        from clients.triton import RankerClient

        url = self.host.split("://", 1)[-1]
        self.client = RankerClient(url, "grpc", timeout=30)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def infer(self) -> None:
        dense, cats = random.choice(payloads(self.environment).arrays)
        name = f"infer {self.environment.parsed_options.rows_per_request} rows"
        started = time.perf_counter()
        error = None
        try:
            self.client.infer(dense, cats)
        except Exception as exc:  # noqa: BLE001 - reported to locust as a failure
            # as text: locust records repr(), and tritonclient's InferenceServerException keeps its
            # status and message out of repr() ("InferenceServerException()")
            error = f"{type(exc).__name__}: {exc}"
        self.answered(error is not None and "StatusCode.UNAVAILABLE" in error)
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=(time.perf_counter() - started) * 1000,
            response_length=len(dense), exception=error, context={})
