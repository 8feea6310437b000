"""Tables larger than memory, measured: a release whose DLRMs keep their rows on disk (the DLRM seed's
criteo-1tb shape: 204,184,588 rows per DLRM), served by the native layout from a hot tier in RAM.

Not a test: prints each part's table and writes ``<out>/tables-<part>.json``. Every file names the machine
(CPU model, family and flags) and the disk as fio measures it (4 KiB random reads, O_DIRECT, at queue depth 1
and 32: IOPS and p99), taken at the start on the file system holding the repository. Run nothing else
meanwhile. Parts (``--parts``):

- ``disk``: fio only.
- ``capacity``: the tables' bytes on disk, per DLRM and format (``du``).
- ``serve``: ``ensemble serve`` on the repository: seconds to ready, then to the hot tier warmed; the
  server's resident memory (its anonymous memory, ``RssAnon``: the row store reads with O_DIRECT, so the
  page cache holds none of its rows, and the file mappings are not counted); then, one client sending
  sequential requests, for each key source (``zipf``: every large table's ids drawn Zipf with
  ``--alpha`` over its rows, ranks placed by a fixed permutation, as NVIDIA's DynamicEmb benchmark draws
  them; ``counts``: ids drawn from training's own counts): a warm-up until the hit rate holds still, then
  1-row and 100-row requests: p50, p99, the hit rate on unique keys (the server's counters), cold rows and
  read time per request, and the cold reads' efficiency against fio's IOPS at the queue depth used.
- ``throughput``: 100-row requests from N concurrent clients: the most rows per second whose p99 stays
  under ``--p99-ms``.
- ``policies``: the admission policies (always, second) and the cold reads' I/O (uring, pread, mmap),
  each on its own server, Zipf keys: hit rate and latency (how the defaults were chosen).

Values reach the server as strings: a large table's id is ``crc32(value) % rows``, so each drawn id is
sent as a string whose CRC-32 is that id (:func:`forge`). ::

    .venv/bin/python -m benchmarks.tables --repository /work/big/repo --parts disk capacity serve
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from benchmarks import percentile, write_results
from ensemble.machine import summary

# CRC-32 (zlib's, reflected) table and the index of each entry's top byte: forging a value of a given CRC.
_CRC = [0] * 256
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0xEDB88320 if _c & 1 else _c >> 1
    _CRC[_i] = _c
_BY_TOP = {v >> 24: i for i, v in enumerate(_CRC)}


def forge(prefix: bytes, target: int) -> bytes:
    """``prefix`` and four bytes after it, whose zlib.crc32 is ``target``: the bytes run the CRC's register from
    the prefix's state to the one that ends in ``target`` (each step's table entry is known from the state's top
    byte, so the four entries are found backwards and the bytes forwards)."""
    state = target ^ 0xFFFFFFFF
    entries = []
    for _ in range(4):
        index = _BY_TOP[state >> 24]
        entries.append(index)
        state = ((state ^ _CRC[index]) << 8) & 0xFFFFFFFF
    crc = zlib.crc32(prefix) ^ 0xFFFFFFFF
    tail = bytearray()
    for index in reversed(entries):
        tail.append((crc ^ index) & 0xFF)
        crc = _CRC[index] ^ (crc >> 8)
    forged = prefix + bytes(tail)
    assert zlib.crc32(forged) == target
    return forged


def fio(path: Path, depth: int, seconds: int = 10, size: str = "4G") -> dict:
    """4 KiB random reads with O_DIRECT at a queue depth: IOPS, mean and p99 (microseconds)."""
    target = Path(path) / ".fio-probe"
    done = subprocess.run(["fio", "--name=probe", f"--filename={target}", f"--size={size}", "--rw=randread", "--bs=4k",
                           "--direct=1", "--ioengine=io_uring", f"--iodepth={depth}", f"--runtime={seconds}",
                           "--time_based", "--output-format=json"], capture_output=True, text=True, check=True)
    target.unlink(missing_ok=True)
    job = json.loads(done.stdout)["jobs"][0]["read"]
    return {"depth": depth, "iops": round(job["iops"]), "mean_us": round(job["clat_ns"]["mean"] / 1e3, 1),
            "p99_us": round(job["clat_ns"]["percentile"]["99.000000"] / 1e3, 1)}


def disk(repository: Path) -> dict:
    return {"fio_qd1": fio(repository, 1), "fio_qd32": fio(repository, 32), "file_system": _df(repository)}


def _df(path: Path) -> str:
    return subprocess.run(["df", "-h", str(path)], capture_output=True, text=True).stdout.splitlines()[-1]


def capacity(repository: Path, release: int | None) -> dict:
    from ensemble.scoring.pipeline import release_versions
    from ensemble.tables.files import TablesManifest, has_tables

    found = {}
    for model, folder in release_versions(repository, release).items():
        if not has_tables(folder):
            continue
        manifest = TablesManifest.load(folder)
        du = subprocess.run(["du", "-sb", str(folder / "tables")], capture_output=True, text=True).stdout.split()[0]
        found[model.value] = {"rows": sum(t.rows for t in manifest.tables), "format": manifest.format,
                              "tables_bytes": manifest.disk_bytes(), "du_bytes": int(du),
                              "held_out_auc": manifest.accuracy.get("held_out_auc")}
    found["total_bytes"] = sum(v["du_bytes"] for v in found.values())
    return found


# ----- the server's counters -----

def metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        match = re.match(r"^(ensemble_table_\w+)\{(.*)\} (\S+)$", line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2))))
            found[(match.group(1), labels)] = float(match.group(3))
    return found


def totals(snapshot: dict, name: str, big_only: set[str] | None = None) -> float:
    return sum(v for (n, labels), v in snapshot.items() if n == name and
               (big_only is None or dict(labels).get("table") in big_only))


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


# ----- keys -----

class Keys:
    """Request rows whose large tables' ids follow a distribution: dense values and categorical strings."""

    def __init__(self, repository: Path, release: int | None, source: str, alpha: float, seed: int = 0):
        from ensemble.scoring.pipeline import release_versions
        from ensemble.tables.files import COUNTS, TABLES_DIR, TablesManifest

        folders = release_versions(repository, release)
        step = next(f for m, f in folders.items() if m.value == "dlrm_torch")
        self.manifest = TablesManifest.load(step)
        self.rng = np.random.default_rng(seed)
        self.source, self.alpha = source, alpha
        self.rows = [t.rows for t in self.manifest.tables]
        self.permutations = {}
        if source == "counts":
            with np.load(step / TABLES_DIR / COUNTS) as data:
                self.counts = {t.name: (data[f"{t.name}.ids"], data[f"{t.name}.counts"]) for t in self.manifest.tables}
        self.zipf_cdf = {}

    def _zipf(self, rows: int, n: int) -> np.ndarray:
        """Ranks 0.. with P(r) ~ (r + 1)^-alpha over ``rows`` ranks (by inverting the continuous CDF)."""
        a = self.alpha
        u = self.rng.random(n)
        top = (rows + 1) ** (1 - a)
        ranks = np.floor((1 + u * (top - 1)) ** (1 / (1 - a))) - 1
        return np.clip(ranks, 0, rows - 1).astype(np.int64)

    def ids(self, n: int) -> np.ndarray:
        """[n x tables] ids."""
        out = np.empty((n, len(self.rows)), np.int64)
        for c, (rows, table) in enumerate(zip(self.rows, self.manifest.tables)):
            if self.source == "counts" and len(self.counts[table.name][0]):
                ids, counts = self.counts[table.name]
                out[:, c] = ids[np.searchsorted(np.cumsum(counts), self.rng.random(n) * counts.sum(), side="right")]
            else:  # a rank's id: a fixed bijection on the table's rows (an affine map modulo rows)
                ranks = self._zipf(rows, n)
                stride = 2654435761 % rows or 1
                while np.gcd(stride, rows) != 1:
                    stride += 1
                out[:, c] = (ranks * stride + 12345) % rows
        return out

    def request(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.ids(n)
        dense = self.rng.lognormal(1.5, 1.2, (n, 13)).astype(np.float32)
        cats = np.empty(ids.shape, dtype=object)
        for (r, c), value in np.ndenumerate(ids):
            cats[r, c] = forge(b"k", int(value))  # crc32 == id, so crc32 % rows == id
        return dense, cats


# ----- serving -----

def start_server(repository: Path, out: Path, cache_gib: float, extra: list[str], cpus: str | None):
    from ensemble.operate.server import free_port

    ports = [free_port() for _ in range(3)]
    log = out / "tables-server.log"
    command = [sys.executable, "-m", "ensemble", "serve", "--repository", str(repository), "--http-port", str(ports[0]),
               "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--log-file", str(log),
               "--embedding-cache-gib", f"{cache_gib:g}", *extra]
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if line.startswith("ready:"):
            break
    else:
        raise RuntimeError(f"the server did not start; see {log}")
    ready = time.monotonic() - started
    return process, ports, ready


def tritonserver_pid(parent: int) -> int:
    from ensemble.operate import processes

    return next(p for p in processes.tree(parent) if "tritonserver" in Path(f"/proc/{p}/cmdline").read_text())


def wait_warm(metrics_url: str, settle: float = 5.0, limit: float = 600.0) -> tuple[float, float]:
    """Seconds until the hot tier's bytes stop growing (within ``settle`` seconds), and those bytes."""
    start = time.monotonic()
    last, last_change = -1.0, time.monotonic()
    while time.monotonic() - start < limit:
        now = totals(metrics(metrics_url), "ensemble_table_hot_bytes")
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change >= settle:
            return last_change - start, now
        time.sleep(0.5)
    return limit, last


def sequential(client, keys: Keys, rows: int, requests: int, metrics_url: str, big: set[str]) -> dict:
    before = metrics(metrics_url)
    times = []
    for _ in range(requests):
        dense, cats = keys.request(rows)
        start = time.perf_counter()
        client.infer(dense, cats)
        times.append(time.perf_counter() - start)
    after = metrics(metrics_url)
    delta = lambda name, only=None: totals(after, name, only) - totals(before, name, only)  # noqa: E731
    unique, hits = delta("ensemble_table_unique_keys_total"), delta("ensemble_table_hot_hits_total")
    unique_big, hits_big = delta("ensemble_table_unique_keys_total", big), delta("ensemble_table_hot_hits_total", big)
    cold = delta("ensemble_table_cold_rows_total")
    read_seconds = delta("ensemble_table_read_seconds_sum")
    return {"rows": rows, "requests": requests, "p50_ms": percentile(times, 0.5) * 1e3,
            "p99_ms": percentile(times, 0.99) * 1e3, "hit_rate": hits / unique if unique else None,
            "hit_rate_large_tables": hits_big / unique_big if unique_big else None,
            "cold_rows_per_request": cold / requests,
            "cold_blocks_per_request": delta("ensemble_table_cold_blocks_total") / requests,
            "read_ms_per_request": read_seconds * 1e3 / requests}


def serve(repository: Path, out: Path, args, fio_result: dict | None) -> dict:
    from ensemble.grpc_polling import import_grpc

    import_grpc()
    from clients.triton import RankerClient

    process, ports, ready = start_server(repository, out, args.cache_gib, args.server_args, args.server_cpus)
    metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
    try:
        warm_seconds, warm_bytes = wait_warm(metrics_url)
        pid = tritonserver_pid(process.pid)
        result = {"ready_seconds": ready, "warm_seconds": warm_seconds, "warmed_hot_bytes": warm_bytes,
                  "rss_anon_after_warm": rss_anon(pid), "cache_gib": args.cache_gib, "server_args": args.server_args}
        client = RankerClient(f"127.0.0.1:{ports[1]}", "grpc")
        keys_zipf = Keys(repository, args.release, "zipf", args.alpha)
        big = {t.name for t in keys_zipf.manifest.tables if not t.small}
        for source in args.sources:
            keys = keys_zipf if source == "zipf" else Keys(repository, args.release, source, args.alpha, seed=1)
            # warm-up: 100-row requests until the hit rate of a block moves by less than half a point
            previous, used = None, 0
            for used in range(1, args.max_warm_blocks + 1):  # noqa: B007 - the count is reported
                block = sequential(client, keys, 100, args.warm_requests, metrics_url, big)
                if previous is not None and abs(block["hit_rate"] - previous) < 0.005:
                    break
                previous = block["hit_rate"]
            result[source] = {"warm_blocks": used, "warm_requests_each": args.warm_requests,
                              "hot_bytes": totals(metrics(metrics_url), "ensemble_table_hot_bytes"),
                              **{f"rows{n}": sequential(client, keys, n, args.requests, metrics_url, big) for n in (1, 100)}}
            if fio_result:
                point = result[source]["rows100"]
                # the disk's time for this many reads at the queue depth used, from fio's IOPS
                fio_ms = point["cold_blocks_per_request"] / fio_result["fio_qd32"]["iops"] * 1e3
                point["fio_ms_for_these_reads_qd32"] = fio_ms
                point["read_time_over_fio"] = point["read_ms_per_request"] / fio_ms if fio_ms else None
        result["rss_anon_end"] = rss_anon(pid)
        return result
    finally:
        process.terminate()
        process.wait(60)


def throughput(repository: Path, out: Path, args) -> dict:
    """Closed loops of 100-row requests from 1..N client threads: rows/s and p99 at each."""
    import threading

    from ensemble.grpc_polling import import_grpc

    import_grpc()
    from clients.triton import RankerClient

    process, ports, _ = start_server(repository, out, args.cache_gib, args.server_args, args.server_cpus)
    try:
        wait_warm(f"http://127.0.0.1:{ports[2]}/metrics")
        points = []
        for clients in args.clients:
            keys = [Keys(repository, args.release, "zipf", args.alpha, seed=100 + k) for k in range(clients)]
            prepared = [[k.request(100) for _ in range(40)] for k in keys]
            times: list[float] = []
            stop = time.monotonic() + args.seconds

            def loop(k: int) -> None:
                client = RankerClient(f"127.0.0.1:{ports[1]}", "grpc")
                i = 0
                while time.monotonic() < stop:
                    dense, cats = prepared[k][i % len(prepared[k])]
                    start = time.perf_counter()
                    client.infer(dense, cats)
                    times.append(time.perf_counter() - start)
                    i += 1

            threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            points.append({"clients": clients, "rows_per_s": len(times) * 100 / args.seconds,
                           "p50_ms": percentile(times, 0.5) * 1e3, "p99_ms": percentile(times, 0.99) * 1e3})
            print(points[-1], flush=True)
        best = max((p for p in points if p["p99_ms"] <= args.p99_ms), key=lambda p: p["rows_per_s"], default=None)
        return {"points": points, "p99_bound_ms": args.p99_ms, "best": best}
    finally:
        process.terminate()
        process.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", required=True)
    p.add_argument("--release", type=int, default=None)
    p.add_argument("--parts", nargs="+", default=["disk", "capacity", "serve"],
                   choices=["disk", "capacity", "serve", "throughput", "policies"])
    p.add_argument("--cache-gib", type=float, default=6.0)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--sources", nargs="+", default=["zipf", "counts"], choices=["zipf", "counts"])
    p.add_argument("--requests", type=int, default=1000, help="measured requests per size and key source")
    p.add_argument("--warm-requests", type=int, default=500, help="requests per warm-up block")
    p.add_argument("--max-warm-blocks", type=int, default=40)
    p.add_argument("--clients", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--p99-ms", type=float, default=50.0)
    p.add_argument("--server-cpus", default=None)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--out", default="build/bench")
    args = p.parse_args(argv)
    repository, out = Path(args.repository), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = summary()
    found: dict = {}
    fio_result = None
    if "disk" in args.parts:
        fio_result = found["disk"] = disk(repository)
        print(json.dumps(fio_result, indent=1))
    if "capacity" in args.parts:
        found["capacity"] = capacity(repository, args.release)
        print(json.dumps(found["capacity"], indent=1))
    if "serve" in args.parts:
        found["serve"] = serve(repository, out, args, fio_result)
        print(json.dumps(found["serve"], indent=1, default=str))
    if "throughput" in args.parts:
        found["throughput"] = throughput(repository, out, args)
    for part, value in found.items():
        write_results(out, f"tables-{part}.json", "benchmarks.tables", machine, disk=fio_result, **{part: value})
    return 0


if __name__ == "__main__":
    sys.exit(main())
