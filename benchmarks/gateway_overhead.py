"""What the fleet's Envoy gateway adds to a request: one client sends 1-row requests one at a time
to a tritonserver directly and through the gateway in front of it, in the same run.

Not a test: prints a table and writes ``<out>/gateway-overhead.json`` (machine, command, points).
The same replica answers every path, so the difference is the gateway's hop: Envoy's parsing, the
buffer and routing, and the extra loopback connection. Two gateways configured as a fleet's (routes
from files): one as between releases, one as during a release across the fleet, when every request
is pinned to one release (HTTP path rewrite, gRPC Lua filter). The paths alternate in blocks (the
order flipping every block) so the VM's drifts in speed hit all alike. The server and the gateway are
pinned to ``--server-cpus`` / ``--gateway-cpus`` and this process to ``--client-cpu``. The target:
the gateway adds at most 0.3 ms at the p50. Usage (after ``make demo``)::

    .venv/bin/python -m benchmarks.gateway_overhead --repository model_repository
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.base.machine import summary
from ensemble.models.registry import Layout
from ensemble.operate.server import DEFAULT_LAYOUT
from benchmarks import percentile

TARGET_ADDED_P50_MS = 0.3


def one_row_inputs(module, seed: int = 5, binary: bool = True) -> list:
    """One seeded row (values the demo model may or may not have seen: the cost is the same); an HTTP
    client's tensors in the JSON body when not ``binary``."""
    rng = np.random.default_rng(seed)
    json_body = {} if binary else {"binary_data": False}
    dense = module.InferInput(schema.DENSE.name, [1, schema.N_DENSE], "FP32")
    dense.set_data_from_numpy(rng.integers(0, 100, (1, schema.N_DENSE)).astype(np.float32), **json_body)
    categorical = module.InferInput(schema.CATEGORICAL.name, [1, schema.N_CATEGORICAL], "BYTES")
    categorical.set_data_from_numpy(np.array([[f"{v:08x}".encode() for v in rng.integers(0, 2**32, schema.N_CATEGORICAL)]],
                                             dtype=object), **json_body)
    return [dense, categorical]


