"""Soak: a long open-loop run at a fraction of the measured capacity, watching errors and the
server's memory.

``python -m loadtest.soak --minutes 10 --fraction 0.7`` starts a server on the repository (or
loads one given by ``--url`` and ``--pid``), measures capacity as ``loadtest.openloop`` does,
then offers ``fraction`` of it in windows of ``--window`` seconds, reading the resident memory of
every server process (tritonserver and its backend stubs, from /proc) after each window. The
report (Markdown, plus the figures as JSON beside it) says whether the run met the soak targets:
0 errors and memory growth under 5 % from the first window to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


from loadtest.openloop import closed_loop, open_loop, request_bodies, summarize
from loadtest.statistics import percentile

GROWTH_TARGET = 0.05


@dataclass(frozen=True)
class SoakPlan:
    """``seconds`` of load at ``fraction`` of capacity, in windows of ``window`` seconds, after
    ``warmup`` seconds (discarded: the first requests grow caches and allocator pools)."""

    seconds: float = 600.0
    fraction: float = 0.7
    window: float = 10.0
    warmup: float = 15.0
    capacity_users: int = 8
    capacity_seconds: float = 5.0


def soak(address: str, rss: Callable[[], int], plan: SoakPlan = SoakPlan(),
         log: Callable[[str], None] = print) -> dict:
    """Run the soak against ``address`` (host:port, HTTP); ``rss()`` gives the server's resident
    bytes. Returns the figures (see :func:`write_report`)."""
    bodies, _ = request_bodies(rows=1, timeout_s=1.0)
    capacity = asyncio.run(closed_loop(address, bodies, plan.capacity_users, plan.capacity_seconds))
    rate = plan.fraction * capacity
    asyncio.run(open_loop(address, bodies, rate, plan.warmup))
    start_rss = rss()
    windows, accepted_latencies = [], []
    totals = {"sent": 0, "accepted": 0, "refused": 0, "errors": 0, "unsent": 0}
    started = time.monotonic()
    while time.monotonic() - started < plan.seconds - 1e-6:
        outcomes = asyncio.run(open_loop(address, bodies, rate, min(plan.window, plan.seconds)))
        found = summarize(rate, plan.window, outcomes)
        accepted_latencies += [o.latency for o in outcomes if o.status == 200]
        for key in totals:
            totals[key] += getattr(found, key)
        windows.append({"at_s": round(time.monotonic() - started, 1), "accepted_per_s": found.accepted_per_s,
                        "p99_ms": found.accepted_p99_ms, "refused": found.refused, "errors": found.errors,
                        "rss_mib": rss() / 2**20, "errors_seen": found.error_samples})
        log(f"{windows[-1]['at_s']:>7.1f} s  {found.accepted_per_s:7.0f} req/s  p99 {found.accepted_p99_ms:6.1f} ms  "
            f"refused {found.refused}  errors {found.errors}  RSS {windows[-1]['rss_mib']:.0f} MiB")
    end_rss = windows[-1]["rss_mib"] * 2**20 if windows else start_rss
    return {"capacity_per_s": capacity, "rate_per_s": rate, "plan": plan.__dict__, **totals,
            "accepted_p50_ms": float(percentile(accepted_latencies, 0.5) * 1e3) if accepted_latencies else None,
            "accepted_p99_ms": float(percentile(accepted_latencies, 0.99) * 1e3) if accepted_latencies else None,
            "rss_start_mib": start_rss / 2**20, "rss_end_mib": end_rss / 2**20,
            "rss_max_mib": max([w["rss_mib"] for w in windows], default=start_rss / 2**20),
            "rss_growth": (end_rss - start_rss) / start_rss if start_rss else None, "windows": windows}


def write_report(found: dict, path: Path, note: str = "") -> Path:
    """``path`` (Markdown) and ``path.with_suffix('.json')``."""
    from ensemble.base.machine import describe

    machine = describe()
    growth = found["rss_growth"]
    met = found["errors"] == 0 and growth is not None and growth < GROWTH_TARGET
    lines = [
        "# Soak", "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine['arch']}, {machine['cores']} cores "
        f"({machine['cpu']}), no GPU. {note}".rstrip(), "",
        f"{found['plan']['seconds'] / 60:.1f} min of 1-row requests at {found['plan']['fraction']:.0%} of the "
        f"measured capacity ({found['capacity_per_s']:.0f} req/s, closed loop with {found['plan']['capacity_users']} "
        f"in flight) = {found['rate_per_s']:.0f} req/s, open loop (loadtest/openloop.py), after "
        f"{found['plan']['warmup']:g} s of warm-up. Memory: resident set of tritonserver and every backend process "
        "(/proc), after each window.", "",
        "| sent | accepted | refused | errors | not sent (generator behind) | accepted p50 / p99 ms "
        "| RSS start / end / max MiB | RSS growth |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {found['sent']} | {found['accepted']} | {found['refused']} | {found['errors']} | {found.get('unsent', 0)} | "
        f"{found['accepted_p50_ms'] or float('nan'):.1f} / {found['accepted_p99_ms'] or float('nan'):.1f} | "
        f"{found['rss_start_mib']:.0f} / {found['rss_end_mib']:.0f} / {found['rss_max_mib']:.0f} | "
        f"{100 * (growth or 0):+.2f}% |", "",
        f"Targets (0 errors, RSS growth < {GROWTH_TARGET:.0%}): {'met' if met else 'NOT met'}.", "",
        "| at s | accepted/s | p99 ms | refused | errors | RSS MiB |", "| --- | --- | --- | --- | --- | --- |",
        *[f"| {w['at_s']:.0f} | {w['accepted_per_s']:.0f} | {w['p99_ms']:.1f} | {w['refused']} | {w['errors']} | "
          f"{w['rss_mib']:.0f} |" for w in found["windows"]], ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    path.with_suffix(".json").write_text(json.dumps(found, indent=1, default=str))
    return path


def _tree_rss(pid: int) -> Callable[[], int]:
    from ensemble.operate import processes

    return lambda: sum(processes.rss(p) for p in processes.tree(pid))


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the measured run")
    p.add_argument("--fraction", type=float, default=0.7, help="offered load, as a fraction of capacity")
    p.add_argument("--window", type=float, default=10.0, help="seconds between memory readings")
    p.add_argument("--repository", default="model_repository", help="serve this repository (unless --url)")
    p.add_argument("--url", default=None, help="host:port of a running server's HTTP endpoint (needs --pid)")
    p.add_argument("--pid", type=int, default=None, help="that server's tritonserver pid (memory is read from /proc)")
    p.add_argument("--note", default="", help="added to the report's machine line (e.g. what else ran)")
    p.add_argument("--out", default="docs/results/soak-1row-70pct-10min.md", help="report file (and .json beside it)")
    args = p.parse_args(argv)
    plan = SoakPlan(seconds=args.minutes * 60, fraction=args.fraction, window=args.window)
    if args.url:
        if args.pid is None:
            p.error("--url needs --pid (the server's memory is part of the report)")
        found = soak(args.url.split("://", 1)[-1].rstrip("/"), _tree_rss(args.pid), plan)
    else:
        from ensemble.operate.server import ServerOptions, TritonServer
        from ensemble.base.machine import free_port

        options = ServerOptions(Path(args.repository), http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port())
        signal.signal(signal.SIGTERM, _raise_exit)  # a stopped soak stops its server too
        with TritonServer(options) as server:
            found = soak(server.http_url, server.resident_memory_bytes, plan)
    print(f"report: {write_report(found, Path(args.out), args.note)}")
    return 0 if found["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
