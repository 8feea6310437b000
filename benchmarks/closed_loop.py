"""Closed loops of JSON requests against the served ranker and the Python servers a user could run
instead, on one core each: the issue's ratio targets (Triton's goodput over ``inproc`` and MLServer
at 1, 4 and 16 connections, for 1- and 100-row requests).

Not a test: prints a table and writes ``<out>/closed-loop-wrk.json`` (machine, command, every point).
The load generator is ``wrk`` (Debian's ``wrk`` package; C, one thread, so it is not the bottleneck
the way a Python generator is at 100-row requests), pinned to ``--client-cpus``; every server is
pinned to ``--server-cpus`` and started before the first point, idle while another is measured.
Every server gets the same bodies: ``schema.v2_json_request`` of seeded synthetic Criteo rows with
missing dense values sent as 0 (MLServer's JSON parser refuses a bare ``NaN``). Points run in rounds;
each round measures every server at every point, the server order flipping every round, so the VM's
drifts in speed hit all alike; a ratio is taken within a round. Answers other than 200 are counted,
not scored. Usage (after ``make demo``)::

    .venv/bin/python -m benchmarks.closed_loop --repository model_repository
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.base.machine import summary

TARGETS = ("triton-native-http", "inproc", "mlserver")
TRITON = TARGETS[0]

# wrk's script: POST the body file named by $BODY; one parseable line at the end.
_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("BODY"), "rb")
wrk.body = f:read("*all")
f:close()
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %.3f %.3f\\n", summary.requests, summary.duration,
           e.connect + e.read + e.write + e.timeout, latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


def bodies(folder: Path, sizes: tuple[int, ...], seed: int = 7) -> dict[int, Path]:
    """One JSON body per request size, missing dense values as 0."""
    from ensemble.data import criteo
    from ensemble.features import transforms

    frame = criteo.synthesize(criteo.SynthConfig(rows=max(sizes), scale=0.01, seed=seed)).frame
    paths = {}
    for rows in sizes:
        part = frame.iloc[:rows]
        dense = np.nan_to_num(transforms.dense_array(part), nan=0.0)
        paths[rows] = folder / f"body-{rows}.json"
        paths[rows].write_bytes(schema.v2_json_request(dense, transforms.encode_categorical(part)))
    return paths


def wrk(url: str, body: Path, script: Path, connections: int, seconds: float, cpus: str | None,
        path: str = schema.RANKER_INFER_PATH) -> dict:
    """One closed loop posting ``body`` to ``url`` + ``path``: answered requests/s (200s only), errors,
    p50/p99 ms."""
    command = [*(["taskset", "-c", cpus] if cpus else []), "wrk", "-t1", f"-c{connections}",
               f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), f"{url}{path}"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 60,
                          env={"BODY": str(body), "PATH": "/usr/bin:/bin"})
    result = next(line.split() for line in done.stdout.splitlines() if line.startswith("RESULT"))
    requests, micros, errors = int(result[1]), int(result[2]), int(result[3])
    refused = next((int(line.split()[-1]) for line in done.stdout.splitlines() if "Non-2xx" in line), 0)
    return {"answered_per_s": (requests - refused) / (micros / 1e6), "non_200": refused, "socket_errors": errors,
            "p50_ms": float(result[4]), "p99_ms": float(result[5])}


def run(args) -> list[dict]:
    from loadtest.runner import Pinning, RunnerOptions, Servers

    work = Path(tempfile.mkdtemp(prefix="closed-loop-"))
    script = work / "post.lua"
    script.write_text(_LUA)
    paths = bodies(work, tuple(args.rows))
    options = RunnerOptions(repository=Path(args.repository), out=work, targets=tuple(args.targets),
                            latency_summaries=args.latency_summaries)
    results = []
    with Servers(options, Pinning(args.server_cpus, args.client_cpus), work) as servers:
        urls = {target: servers.url(target) for target in args.targets}
        for rows in args.rows:  # warm every server at every size once
            for url in urls.values():
                wrk(url, paths[rows], script, 4, 2, args.client_cpus)
        for round_ in range(args.rounds):
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for rows in args.rows:
                for connections in args.connections:
                    for target in order:
                        point = wrk(urls[target], paths[rows], script, connections, args.seconds, args.client_cpus)
                        point.update(round=round_ + 1, target=target, rows=rows, connections=connections,
                                     rows_per_s=point["answered_per_s"] * rows)
                        results.append(point)
                        print(f"round {round_ + 1} {target} {rows} row(s) x {connections}: "
                              f"{point['rows_per_s']:,.0f} rows/s, p99 {point['p99_ms']:.1f} ms, "
                              f"non-200 {point['non_200']}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return results


def ratios(results: list[dict]) -> list[dict]:
    """Triton's answered rows/s over each other target's, per round, and their median, per point."""
    rows_out = []
    points = dict.fromkeys((r["rows"], r["connections"]) for r in results)
    for rows, connections in points:
        at = {(r["target"], r["round"]): r["rows_per_s"] for r in results if (r["rows"], r["connections"]) == (rows, connections)}
        for other in dict.fromkeys(t for t, _ in at):
            if other == TRITON:
                continue
            per_round = [at[(TRITON, k)] / at[(other, k)] for t, k in at if t == other and (TRITON, k) in at and at[(other, k)]]
            if per_round:
                rows_out.append({"rows": rows, "connections": connections, "over": other, "per_round": per_round,
                                 "median": statistics.median(per_round)})
    return rows_out


def _table(results: list[dict]) -> str:
    targets = list(dict.fromkeys(r["target"] for r in results))
    lines = ["| rows | connections | " + " | ".join(f"{t}: rows/s (rounds), p99 ms" for t in targets) + " |",
             "| --- | --- | " + " | ".join("---" for _ in targets) + " |"]
    for rows, connections in dict.fromkeys((r["rows"], r["connections"]) for r in results):
        cells = []
        for target in targets:
            mine = [r for r in results if (r["rows"], r["connections"], r["target"]) == (rows, connections, target)]
            refused = sum(r["non_200"] + r["socket_errors"] for r in mine)
            cells.append(" / ".join(f"{r['rows_per_s']:,.0f}" for r in mine) + ", p99 "
                         + " / ".join(f"{r['p99_ms']:.1f}" for r in mine) + (f", {refused} not 200" if refused else ""))
        lines.append(f"| {rows} | {connections} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in ratios(results):
        lines.append(f"{TRITON} / {r['over']}, {r['rows']} row(s) x {r['connections']}: median {r['median']:.2f}x "
                     f"(rounds: {', '.join(f'{x:.2f}' for x in r['per_round'])})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", required=True, help="an exported model repository")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS[:2]),
                   help="servers to compare (mlserver installs into its own environment on first use)")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100])
    p.add_argument("--connections", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--seconds", type=float, default=8.0, help="per point")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-cpus", default="1", help="taskset CPU list of every server ('' for none)")
    p.add_argument("--client-cpus", default="0", help="taskset CPU list of wrk ('' for none)")
    p.add_argument("--latency-summaries", action="store_true",
                   help="Triton with its latency summaries on (ensemble serve --latency-summaries)")
    p.add_argument("--out", default="docs/results", help="folder of closed-loop-wrk.json")
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        p.error("wrk is not installed (Debian: apt-get install wrk)")
    if TRITON not in args.targets:
        p.error(f"--targets must include {TRITON}: the ratios are Triton's")
    args.server_cpus = args.server_cpus or None
    args.client_cpus = args.client_cpus or None
    machine = summary()
    results = run(args)
    print(_table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "closed-loop-wrk.json"
    path.write_text(json.dumps({"machine": machine, "command": " ".join(["python -m benchmarks.closed_loop", *sys.argv[1:]]),
                                "ratios": ratios(results), "results": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