def _measure(protocol: str, addresses: dict[str, str], requests: int, blocks: int, warmup: int) -> dict:
    """Latencies (ms) of sequential 1-row requests per path, in alternating blocks."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    inputs = one_row_inputs(module)
    outputs = [module.InferRequestedOutput(schema.SCORE.name)]
    clients = {path: module.InferenceServerClient(address) for path, address in addresses.items()}
    samples: dict[str, list[float]] = {path: [] for path in clients}
    for client in clients.values():
        for _ in range(warmup):
            client.infer(schema.Model.RANKER.value, inputs, outputs=outputs)
    per_block = max(1, requests // blocks)
    for block in range(blocks):
        order = list(clients) if block % 2 == 0 else list(reversed(clients))
        for path in order:
            client = clients[path]
            for _ in range(per_block):
                start = time.perf_counter()
                client.infer(schema.Model.RANKER.value, inputs, outputs=outputs)
                samples[path].append((time.perf_counter() - start) * 1e3)
    for client in clients.values():
        client.close()
    row: dict = {"protocol": protocol, "requests_per_path": per_block * blocks, "blocks": blocks}
    for path, values in samples.items():
        row[f"{path}_p50_ms"] = statistics.median(values)
        row[f"{path}_p99_ms"] = percentile(values, 0.99)
    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["within_target"] = row["added_p50_ms"] <= TARGET_ADDED_P50_MS
    if "pinned_p50_ms" in row:
        row["release_pin_p50_ms"] = row["pinned_p50_ms"] - row["gateway_p50_ms"]
    return row


def run(args) -> list[dict]:
    from ensemble.fleet.envoy import Envoy
    from ensemble.fleet.fleet import serving_release
    from ensemble.fleet.gateway import Gateway, Replica
    from ensemble.fleet.envoy_config import write_routes
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port

    if args.client_cpu is not None:
        os.sched_setaffinity(0, {args.client_cpu})
    server = TritonServer(ServerOptions(Path(args.repository), http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), layout=Layout(args.layout), cpu_list=args.server_cpus))
    server.start()
    envoys = []
    try:
        # as a fleet's gateway: routes read from files; "gateway" as between releases, "pinned" as
        # during a release across the fleet (requests pinned to one: HTTP path rewrite, gRPC Lua filter)
        routes = Path(tempfile.mkdtemp(prefix="gateway-routes-"))
        gateways = {name: Gateway((Replica(server.options.http_port, server.options.grpc_port),), http_port=free_port(),
                                  grpc_port=free_port(), admin_port=free_port(), release=release,
                                  routes_dir=str(routes / name))
                    for name, release in (("gateway", None), ("pinned", serving_release(server.options)))}
        for gateway in gateways.values():
            write_routes(gateway)
            envoys.append(Envoy(gateway, concurrency=args.gateway_threads, cpu_list=args.gateway_cpus).start())
        results = []
        for repeat, protocol in ((r, protocol) for r in range(args.runs) for protocol in args.protocols):
            grpc = protocol == "grpc"
            addresses = {"direct": server.grpc_url if grpc else server.http_url,
                         **{name: f"127.0.0.1:{g.grpc_port if grpc else g.http_port}" for name, g in gateways.items()}}
            row = {"layout": args.layout, "run": repeat + 1,
                   **_measure(protocol, addresses, args.requests, args.blocks, args.warmup)}
            results.append(row)
        return results
    finally:
        for envoy in envoys:
            envoy.stop()
        server.stop()


def _summary(results: list[dict]) -> dict[str, dict]:
    """Per protocol: the added p50 of every run, its median and how many runs met the target."""
    found = {}
    for protocol in dict.fromkeys(r["protocol"] for r in results):
        added = [r["added_p50_ms"] for r in results if r["protocol"] == protocol]
        found[protocol] = {"runs": len(added), "added_p50_ms": added, "median_added_p50_ms": statistics.median(added),
                           "runs_within_target": sum(a <= TARGET_ADDED_P50_MS for a in added)}
    return found


def _table(results: list[dict]) -> str:
    lines = [f"| run | protocol | direct p50 / p99 ms | through the gateway p50 / p99 ms | added p50 ms (target <= "
             f"{TARGET_ADDED_P50_MS}) | added p99 ms | p50 added by the pin during a release |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['run']} | {r['protocol']} | {r['direct_p50_ms']:.3f} / {r['direct_p99_ms']:.3f} | "
                     f"{r['gateway_p50_ms']:.3f} / {r['gateway_p99_ms']:.3f} | {r['added_p50_ms']:+.3f}"
                     f"{'' if r['within_target'] else ' (over)'} | {r['added_p99_ms']:+.3f} | "
                     f"{r.get('release_pin_p50_ms', float('nan')):+.3f} |")
    for protocol, row in _summary(results).items():
        lines.append(f"\n{protocol}: median added p50 {row['median_added_p50_ms']:+.3f} ms over {row['runs']} runs, "
                     f"{row['runs_within_target']} of them within {TARGET_ADDED_P50_MS} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", required=True, help="an exported model repository")
    p.add_argument("--layout", choices=[layout.value for layout in Layout if layout is not Layout.GPU],
                   default=DEFAULT_LAYOUT.value)
    p.add_argument("--protocols", nargs="+", choices=["http", "grpc"], default=["http", "grpc"])
    p.add_argument("--requests", type=int, default=4000, help="per path and protocol")
    p.add_argument("--blocks", type=int, default=20, help="alternating blocks the requests are split into")
    p.add_argument("--warmup", type=int, default=100, help="unmeasured requests per path first")
    p.add_argument("--runs", type=int, default=5, help="measurements per protocol (alternating protocols)")
    p.add_argument("--server-cpus", default="1", help="taskset CPU list of tritonserver ('' for none)")
    p.add_argument("--gateway-cpus", default="1", help="taskset CPU list of Envoy ('' for none)")
    p.add_argument("--gateway-threads", type=int, default=1, help="Envoy's worker threads (--concurrency)")
    p.add_argument("--client-cpu", type=int, default=0, help="CPU of this process (-1 for none)")
    p.add_argument("--out", default="docs/results", help="folder of gateway-overhead.json")
    args = p.parse_args(argv)
    if args.requests < args.blocks or args.blocks < 2:
        p.error("--blocks must be at least 2 and --requests at least --blocks")
    args.server_cpus = args.server_cpus or None
    args.gateway_cpus = args.gateway_cpus or None
    args.client_cpu = None if args.client_cpu < 0 else args.client_cpu
    machine = summary()  # before this process pins itself to one core
    results = run(args)
    print(_table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gateway-overhead.json"
    path.write_text(json.dumps({"machine": machine, "command": " ".join(["python -m benchmarks.gateway_overhead",
                                                                           *sys.argv[1:]]),
                                "target_added_p50_ms": TARGET_ADDED_P50_MS, "summary": _summary(results),
                                "results": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
