"""Ranking by ids against ranking with inline features: what the online store's lookup costs.

MovieLens 100k materialized into a local redis-server; the native layout's ``rank`` model serves 1 user
and 100 candidate movies either with their features in the request (inline, built from the same
stored rows) or by ids, with the lookup cache off (every lookup a store round trip: cold) or on and
warmed (warm). Two servers run at once, one per cache setting, both pinned with Redis to one core
(``--redis-cpus`` puts Redis elsewhere); the clients run on the other.

1. Sequential: one client, one request at a time, HTTP and gRPC; the variants alternate in blocks so
   the VM's drifts in speed hit each alike; p50/p99 and the ids/inline ratio per round.
2. Throughput: ``wrk`` (C, one thread) with 16 connections posting the same JSON body back to back,
   inline against ids (cold and warm), alternating; answered requests/s and the ratio.

Not a test: prints the tables and writes ``<out>/rank-ids.json``. ::

    .venv/bin/python -m benchmarks.rank_ids --repository build/movielens-repository --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import percentile, write_results
from benchmarks.closed_loop import _LUA, wrk
from ensemble import dataset, online
from ensemble.online import materialize
from ensemble.base.machine import summary
from ensemble.models.registry import Layout

CANDIDATES = 100


def _requests(store_url: str, count: int, seed: int = 3) -> list[tuple[str, list[str], online.Rows]]:
    """``count`` (user, 100 item ids, the stored rows an inline request carries) triples."""
    rng = np.random.default_rng(seed)
    lookup = online.FeatureLookup(store_url, "movielens100k", cache_entries=0, timeout_s=5)
    out = []
    for _ in range(count):
        user = str(rng.integers(1, 944))
        items = [str(i) for i in rng.choice(np.arange(1, 1683), CANDIDATES, replace=False)]
        out.append((user, items, lookup.rows(user.encode(), [i.encode() for i in items])))
    lookup.close()
    return out


def _json_body(tensors: list[tuple[str, str, list, list]]) -> bytes:
    return json.dumps({"inputs": [{"name": n, "datatype": t, "shape": s, "data": d} for n, t, s, d in tensors],
                       "outputs": [{"name": "order"}]}).encode()


def _bodies(folder: Path, user: str, items: list[str], rows: online.Rows) -> dict[str, Path]:
    inline = _json_body([
        ("context_dense", "FP32", [int(rows.context_dense.size)], rows.context_dense.tolist()),
        ("context_categorical", "BYTES", [int(rows.context_categorical.size)],
         [v.decode() for v in rows.context_categorical]),
        ("candidate_dense", "FP32", list(rows.candidate_dense.shape), rows.candidate_dense.ravel().tolist()),
        ("candidate_categorical", "BYTES", list(rows.candidate_categorical.shape),
         [v.decode() for v in rows.candidate_categorical.ravel()])])
    ids = _json_body([("user_id", "BYTES", [1], [user]), ("item_ids", "BYTES", [len(items)], items)])
    paths = {"inline": folder / "inline.json", "ids": folder / "ids.json"}
    paths["inline"].write_bytes(inline)
    paths["ids"].write_bytes(ids)
    return paths


def _round_trips(server) -> dict:
    """The server's store round trips so far and their mean (its ensemble_store_round_trip* counters)."""
    import urllib.request

    from ensemble.operate.monitoring import parse_exposition

    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        samples = parse_exposition(reply.read().decode())
    trips = sum(v for _, v in samples.get("ensemble_store_round_trips_total", []))
    seconds = sum(v for _, v in samples.get("ensemble_store_round_trip_seconds_total", []))
    return {"round_trips": trips, "mean_us": seconds / trips * 1e6 if trips else float("nan")}


def _sequential(clients: dict, requests, count: int) -> dict[str, list[float]]:
    """Latencies (ms) of ``count`` requests per variant, one variant after the other."""
    out = {}
    for variant, (client, kind) in clients.items():
        times = []
        for i in range(count):
            user, items, rows = requests[i % len(requests)]
            start = time.perf_counter()
            if kind == "inline":
                client.rank((rows.context_dense, rows.context_categorical),
                            (rows.candidate_dense, rows.candidate_categorical))
            else:
                client.rank_ids(user, items)
            times.append((time.perf_counter() - start) * 1e3)
        out[variant] = times
    return out


