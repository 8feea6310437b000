"""Batch-scoring throughput: in-process (`--local`) vs through Triton (fused and native layouts) over HTTP and gRPC.

Not a test: prints a table and writes ``<out>/scoring.json`` and ``<out>/scoring.md``. Every
configuration scores the same synthetic file; each is run ``--repeats`` times and the median
rows/s is reported, with its ratio to the fastest ``--local`` run at the same batch size (same
run, same machine). ``--local`` is measured at every ``--concurrency`` the server is, since chunks
in flight speed it up too (``ensemble score --local`` keeps 4 in flight by default). Usage::

    .venv/bin/python -m benchmarks.batch_scoring --repository model_repository

``--protocols http-shm grpc-shm`` also measures the same requests with their tensors in system
shared memory (Triton's extension for a client on the server's host): what the server path costs
when no tensor travels through a socket. ``ensemble score`` does not offer it (a client
on the server's host is faster with ``--local``); it is here to measure the transport's share.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

from clients.batch.score import ScoreSettings, local_pipeline
from clients.batch import score_files
from clients.triton import RankerClient
from clients.wire import WireStrings, serialize_bytes
from ensemble import schema
from ensemble.data import criteo
from ensemble.base.machine import summary
from ensemble.models.registry import Layout
from ensemble.operate import processes
from ensemble.operate.control import admin_headers

PROTOCOLS = ("http", "grpc", "http-shm", "grpc-shm")
SHARED = "-shm"


class SharedMemoryScorer:
    """A partition's requests with their tensors in system shared memory: each scoring thread
    writes a chunk's two inputs into its input region and reads the four scores from its output
    region; the request itself carries names, shapes and offsets. The regions are this process's
    POSIX shared memory, registered with the server under their own names (so the server must run
    on this host); a region too small for a chunk is replaced by a larger one. :meth:`close`
    unregisters and deletes them all. Registering is an admin call: on a keyed server the key comes
    from ``ENSEMBLE_ADMIN_KEY``."""

    def __init__(self, url: str, protocol: str, timeout: float):
        self._url, self._protocol, self._timeout = url, protocol, timeout
        self._threads = threading.local()  # a client and two regions per scoring thread
        self._lock = threading.Lock()
        self._regions: dict[str, SharedMemory] = {}  # registered, by the name the server knows
        self._admin = admin_headers(grpc=protocol.startswith("grpc"))

    def _client(self) -> RankerClient:
        """A client with batch scoring's settings: its tritonclient client (``_client``) and module
        (``_tc``) send the requests, with the timeout, priority and bulk flag of its ``_infer_kwargs``."""
        return RankerClient(self._url, self._protocol, timeout=self._timeout, priority=schema.Priority.BATCH)

    def __call__(self, dense: np.ndarray, categorical) -> dict[str, np.ndarray]:
        state = self._threads
        if getattr(state, "client", None) is None:  # tritonclient's HTTP client is not shared across threads
            state.client = self._client()
        tc = state.client._tc
        dense = np.ascontiguousarray(dense, np.float32)
        rows = len(dense)
        wire = categorical.data if isinstance(categorical, WireStrings) else serialize_bytes(categorical)
        inputs, region = self._region(state, "inputs", dense.nbytes + len(wire))
        region.buf[:dense.nbytes] = dense.reshape(-1).view(np.uint8)
        region.buf[dense.nbytes:dense.nbytes + len(wire)] = wire
        dense_in = tc.InferInput(schema.DENSE.name, list(dense.shape), schema.DENSE.dtype.wire)
        dense_in.set_shared_memory(inputs, dense.nbytes, 0)
        cats_in = tc.InferInput(schema.CATEGORICAL.name, [rows, categorical.shape[1]],
                                      schema.CATEGORICAL.dtype.wire)
        cats_in.set_shared_memory(inputs, len(wire), dense.nbytes)
        width = rows * np.dtype(np.float32).itemsize  # every ranker output: one float32 a row
        outputs, answers = self._region(state, "outputs", width * len(schema.RANKER_OUTPUTS))
        requested = []
        for k, tensor in enumerate(schema.RANKER_OUTPUTS):
            output = tc.InferRequestedOutput(tensor.name)
            output.set_shared_memory(outputs, width, k * width)
            requested.append(output)
        state.client._client.infer(state.client.model, [dense_in, cats_in], outputs=requested,
                                   **state.client._infer_kwargs())
        scores = np.frombuffer(answers.buf, np.float32, rows * len(schema.RANKER_OUTPUTS)).copy()
        return {t.name: scores[k * rows:(k + 1) * rows] for k, t in enumerate(schema.RANKER_OUTPUTS)}

    def _region(self, state, kind: str, size: int) -> tuple[str, SharedMemory]:
        current = getattr(state, kind, None)
        if current is not None and current[1].size >= size:
            return current
        region = SharedMemory(create=True, size=max(size, 1 << 20))
        name = f"ensemble-bench-{region.name}"
        with self._lock:
            self._regions[name] = region
        state.client._client.register_system_shared_memory(name, "/" + region.name, region.size, headers=self._admin)
        if current is not None:
            state.client._client.unregister_system_shared_memory(current[0], headers=self._admin)
            self._delete(current[0])
        setattr(state, kind, (name, region))
        return name, region

    def _delete(self, name: str) -> None:
        with self._lock:
            region = self._regions.pop(name)
        region.close()
        region.unlink()

    def close(self) -> None:
        if not self._regions:
            return
        client = self._client()  # this thread's: the scoring threads have ended
        try:
            for name in list(self._regions):
                client._client.unregister_system_shared_memory(name, headers=self._admin)
                self._delete(name)
        finally:
            client.close()


@dataclass(frozen=True)
class SharedMemorySettings(ScoreSettings):
    """:class:`ScoreSettings` whose partitions are scored by :class:`SharedMemoryScorer`."""

    scorers: list = field(default_factory=list, compare=False)

    def scorer(self, partition_index: int = 0):
        scorer = SharedMemoryScorer(self.urls[partition_index % len(self.urls)], self.protocol, self.timeout)
        self.scorers.append(scorer)
        return scorer

    def close(self) -> None:
        while self.scorers:
            self.scorers.pop().close()


def _cpu_seconds(server_pid: int | None) -> tuple[float, float]:
    """CPU seconds so far of this process (every thread: the scoring, ``--local``'s models included)
    and of the server's process group (tritonserver and any backend stub; 0 without a server)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    server = sum(processes.cpu_seconds(pid) for pid in processes.group(server_pid)) if server_pid else 0.0
    return own.ru_utime + own.ru_stime, server


def _measure(path: Path, out: Path, settings: ScoreSettings, repeats: int, server_pid: int | None = None) -> dict:
    """Median rows/s of ``repeats`` runs, and the median CPU a row (us) of this process and of the
    server (None when the benchmark did not start it)."""
    rates, client, server = [], [], []
    for _ in range(repeats):
        before = _cpu_seconds(server_pid)
        summary = score_files([str(path)], str(out), settings, progress=False)
        after = _cpu_seconds(server_pid)
        rates.append(summary.rows_per_second)
        client.append((after[0] - before[0]) / summary.rows * 1e6)
        server.append((after[1] - before[1]) / summary.rows * 1e6)
    return {"rows_per_s": statistics.median(rates), "client_us_per_row": statistics.median(client),
            "server_us_per_row": statistics.median(server) if server_pid else None}


def run(args) -> list[dict]:
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port

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
                            **_measure(source, scratch, settings, args.repeats)})
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
            for protocol in args.protocols:
                base = protocol.removesuffix(SHARED)
                kind = SharedMemorySettings if protocol.endswith(SHARED) else ScoreSettings
                for batch in args.batch_sizes:
                    for concurrency in args.concurrency:
                        settings = kind(urls=(urls[base],), protocol=base, batch_size=batch, concurrency=concurrency)
                        try:
                            measured = _measure(source, scratch, settings, args.repeats,
                                                server.process.pid if server is not None else None)
                        finally:
                            if isinstance(settings, SharedMemorySettings):
                                settings.close()
                        target = f"{layout} {protocol}"
                        results.append({"target": target, "batch_size": batch, "concurrency": concurrency,
                                        **measured})
                        print(f"{target:<12} batch {batch:>5} conc {concurrency}: {measured['rows_per_s']:>9,.0f} "
                              "rows/s", flush=True)
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
    lines = ["| target | batch size | requests in flight | rows/s (median) | vs the fastest `--local` "
             "| CPU a row: scoring process + server |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        server = r.get("server_us_per_row")
        cpu = f"{r['client_us_per_row']:.2f}" + (f" + {server:.2f}" if server is not None else "") + " us"
        lines.append(f"| {r['target']} | {r['batch_size']} | {r['concurrency']} | {r['rows_per_s']:,.0f} "
                     f"| {r['vs_local']:.0%} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=["http", "grpc"],
                        help="how requests reach the server; -shm: their tensors in system shared memory "
                             "(the server must run on this host)")
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
