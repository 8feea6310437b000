"""Interactive requests beside a flood of bulk ones: do they keep their latency objective?

A server with a latency objective (``--objective-ms``) takes a flood of bulk requests (``--bulk``
clients, each sending ``--bulk-rows``-row requests marked bulk with a 600 s timeout, back to back, each
refusal retried at once) and, beside it, an open loop of 1-row interactive requests at ``--rate``
per second. Phases alternate, with and without the flood, so the VM's drifts hit both alike. For the
interactive requests the table gives how many were answered, refused (503) or failed, and the
answered ones' p50, p99 and the share past the objective; for the flood, the rows scored a second.

Not a test: prints a table and writes ``<out>/bulk-flood.json``. ::

    .venv/bin/python -m benchmarks.bulk_flood --repository model_repository --objective-ms 50 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import percentile, write_results
from ensemble.base.machine import summary


def _flood(url: str, rows, stop: threading.Event, scored: list[int]) -> None:
    from clients.triton import RankerClient, Retry
    from ensemble import schema

    client = RankerClient(url, "http", retry=Retry(attempts=1), priority=schema.Priority.BATCH, timeout=600.0)
    dense, cats = rows
    while not stop.is_set():
        try:
            client.score(dense, cats)
            scored.append(len(dense))
        except Exception:  # noqa: BLE001 - a refused bulk request is sent again at once
            pass
    client.close()


def _interactive(url: str, rows, rate: float, seconds: float, objective_s: float) -> dict:
    """An open loop: 1-row requests sent at ``rate`` a second for ``seconds`` (each on a pool thread)."""
    from clients.triton import RankerClient, Retry

    local = threading.local()
    dense, cats = rows
    latencies, refused, failed = [], [], []

    def one(k: int, due: float) -> None:
        if getattr(local, "client", None) is None:
            local.client = RankerClient(url, "http", retry=Retry(attempts=1), timeout=10.0)
        time.sleep(max(0.0, due - time.perf_counter()))
        start = time.perf_counter()
        try:
            local.client.score(dense[k % len(dense):k % len(dense) + 1], cats[k % len(cats):k % len(cats) + 1])
            latencies.append(time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - counted
            (refused if "503" in str(exc) or "refused" in str(exc) else failed).append(str(exc)[:200])

    count = int(rate * seconds)
    begin = time.perf_counter() + 0.05
    with ThreadPoolExecutor(32) as pool:
        for k in range(count):
            pool.submit(one, k, begin + k / rate)
    return {"sent": count, "answered": len(latencies), "refused": len(refused), "failed": len(failed),
            "p50_ms": percentile(latencies, 0.5) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
            "late": sum(t > objective_s for t in latencies), "errors": failed[:3]}


def run(repository: Path, objective_ms: float, rounds: int, seconds: float, rate: float, bulk: int, bulk_rows: int,
        server_cpus: str | None, layout: str = "native") -> list[dict]:
    from ensemble.base.grpc_polling import import_grpc

    import_grpc()
    from ensemble.data import criteo
    from ensemble.features import transforms
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port

    frame = criteo.synthesize(criteo.SynthConfig(rows=bulk_rows, scale=0.01, seed=23)).frame
    dense, cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
    options = ServerOptions(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            cpu_list=server_cpus, latency_objective_ms=objective_ms, layout=layout)
    results = []
    with TritonServer(options) as server:
        for round_ in range(rounds):
            for flooded in (False, True):
                stop, scored = threading.Event(), []
                threads = [threading.Thread(target=_flood, args=(server.http_url, (dense, cats), stop, scored), daemon=True)
                           for _ in range(bulk if flooded else 0)]
                for t in threads:
                    t.start()
                time.sleep(1.0 if flooded else 0.2)  # the flood's queue built before measuring
                before, start = len(scored), time.perf_counter()
                point = _interactive(server.http_url, (dense[:1000], cats[:1000]), rate, seconds, objective_ms / 1e3)
                point.update(round=round_ + 1, flood=flooded,
                             bulk_rows_per_s=(sum(scored[before:]) / (time.perf_counter() - start)) if flooded else 0.0)
                stop.set()
                for t in threads:
                    t.join(60)
                results.append(point)
                print({k: v for k, v in point.items() if k != "errors"}, flush=True)
    return results


def table(results: list[dict], objective_ms: float) -> str:
    lines = [f"| round | flood | interactive sent | answered | refused | failed | p50 ms | p99 ms | past {objective_ms:g} ms "
             "| bulk rows/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['round']} | {'yes' if r['flood'] else 'no'} | {r['sent']} | {r['answered']} | {r['refused']} | "
                     f"{r['failed']} | {r['p50_ms']:.2f} | {r['p99_ms']:.1f} | {r['late']} | {r['bulk_rows_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="model_repository", help="an exported model repository")
    p.add_argument("--objective-ms", type=float, default=50.0, help="the server's latency objective")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="per phase")
    p.add_argument("--rate", type=float, default=100.0, help="interactive requests a second")
    p.add_argument("--bulk", type=int, default=8, help="bulk clients in the flood")
    p.add_argument("--bulk-rows", type=int, default=4096, help="rows per bulk request")
    p.add_argument("--server-cpus", default=None, help="run the server under taskset -c on these CPUs")
    p.add_argument("--layout", choices=["native", "fused"], default="native", help="the CPU layout served")
    p.add_argument("--out", default="build/bench", help="folder of bulk-flood.json")
    args = p.parse_args(argv)
    machine = summary()
    results = run(Path(args.repository), args.objective_ms, args.rounds, args.seconds, args.rate, args.bulk,
                  args.bulk_rows, args.server_cpus, args.layout)
    print(table(results, args.objective_ms))
    write_results(args.out, "bulk-flood.json", "benchmarks.bulk_flood", machine, results=results,
                  objective_ms=args.objective_ms, rate=args.rate, bulk=args.bulk, bulk_rows=args.bulk_rows,
                  layout=args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
