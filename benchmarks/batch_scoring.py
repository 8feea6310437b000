"""Batch-scoring throughput: in-process (`--local`) vs through Triton (fused and native layouts) over HTTP and gRPC.

Not a test: prints a table and writes ``<out>/scoring.json`` and ``<out>/scoring.md``. Every
configuration scores the same synthetic file; each is run ``--repeats`` times and the median
rows/s is reported, with its ratio to the fastest ``--local`` run at the same batch size (same
run, same machine). ``--local`` is measured at every ``--concurrency`` the server is, since chunks
in flight speed it up too (``ensemble score --local`` keeps 4 in flight by default). Usage::

    .venv/bin/python -m benchmarks.batch_scoring --repository model_repository
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from clients.partitions import ScoreSettings, local_pipeline
from clients.scoring import score_files
from ensemble.data import criteo
from ensemble.machine import summary
from ensemble.models.registry import Layout


def _rows_per_second(path: Path, out: Path, settings: ScoreSettings, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        summary = score_files([str(path)], str(out), settings, progress=False)
        rates.append(summary.rows_per_second)
    return statistics.median(rates)


def run(args) -> list[dict]:
    from ensemble.serving.server import ServerOptions, TritonServer, free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = criteo.write_criteo(criteo.synthesize(criteo.SynthConfig(rows=args.rows, scale=args.scale, seed=4242)).frame,
                               out / "input.tsv")
    scratch = out / "scored.parquet"
    results: list[dict] = []
    local_pipeline(str(Path(args.repository).resolve()))  # load once: a run measures scoring, not start-up
    for batch in args.batch_sizes:
        for concurrency in args.concurrency:
            settings = ScoreSettings(local=True, repository=args.repository, batch_size=batch, concurrency=concurrency)
            results.append({"target": "local", "batch_size": batch, "concurrency": concurrency,
                            "rows_per_s": _rows_per_second(source, scratch, settings, args.repeats)})
            print(f"local  batch {batch:>5} conc {concurrency}: {results[-1]['rows_per_s']:>9,.0f} rows/s", flush=True)
    given = bool(args.http_url and args.grpc_url)
    for layout in ["server"] if given else args.layouts:  # a running server: its URLs, whatever its layout
        server = None
        urls = {"http": args.http_url, "grpc": args.grpc_url}
        if not given:
            server = TritonServer(ServerOptions(Path(args.repository), http_port=free_port(), grpc_port=free_port(),
                                                metrics_port=free_port(), layout=Layout(layout),
                                                cpu_list=args.server_cpus)).start()
            urls = {"http": server.http_url, "grpc": server.grpc_url}
        try:
            for protocol in ("http", "grpc"):
                for batch in args.batch_sizes:
                    for concurrency in args.concurrency:
                        settings = ScoreSettings(urls=(urls[protocol],), protocol=protocol, batch_size=batch,
                                                 concurrency=concurrency)
                        rate = _rows_per_second(source, scratch, settings, args.repeats)
                        target = f"{layout} {protocol}"
                        results.append({"target": target, "batch_size": batch, "concurrency": concurrency,
                                        "rows_per_s": rate})
                        print(f"{target:<12} batch {batch:>5} conc {concurrency}: {rate:>9,.0f} rows/s", flush=True)
        finally:
            if server is not None:
                server.stop()
    fastest = {batch: max((r for r in results if r["target"] == "local" and r["batch_size"] == batch),
                          key=lambda r: r["rows_per_s"]) for batch in args.batch_sizes}  # the baselines
    for r in results:
        r["vs_local"] = r["rows_per_s"] / fastest[r["batch_size"]]["rows_per_s"]
        r["local_concurrency"] = fastest[r["batch_size"]]["concurrency"]
    return results


def table(results: list[dict]) -> str:
    lines = ["| target | batch size | requests in flight | rows/s (median) | vs the fastest `--local` |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['target']} | {r['batch_size']} | {r['concurrency']} | {r['rows_per_s']:,.0f} "
                     f"| {r['vs_local']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--http-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--grpc-url", default=None)
    parser.add_argument("--layouts", nargs="+", choices=[Layout.FUSED.value, Layout.NATIVE.value],
                        default=[Layout.FUSED.value, Layout.NATIVE.value],
                        help="the server layouts to score through, one server after the other")
    parser.add_argument("--client-cpu", type=int, default=None,
                        help="the one CPU of this process, --local included (a client machine's share)")
    parser.add_argument("--server-cpus", default=None,
                        help="taskset CPU list of the server it starts (default: all of the machine's)")
    parser.add_argument("--out", default="build/bench")
    args = parser.parse_args(argv)
    machine = summary()  # before the client is confined to its CPUs
    if args.client_cpu is not None:
        import os

        everything = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {args.client_cpu})
        if args.server_cpus is None:  # the server would inherit the client's CPUs: give it the machine's
            args.server_cpus = ",".join(map(str, sorted(everything)))
    started = time.time()
    results = run(args)
    placement = (f"; client on CPU {args.client_cpu}" if args.client_cpu is not None else "") + \
        (f"; server on CPUs {args.server_cpus}" if args.server_cpus else "")
    text = (f"Batch scoring of {args.rows:,} synthetic rows; machine: {machine}{placement}; "
            f"median of {args.repeats} runs; {time.strftime('%Y-%m-%d')}\n\n{table(results)}\n")
    print("\n" + text)
    Path(args.out, "scoring.md").write_text(text)
    Path(args.out, "scoring.json").write_text(json.dumps({"machine": machine, "rows": args.rows,
                                                         "client_cpu": args.client_cpu, "server_cpus": args.server_cpus,
                                                         "results": results,
                                                         "seconds": time.time() - started}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
