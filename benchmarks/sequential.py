"""Sequential latency of the served ranker through the project's client, in blocks: what
``make demo`` samples once (300 requests a size and protocol, one client, server not pinned),
repeated so that one block's luck on a VM whose speed moves is visible.

Not a test: prints each point's median and range of block p50 and p99 and writes
``<out>/sequential-latency.json`` (machine, command, every block). ::

    .venv/bin/python -m benchmarks.sequential --repository model_repository --blocks 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks import write_results
from ensemble.base.machine import summary


def run(repository: Path, blocks: int, requests: int, rows: tuple[int, ...], latency_summaries: bool,
        server_cpus: str | None = None) -> list[dict]:
    from ensemble.base.grpc_polling import import_grpc

    import_grpc()  # first, as an `ensemble` command does (the demo's sample is this measurement)
    from clients.triton import RankerClient
    from ensemble.data import criteo
    from ensemble.cli.demo import _percentiles, _timed
    from ensemble.features import transforms
    from ensemble.operate.monitoring import LatencySummaries
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port

    frame = criteo.synthesize(criteo.SynthConfig(rows=max(rows), scale=0.01, seed=31)).frame
    dense, cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
    options = ServerOptions(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            latency_summaries=LatencySummaries(latency_summaries), cpu_list=server_cpus)
    results = []
    with TritonServer(options) as server:
        clients = {"http": RankerClient(server.http_url, "http"), "grpc": RankerClient(server.grpc_url, "grpc")}
        for block in range(blocks):
            for protocol, client in clients.items():
                for n in rows:
                    d, c = dense[:n], cats[:n]
                    client.infer(d, c)  # warm-up, as the demo does
                    point = _percentiles(_timed(lambda: client.infer(d, c), requests))
                    point.update(block=block + 1, protocol=protocol, rows=n)
                    results.append(point)
    return results


def table(results: list[dict]) -> str:
    lines = ["| request | protocol | p50 ms: median (blocks' range) | p99 ms: median (range) |",
             "| --- | --- | --- | --- |"]
    for n, protocol in dict.fromkeys((r["rows"], r["protocol"]) for r in results):
        mine = [r for r in results if (r["rows"], r["protocol"]) == (n, protocol)]
        p50, p99 = [r["p50_ms"] for r in mine], [r["p99_ms"] for r in mine]
        lines.append(f"| {n} row{'s' if n > 1 else ''} | {protocol} | {statistics.median(p50):.3f} "
                     f"({min(p50):.3f}-{max(p50):.3f}) | {statistics.median(p99):.2f} ({min(p99):.2f}-{max(p99):.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="model_repository", help="an exported model repository")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--requests", type=int, default=300, help="per block, size and protocol")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100])
    p.add_argument("--latency-summaries", action="store_true", help="the server with Triton's latency summaries on")
    p.add_argument("--server-cpus", default=None,
                   help="run the server under taskset -c on these CPUs (e.g. 1); the client stays unpinned")
    p.add_argument("--out", default="build/bench", help="folder of sequential-latency.json")
    args = p.parse_args(argv)
    machine = summary()
    results = run(Path(args.repository), args.blocks, args.requests, tuple(args.rows), args.latency_summaries,
                  args.server_cpus)
    print(table(results))
    write_results(args.out, "sequential-latency.json", "benchmarks.sequential", machine, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