def run(args) -> dict:
    from clients.triton import RankerClient, Retry
    from ensemble.data import movielens
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port, free_ports
    from ensemble.online.local import LocalRedis

    work = Path(tempfile.mkdtemp(prefix="rank-ids-"))
    redis = LocalRedis(free_port(), work)
    redis_command = redis.command()
    redis.command = lambda: ["taskset", "-c", args.redis_cpus or args.server_cpus, *redis_command]
    redis.start()
    servers = {}
    try:
        spec = dataset.load_spec(movielens.SPEC)
        report = materialize.materialize(spec, movielens.load(), redis.url)
        for name, entries in (("cold", 0), ("warm", 100_000)):
            http, grpc, metrics = free_ports(3)
            servers[name] = TritonServer(ServerOptions(
                Path(args.repository), http_port=http, grpc_port=grpc, metrics_port=metrics, layout=Layout.NATIVE,
                cpu_list=args.server_cpus, log_file=work / f"tritonserver-{name}.log",
                store=online.StoreSettings(redis.url, cache_entries=entries))).start()
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
        requests = _requests(redis.url, 50)
        clients = {}
        for protocol in ("http", "grpc"):
            def client(server, protocol=protocol):
                url = server.http_url if protocol == "http" else server.grpc_url
                return RankerClient(url, protocol, dataset=spec, retry=Retry(attempts=1))
            clients[f"inline-{protocol}"] = (client(servers["warm"]), "inline")
            clients[f"ids-cold-{protocol}"] = (client(servers["cold"]), "ids")
            clients[f"ids-warm-{protocol}"] = (client(servers["warm"]), "ids")
        _sequential(clients, requests, 100)  # warm-up: every variant, and the warm server's cache
        rounds = []
        for r in range(args.rounds):
            times = _sequential(clients, requests, args.requests)
            point = {v: {"p50_ms": percentile(t, 0.5), "p99_ms": percentile(t, 0.99)} for v, t in times.items()}
            for protocol in ("http", "grpc"):
                base = point[f"inline-{protocol}"]["p50_ms"]
                for cache in ("cold", "warm"):
                    point[f"ids-{cache}-{protocol}"]["p50_vs_inline"] = point[f"ids-{cache}-{protocol}"]["p50_ms"] / base
            rounds.append(point)
            print(f"round {r + 1}: " + ", ".join(f"{v} {p['p50_ms']:.3f} ms" for v, p in point.items()), flush=True)

        trips = _round_trips(servers["cold"])  # every cold lookup is one: the mean store round trip in the server
        print(f"store round trips in the cold server: {trips['round_trips']:.0f}, mean {trips['mean_us']:.0f} us",
              flush=True)
        throughput = []
        if shutil.which("wrk") and args.seconds > 0:
            script = work / "post.lua"
            script.write_text(_LUA)
            user, items, rows = requests[0]
            bodies = _bodies(work, user, items, rows)
            for r in range(args.rounds):
                point = {}
                for variant, server, body in (("inline", "warm", "inline"), ("ids-cold", "cold", "ids"),
                                              ("ids-warm", "warm", "ids")):
                    point[variant] = wrk(f"http://{servers[server].http_url}", bodies[body], script,
                                         args.connections, args.seconds, args.client_cpus, "/v2/models/rank/infer")
                for variant in ("ids-cold", "ids-warm"):
                    point[variant]["vs_inline"] = point[variant]["answered_per_s"] / point["inline"]["answered_per_s"]
                throughput.append(point)
                print(f"throughput round {r + 1}: " + ", ".join(
                    f"{v} {p['answered_per_s']:.0f}/s" for v, p in point.items()), flush=True)
        return {"materialize": report.as_dict(), "sequential": rounds, "store_round_trip": trips,
                "throughput": throughput,
                "candidates": CANDIDATES, "connections": args.connections}
    finally:
        for server in servers.values():
            server.stop()
        redis.stop()


def table(results: dict) -> str:
    lines = ["sequential, 1 user + 100 ids (p50 ms; ids/inline)",
             "| round | variant | p50 ms | p99 ms | p50 / inline |", "|---|---|---|---|---|"]
    for r, point in enumerate(results["sequential"], 1):
        for variant, p in point.items():
            lines.append(f"| {r} | {variant} | {p['p50_ms']:.3f} | {p['p99_ms']:.3f} | "
                         f"{p.get('p50_vs_inline', 1.0):.2f}x |")
    if results["throughput"]:
        lines += ["", f"throughput, {results['connections']} connections (wrk, HTTP JSON)",
                  "| round | variant | answered/s | p50 ms | non-200 | / inline |", "|---|---|---|---|---|---|"]
        for r, point in enumerate(results["throughput"], 1):
            for variant, p in point.items():
                lines.append(f"| {r} | {variant} | {p['answered_per_s']:.0f} | {p['p50_ms']:.2f} | {p['non_200']} | "
                             f"{p.get('vs_inline', 1.0):.2f}x |")
    trips = results["store_round_trip"]
    lines += ["", f"store round trips in the cold server: {trips['round_trips']:.0f}, mean {trips['mean_us']:.0f} us"]
    m = results["materialize"]
    sides = ", ".join(f"{s['side']} {s['entities']}" for s in m["sides"])
    lines += ["", f"materialize: {sides} entities in "
                  f"{m['seconds']:.2f} s; store memory {(m['memory_after'] - m['memory_before']) / 2**20:.2f} MiB more"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repository", required=True, help="a MovieLens 100k export (ensemble demo --dataset movielens100k)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=300, help="sequential requests per variant per round")
    p.add_argument("--seconds", type=float, default=8.0, help="wrk seconds per variant per round (0: skip)")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--server-cpus", default="1", help="taskset CPU list of the servers and Redis")
    p.add_argument("--client-cpus", default="0", help="CPU list of the clients and wrk")
    p.add_argument("--redis-cpus", default=None, help="CPU list of redis-server (default: the servers')")
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    machine = summary()  # before run() pins this process to the clients' CPUs
    results = run(args)
    print(table(results))
    write_results(args.out, "rank-ids.json", "benchmarks.rank_ids", machine, **results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
