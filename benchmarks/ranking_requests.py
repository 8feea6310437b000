"""What a ranking request costs: 1 context + N candidates through the ``rank`` model against the
same N rows sent flat to the ``ranker`` (the context repeated on every row by the client).

Not a test: prints a table and writes ``<out>/ranking-requests.json``. One client, one request at a
time, the server pinned to one core and this process to another; the two kinds of request alternate
in blocks so the VM's drifts in speed hit both alike. Usage (after ``ensemble demo --dataset
movielens100k --repository build/movielens-repository``)::

    .venv/bin/python -m benchmarks.ranking_requests --repository build/movielens-repository --dataset movielens100k
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ensemble import dataset, schema
from ensemble.base.machine import summary
from ensemble.models.registry import Layout
from benchmarks import percentile


def _inputs(spec: dataset.DatasetSpec, candidates: int, seed: int = 11):
    """A context and ``candidates`` candidates from the dataset's own rows when it has a loader
    (MovieLens), else seeded values of the right widths."""
    from clients.inputs import ranking_tensors

    if spec.name == "movielens100k":
        from ensemble.data import movielens

        _, _, test = movielens.time_split(movielens.load())
        return ranking_tensors(test.iloc[0], test.iloc[:candidates], spec)
    rng = np.random.default_rng(seed)
    widths = schema.Widths.of(spec)
    n_dense, n_cats = widths.dense - widths.context_dense, widths.categorical - widths.context_categorical
    return (rng.integers(0, 50, widths.context_dense).astype(np.float32),
            np.array([f"{v:08x}".encode() for v in rng.integers(0, 2**32, widths.context_categorical)], object),
            rng.integers(0, 50, (candidates, n_dense)).astype(np.float32),
            np.array([[f"{v:08x}".encode() for v in row] for row in rng.integers(0, 2**20, (candidates, n_cats))],
                     object))


def run(args) -> list[dict]:
    from clients.triton import RankerClient
    from ensemble.scoring.ranking import broadcast
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port

    spec = dataset.load_spec(args.dataset)
    widths = schema.Widths.of(spec)
    context_dense, context_cats, cand_dense, cand_cats = _inputs(spec, args.candidates)
    flat_dense, flat_cats = broadcast(context_dense, context_cats, cand_dense, cand_cats,
                                      (widths.context_dense, widths.context_categorical))
    if args.client_cpu is not None:
        os.sched_setaffinity(0, {args.client_cpu})
    results = []
    for layout in args.layouts:
        server = TritonServer(ServerOptions(Path(args.repository), http_port=free_port(), grpc_port=free_port(),
                                            metrics_port=free_port(), layout=Layout(layout), cpu_list=args.server_cpus))
        server.start()
        try:
            for protocol in args.protocols:
                client = RankerClient(server.http_url if protocol == "http" else server.grpc_url, protocol,
                                      dataset=spec)
                context = None if not spec.context else (context_dense, context_cats)
                variants = {
                    "flat": lambda: client.infer(flat_dense, flat_cats),
                    "ranking": lambda: client.rank(context, (cand_dense, cand_cats)),
                }
                samples: dict[str, list[float]] = {name: [] for name in variants}
                for fn in variants.values():  # warm-up
                    for _ in range(50):
                        fn()
                for _ in range(args.blocks):
                    for name, fn in variants.items():
                        for _ in range(args.requests // args.blocks):
                            start = time.perf_counter()
                            fn()
                            samples[name].append((time.perf_counter() - start) * 1e3)
                row = {"layout": layout, "protocol": protocol, "candidates": args.candidates}
                for name, values in samples.items():
                    row[f"{name}_p50_ms"] = statistics.median(values)
                    row[f"{name}_p99_ms"] = percentile(values, 0.99)
                row["ranking_over_flat_p50"] = row["ranking_p50_ms"] / row["flat_p50_ms"]
                results.append(row)
                client.close()  # an open connection would hold up the server's stop
                print(f"{layout:<7} {protocol:<5} flat p50 {row['flat_p50_ms']:.3f} p99 {row['flat_p99_ms']:.3f} ms | "
                      f"ranking p50 {row['ranking_p50_ms']:.3f} p99 {row['ranking_p99_ms']:.3f} ms | "
                      f"ratio {row['ranking_over_flat_p50']:.2f}", flush=True)
        finally:
            server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", required=True, help="a repository exported for --dataset")
    p.add_argument("--dataset", default="criteo", help="its spec (built-in name or file)")
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--layouts", nargs="+", default=["fused", "native"])
    p.add_argument("--protocols", nargs="+", default=["http", "grpc"])
    p.add_argument("--requests", type=int, default=2000, help="per kind of request, per layout and protocol")
    p.add_argument("--blocks", type=int, default=10, help="alternating blocks the requests are split into")
    p.add_argument("--server-cpus", default="1", help="taskset CPU list of the server ('' for none)")
    p.add_argument("--client-cpu", type=int, default=0, help="CPU of this process (-1 for none)")
    p.add_argument("--out", default="docs/results", help="folder of ranking-requests.json")
    args = p.parse_args(argv)
    args.server_cpus = args.server_cpus or None
    args.client_cpu = None if args.client_cpu < 0 else args.client_cpu
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ranking-requests-{dataset.load_spec(args.dataset).name}.json"
    path.write_text(json.dumps({"machine": summary(), "command": " ".join(["python -m benchmarks.ranking_requests",
                                                                           *sys.argv[1:]]),
                                "results": results}, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
