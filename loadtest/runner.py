"""`ensemble loadtest`: a scenario matrix (targets x rows per request x users) with locust.

Each scenario: a warm-up run (discarded), then a measured headless run with ``--csv``. Servers
are started and stopped here unless their URLs are given; every run is bounded (locust's own
``-t`` plus a subprocess timeout) and servers are cleaned up on any exit. With ``--pin`` (the
default on machines with 2+ cores) servers run on the last core and locust on the others.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ensemble.models.registry import Layout
from ensemble.operate import lifecycle
from loadtest.statistics import cpu_per_request, model_stats, stage_times
from loadtest.targets import DEFAULT_TARGETS, TARGETS, Target

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class RunnerOptions:
    """The scenario matrix and where results go."""

    repository: Path = Path("model_repository")
    out: Path = Path("build/loadtest/report")
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rows: tuple[int, ...] = (1, 100)
    users: tuple[int, ...] = (1, 4, 8, 16)
    duration: float = 12.0
    warmup: float = 3.0
    sla_ms: float = 10.0
    fail_ratio: float = 0.2
    pin: bool = True
    data_file: Path | None = None
    urls: dict[str, str] = field(default_factory=dict)  # target -> URL of a running server
    overload_seconds: float = 10.0  # open-loop run at 2x capacity against triton-http (0: skip)
    perf_analyzer: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # its concurrency sweep on triton-http/grpc (): skip
    latency_summaries: bool = False  # the tritonservers it starts export Triton's latency summaries

    @classmethod
    def from_args(cls, args) -> "RunnerOptions":
        urls = {t.value: getattr(args, f"{t.value.replace('-', '_')}_url") for t in Target}
        urls = {t: u for t, u in urls.items() if u}
        return cls(Path(args.repository), Path(args.out), tuple(args.targets), tuple(args.rows), tuple(args.users),
                   args.duration, args.warmup, args.sla_ms, args.fail_ratio, not args.no_pin,
                   Path(args.data_file) if args.data_file else None, urls,
                   overload_seconds=args.overload_seconds,
                   perf_analyzer=() if args.no_perf_analyzer else tuple(args.perf_analyzer_concurrency),
                   latency_summaries=args.latency_summaries)


def add_arguments(p) -> None:
    p.add_argument("--repository", default="model_repository", help="the Triton model repository")
    p.add_argument("--out", default="build/loadtest/report", help="report folder")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(DEFAULT_TARGETS), help="servers to measure")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100], help="rows per request")
    p.add_argument("--users", nargs="+", type=int, default=[1, 4, 8, 16], help="concurrent locust users")
    p.add_argument("--duration", type=float, default=12.0, help="measured seconds per scenario")
    p.add_argument("--warmup", type=float, default=3.0, help="discarded seconds before each scenario")
    p.add_argument("--sla-ms", type=float, default=10.0, help="p99 latency bound of the headline")
    p.add_argument("--fail-ratio", type=float, default=0.2, help="locust stops a run above this failure share")
    p.add_argument("--no-pin", action="store_true", help="do not pin servers and locust to separate cores")
    p.add_argument("--data-file", default=None, help="held-out Criteo TSV (default: synthesized)")
    p.add_argument("--triton-http-url", default=None, help="use a running server (http://host:port)")
    p.add_argument("--triton-grpc-url", default=None, help="use a running server (grpc://host:port)")
    p.add_argument("--triton-native-http-url", default=None,
                   help="use a running server of the native layout (http://host:port)")
    p.add_argument("--triton-native-grpc-url", default=None,
                   help="use a running server of the native layout (grpc://host:port)")
    p.add_argument("--inproc-url", default=None, help="use a running inproc baseline (http://host:port)")
    p.add_argument("--naive-url", default=None, help="use a running naive baseline (http://host:port)")
    p.add_argument("--mlserver-url", default=None, help="use a running mlserver baseline (http://host:port)")
    p.add_argument("--overload-seconds", type=float, default=10.0,
                   help="overload scenario: seconds of open-loop load at 2x capacity on triton-http (0: skip)")
    p.add_argument("--perf-analyzer-concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32],
                   help="Triton's perf_analyzer sweep on triton-http and triton-grpc: clients in flight")
    p.add_argument("--no-perf-analyzer", action="store_true", help="skip the perf_analyzer sweep")
    p.add_argument("--latency-summaries", action="store_true",
                   help="start the tritonservers with Triton's latency summaries on (ensemble serve --latency-summaries)")


@dataclass(frozen=True)
class Pinning:
    server: str | None
    load: str | None

    @classmethod
    def choose(cls, enabled: bool) -> "Pinning":
        cores = sorted(os.sched_getaffinity(0))
        if not enabled or len(cores) < 2 or not _has_taskset():
            return cls(None, None)
        return cls(str(cores[-1]), ",".join(map(str, cores[:-1])))

    def prefix(self, cpus: str | None) -> list[str]:
        return ["taskset", "-c", cpus] if cpus else []


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


class Servers:
    """Starts what the targets need (unless given URLs) and stops all of it on exit."""

    def __init__(self, options: RunnerOptions, pinning: Pinning, log_dir: Path):
        self.options, self.pinning, self.log_dir = options, pinning, log_dir
        self.stack = contextlib.ExitStack()
        self.triton: dict[Layout, object] = {}
        self.baselines: dict[str, subprocess.Popen] = {}
        self.urls = dict(options.urls)

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def url(self, target: str) -> str:
        if target in self.urls:
            return self.urls[target]
        layout = Target(target).layout
        if layout is not None:
            self._start_triton(layout)
        else:
            self._start_baseline(target)
        return self.urls[target]

    def _start_triton(self, layout: Layout) -> None:
        from ensemble.operate.monitoring import LatencySummaries
        from ensemble.operate.server import ServerOptions, TritonServer
        from ensemble.base.machine import free_port

        log = self.log_dir / f"tritonserver-{layout.value}.log"
        print(f"starting tritonserver ({layout.value} layout; loading the models takes ~10-20 s, log {log}) ...",
              flush=True)
        started = time.monotonic()
        options = ServerOptions(self.options.repository, http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), log_file=log, cpu_list=self.pinning.server, layout=layout,
                                latency_summaries=LatencySummaries(self.options.latency_summaries))
        server = TritonServer(options).start()
        print(f"tritonserver ({layout.value}) ready after {time.monotonic() - started:.1f} s", flush=True)
        self.triton[layout] = server
        self.stack.callback(server.stop)
        for target in Target:
            if target.layout is layout:
                scheme = "grpc" if target.grpc else "http"
                self.urls.setdefault(target.value, f"{scheme}://{server.grpc_url if target.grpc else server.http_url}")

    def _start_baseline(self, kind: str) -> None:
        from ensemble.base.machine import free_port

        port = free_port()
        env = None
        if kind == Target.MLSERVER.value:
            from loadtest.baselines import mlserver

            mlserver.install()
            folder = mlserver.write_folder(self.log_dir / "mlserver", self.options.repository, port, free_port(),
                                           free_port())
            cmd, env = mlserver.command(folder), mlserver.environment()
        else:
            cmd = [sys.executable, "-m", "ensemble", "baseline-serve", "--kind", kind,
                   "--repository", str(self.options.repository), "--port", str(port)]
        log = open(self.log_dir / f"{kind}.log", "ab")
        self.stack.callback(log.close)
        process = subprocess.Popen([*self.pinning.prefix(self.pinning.server), *cmd], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.stack.callback(lifecycle.terminate, process)
        url = f"http://127.0.0.1:{port}"
        print(f"starting the {kind} baseline (log {self.log_dir / f'{kind}.log'}) ...", flush=True)
        started = time.monotonic()
        lifecycle.wait_ready(url, process, what=f"baseline {kind}")
        print(f"{kind} baseline ready after {time.monotonic() - started:.1f} s", flush=True)
        self.urls[kind] = url
        self.baselines[kind] = process

    def cpu_seconds(self, target: str) -> dict[str, float] | None:
        """CPU seconds used so far by the target's server processes, if this runner started them
        (Triton: the server and one entry per model stub; a baseline: its one process)."""
        layout = Target(target).layout
        if layout is not None:
            own = layout in self.triton and target not in self.options.urls
            return self.triton[layout].cpu_seconds() if own else None
        if target in self.baselines:
            from ensemble.operate import processes

            return {target: processes.cpu_seconds(self.baselines[target].pid)}
        return None

    def triton_stats_url(self, target: str) -> str | None:
        layout = Target(target).layout
        if layout is None:
            return None
        http = self.urls.get(Target.TRITON_NATIVE_HTTP.value if layout is Layout.NATIVE else Target.TRITON_HTTP.value)
        if http is None and layout in self.triton:
            http = f"http://{self.triton[layout].http_url}"
        return f"{http}/v2/models/stats" if http else None


def served_rows_per_s(result: dict, rows: int) -> float:
    """Rows answered per second: locust's requests/s counts failed requests too (the ranker's
    503s among them), and a refused request serves no rows."""
    requests = result["requests"]
    answered = (requests - result["failures"]) / requests if requests else 0.0
    return result["requests_per_s"] * answered * rows


def locust_command(target: str, url: str, rows: int, users: int, seconds: float, options: RunnerOptions,
                   data_file: Path, pinning: Pinning, csv_prefix: Path | None) -> list[str]:
    user_class = "TritonGrpcUser" if Target(target).grpc else "JsonUser"
    cmd = [*pinning.prefix(pinning.load), sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class,
           "--headless", "-u", str(users), "-r", str(users), "-t", f"{max(1, int(seconds))}s", "--host", url,
           "--data-file", str(data_file), "--rows-per-request", str(rows), "--fail-ratio-stop",
           str(options.fail_ratio), "--stop-timeout", "5", "--only-summary", "--loglevel", "WARNING"]
    if Target(target).strict_json:
        cmd.append("--strict-json")
    if csv_prefix is not None:
        cmd += ["--csv", str(csv_prefix)]
    return cmd


def read_locust_csv(prefix: Path) -> dict[str, float]:
    """The Aggregated row of ``<prefix>_stats.csv``."""
    with open(f"{prefix}_stats.csv", newline="") as handle:
        row = next(r for r in csv.DictReader(handle) if r["Name"] == "Aggregated")
    number = lambda key: float(row[key]) if row.get(key) not in (None, "", "N/A") else float("nan")  # noqa: E731
    return {"requests": number("Request Count"), "failures": number("Failure Count"),
            "requests_per_s": number("Requests/s"), "mean_ms": number("Average Response Time"),
            "p50_ms": number("50%"), "p90_ms": number("90%"), "p99_ms": number("99%"), "max_ms": number("Max Response Time")}


def read_locust_failures(prefix: Path, limit: int = 5) -> list[str]:
    """What failed, from ``<prefix>_failures.csv``: "<error> (xN)" per distinct error, the first
    ``limit`` of them (a failed request's text is otherwise only in locust's captured output)."""
    try:
        with open(f"{prefix}_failures.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
    except FileNotFoundError:
        return []
    return [f"{row.get('Error', '')[:300]} (x{row.get('Occurrences', '?')})" for row in rows[:limit]]


def run_scenario(servers: Servers, target: str, rows: int, users: int, options: RunnerOptions,
                 data_file: Path, pinning: Pinning, raw_dir: Path) -> dict:
    url = servers.url(target)
    bound = options.warmup + options.duration + 45
    base = {"target": target, "rows": rows, "users": users}
    warm = locust_command(target, url, rows, users, options.warmup, options, data_file, pinning, None)
    prefix = raw_dir / f"{target}_rows{rows}_users{users}"
    cmd = locust_command(target, url, rows, users, options.duration, options, data_file, pinning, prefix)
    try:
        subprocess.run(warm, capture_output=True, timeout=bound, check=False)
        before = model_stats(servers.triton_stats_url(target))
        cpu_before = servers.cpu_seconds(target)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=bound, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run has killed locust; record, go on
        return {**base, "exit_code": None, "requests": 0.0, "failures": 0.0, "requests_per_s": 0.0,
                "mean_ms": math.inf, "p50_ms": math.inf, "p90_ms": math.inf, "p99_ms": math.inf,
                "max_ms": math.inf, "stages": {}, "server_cpu_ms": {}, "rows_per_s": 0.0, "fail_ratio": 1.0,
                "note": f"locust did not finish within {bound:.0f} s"}
    after = model_stats(servers.triton_stats_url(target))
    cpu_after = servers.cpu_seconds(target)
    result = {**base, "exit_code": done.returncode, **read_locust_csv(prefix), "stages": stage_times(before, after)}
    result["errors"] = read_locust_failures(prefix)
    result["server_cpu_ms"] = cpu_per_request(cpu_before, cpu_after, result["requests"])
    result["rows_per_s"] = served_rows_per_s(result, rows)
    result["fail_ratio"] = result["failures"] / result["requests"] if result["requests"] else 1.0
    if done.returncode not in (0, 1):
        result["note"] = (done.stderr or "")[-500:]
    return result


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def holdout_file(options: RunnerOptions) -> Path:
    if options.data_file is not None:
        return options.data_file
    path = options.out / "holdout.tsv"
    if not path.exists():
        from ensemble.data import criteo  # pandas: only when a run needs data

        print(f"writing 5,000 synthetic held-out rows to {path} (no --data-file given)", flush=True)
        criteo.write_criteo(criteo.synthesize(criteo.SynthConfig(rows=5000, seed=99_991)).frame, path)
    return path


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def run(options: RunnerOptions) -> Path:
    """Run every scenario and write the report folder; returns the path of report.md."""
    from loadtest.report import write_report

    out = Path(options.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    pinning = Pinning.choose(options.pin)
    data_file = holdout_file(options)
    results: list[dict] = []
    started = time.time()
    previous = signal.signal(signal.SIGTERM, _raise_exit)  # SIGTERM still stops the servers
    with contextlib.ExitStack() as restore, Servers(options, pinning, out) as servers:
        restore.callback(signal.signal, signal.SIGTERM, previous)
        matrix = [(t, r, u) for t in options.targets for r in options.rows for u in options.users]
        each = options.warmup + options.duration + 2  # + locust's start and stop
        print(f"{len(matrix)} scenarios of {options.warmup:g} s warm-up + {options.duration:g} s measured: "
              f"about {_minutes(len(matrix) * each)}, plus server starts", flush=True)
        for number, (target, rows, users) in enumerate(matrix, 1):
            servers.url(target)  # starts its server first (with its own progress lines)
            print(f"[{number}/{len(matrix)}] {target} rows {rows} users {users} "
                  f"({_minutes((len(matrix) - number + 1) * each)} left) ...", end=" ", flush=True)
            result = run_scenario(servers, target, rows, users, options, data_file, pinning, raw)
            results.append(result)
            print(f"{result['requests_per_s']:,.1f} req/s, {result['rows_per_s']:,.0f} rows/s, "
                  f"p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms, failures {result['failures']:.0f}",
                  flush=True)
        found = run_overload(servers, options, pinning)
        analyzed = run_perf_analyzer(servers, options, pinning)
    return write_report(out, results, options, pinning, time.time() - started, overload=found,
                        perf_analyzer=analyzed)


def run_perf_analyzer(servers: "Servers", options: RunnerOptions, pinning: Pinning) -> list[dict] | None:
    """Triton's perf_analyzer sweep (loadtest/perf_analyzer.py) on the HTTP and gRPC endpoints of
    the fused and native servers that this run measures, on the load generator's cores; None when
    skipped."""
    from dataclasses import asdict

    from loadtest import perf_analyzer

    swept = [t for t in (Target.TRITON_HTTP, Target.TRITON_GRPC, Target.TRITON_NATIVE_HTTP, Target.TRITON_NATIVE_GRPC)
             if t.value in options.targets]
    if not options.perf_analyzer or not swept:
        return None
    try:
        tool = perf_analyzer.install()
    except perf_analyzer.ToolError as exc:
        print(f"perf_analyzer skipped: {exc}", flush=True)
        return None
    points = []
    for target in swept:
        url = {"grpc" if target.grpc else "http": servers.url(target.value).split("://", 1)[-1]}
        points += perf_analyzer.sweep(tool, url, tuple(options.rows), options.perf_analyzer, cpus=pinning.load,
                                      target=target.value)
    return [asdict(p) for p in points]


def run_overload(servers: "Servers", options: RunnerOptions, pinning: Pinning) -> dict | None:
    """The overload scenario (loadtest/openloop.py) on the triton-http target, the generator in a
    subprocess on the load generator's cores; None when skipped or that target is not run."""
    if options.overload_seconds <= 0 or Target.TRITON_HTTP.value not in options.targets:
        return None
    result = Path(options.out) / "raw" / "overload.json"
    address = servers.url(Target.TRITON_HTTP.value).split("://", 1)[-1]
    cmd = [*pinning.prefix(pinning.load), sys.executable, "-m", "loadtest.openloop", "--url", address,
           "--seconds", str(options.overload_seconds), "--json", str(result)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=options.overload_seconds + 120, check=False)
    except subprocess.TimeoutExpired:
        return {"note": "the open-loop generator did not finish", "runs": []}
    print(done.stdout, flush=True)
    return json.loads(result.read_text()) if result.is_file() else {"note": done.stderr[-500:], "runs": []}
