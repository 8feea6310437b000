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
  them; ``counts``: ids drawn from training's own counts): a warm-up of larger requests until the hit rate
  holds still (each block's hit rate is kept: the curve), then
  1-row and 100-row requests: p50, p99, the hit rate on unique keys (the server's counters), cold rows and
  read time per request, and the cold reads' efficiency against fio's IOPS at the queue depth used.
- ``throughput`` (with ``serve``, on its warmed server): 100-row requests from N concurrent clients: the
  most rows per second whose p99 stays under ``--p99-ms``. A release without a row store (the seed's size
  with vocabulary tables) runs the same parts on the synthetic data's rows, for comparison.
- ``policies``: the admission policies (always, second) and the cold reads' I/O (uring, pread, mmap),
  each on its own server, Zipf keys: hit rate and latency (how the defaults were chosen).
- ``reads`` (with ``disk``): the cold read path alone, in this process: one DLRM's store with a 1 MiB
  tier (admission ``none``), calls of ``--read-rows`` Zipf rows at each queue depth of ``--read-depths``
  (io_uring): microseconds a cold block, against fio's at the same depth (how the depth was chosen).
  It runs before fio: on the build VM the disk reads slower for minutes after fio's bursts.
- ``warm``: both DLRMs' stores opened as the server opens them, each warmed on its own thread from a warm
  file of ``--warm-fill`` times its tier's slots of the Zipf keys' likeliest rows (written once into
  ``--warm-scratch``, read from the disk): seconds until the tiers stop filling, and how full they are.

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
from pathlib import Path


from benchmarks import percentile, write_results
from ensemble.base.machine import summary
from benchmarks.tables_keys import Keys, SyntheticKeys, forge  # noqa: F401 - forge: the tests' keys too
from benchmarks.tables_store import policies, reads, warm


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
    """fio at queue depth 1, 32 and the cold reads' own depth (each thread's: ``ENSEMBLE_TABLE_DEPTH``)."""
    from ensemble.tables.serving import Settings

    depth = Settings.from_environment().depth
    found = {f"fio_qd{d}": fio(repository, d) for d in sorted({1, 32, depth})}
    return {**found, "serving_depth": depth, "file_system": _df(repository)}


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


# ----- serving -----

def start_server(repository: Path, out: Path, cache_gib: float, extra: list[str], cpus: str | None):
    from ensemble.base.machine import free_port

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


def sequential(client, keys, rows: int, requests: int, metrics_url: str, big: set[str]) -> dict:
    before = metrics(metrics_url)
    times = []
    for _ in range(requests):
        dense, cats = keys.request(rows)
        start = time.perf_counter()
        client.infer(dense, cats)
        times.append(time.perf_counter() - start)
    after = metrics(metrics_url)
    return {"rows": rows, "requests": requests, "p50_ms": percentile(times, 0.5) * 1e3,
            "p99_ms": percentile(times, 0.99) * 1e3, **counted(before, after, requests, big)}


def counted(before: dict, after: dict, requests: int, big: set[str]) -> dict:
    """The row store's counters between two scrapes, per request: hit rates on unique keys, cold rows, blocks
    and read time (empty for a release without a row store)."""
    delta = lambda name, only=None: totals(after, name, only) - totals(before, name, only)  # noqa: E731
    unique, hits = delta("ensemble_table_unique_keys_total"), delta("ensemble_table_hot_hits_total")
    if not unique:
        return {}
    unique_big, hits_big = delta("ensemble_table_unique_keys_total", big), delta("ensemble_table_hot_hits_total", big)
    return {"hit_rate": hits / unique, "hit_rate_large_tables": hits_big / unique_big if unique_big else None,
            "unique_keys_per_request": unique / requests,
            "cold_rows_per_request": delta("ensemble_table_cold_rows_total") / requests,
            "cold_blocks_per_request": delta("ensemble_table_cold_blocks_total") / requests,
            "read_ms_per_request": delta("ensemble_table_read_seconds_sum") * 1e3 / requests,
            "reading_ms_per_request": delta("ensemble_table_reading_seconds_total") * 1e3 / requests,
            "read_failures": delta("ensemble_table_read_failures_total")}


def closed_loops(address: str, make_keys, rows: int, requests: int, clients: int,
                 refused: list | None = None) -> tuple[list[float], float]:
    """``clients`` threads, each sending ``requests`` requests of ``rows`` rows back to back over gRPC (rows
    drawn beforehand, so the clients' Python stays off the measured path as far as it can): each answered
    request's seconds, and the wall time. A request the server refuses as it asks (UNAVAILABLE: its
    admission predicts a missed objective, or cold reads past the deadline) is sent again after 50 ms, as a
    client retrying with backoff does; each refusal is appended to ``refused``."""
    import threading

    from clients.triton import RankerClient
    from tritonclient.utils import InferenceServerException

    prepared = [[keys.request(rows) for _ in range(requests)] for keys in (make_keys(k) for k in range(clients))]
    times: list[float] = []
    refused = refused if refused is not None else []

    def loop(k: int) -> None:
        client = RankerClient(address, "grpc")
        for dense, cats in prepared[k]:
            while True:
                start = time.perf_counter()
                try:
                    client.infer(dense, cats)
                except InferenceServerException as exc:
                    if "UNAVAILABLE" not in str(exc.status()) and "UNAVAILABLE" not in str(exc):
                        raise
                    refused.append(str(exc)[:200])
                    time.sleep(0.05)
                    continue
                times.append(time.perf_counter() - start)
                break

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times, time.perf_counter() - started


def warm_up(address: str, keys_of, args, metrics_url: str, big: set[str]) -> list[dict]:
    """Blocks of ``--warm-rows``-row requests from two clients (the same key stream the measured requests draw
    from, in larger requests so that the hot tier sees as many keys in far fewer calls) until a block's hit rate
    moves by less than ``--warm-settle`` or ``--max-warm-blocks`` ran: each block's hit rate and time."""
    curve, previous, sent = [], None, 0
    for block in range(args.max_warm_blocks):
        before = metrics(metrics_url)
        refused: list[str] = []
        times, wall = closed_loops(address, lambda k: keys_of(1000 + block * 2 + k), args.warm_rows,
                                   args.warm_requests, 2, refused)
        sent += len(times) * args.warm_rows
        point = {"block": block + 1, "rows_sent": sent, "seconds": wall, "refused": len(refused),
                 "hot_bytes": totals(metrics(metrics_url), "ensemble_table_hot_bytes"),
                 **counted(before, metrics(metrics_url), len(times), big)}
        curve.append(point)
        print(f"warm-up block {block + 1}: {sent:,} rows sent, hit rate {point.get('hit_rate', 0):.4f} "
              f"(large tables {point.get('hit_rate_large_tables') or 0:.4f}), {wall:.1f} s", flush=True)
        if previous is not None and abs(point["hit_rate"] - previous) < args.warm_settle:
            break
        previous = point["hit_rate"]
    return curve


def serve(repository: Path, out: Path, args, fio_result: dict | None) -> dict:
    """One server: ready and warm times, memory, then per key source the warm-up, sequential 1-row and 100-row
    requests, and (part ``throughput``) closed loops of 100-row requests on the same warmed server."""
    from ensemble.base.grpc_polling import import_grpc

    import_grpc()
    from clients.triton import RankerClient
    from ensemble.scoring.pipeline import release_versions
    from ensemble.tables.files import has_tables

    row_store = any(has_tables(f) for f in release_versions(repository, args.release).values())
    process, ports, ready = start_server(repository, out, args.cache_gib, args.server_args, args.server_cpus)
    metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
    address = f"127.0.0.1:{ports[1]}"
    try:
        warm_seconds, warm_bytes = wait_warm(metrics_url) if row_store else (0.0, 0.0)
        pid = tritonserver_pid(process.pid)
        result = {"row_store": row_store, "ready_seconds": ready, "warm_file_seconds": warm_seconds,
                  "warm_file_hot_bytes": warm_bytes, "rss_anon_after_load": rss_anon(pid),
                  "cache_gib": args.cache_gib, "server_args": args.server_args}
        client = RankerClient(address, "grpc")
        big = set()
        if row_store:
            big = {t.name for t in Keys(repository, args.release, "zipf", args.alpha).manifest.tables if not t.small}
        for source in (args.sources if row_store else ["synthetic"]):
            def keys_of(seed: int, source=source):
                if source == "synthetic":
                    return SyntheticKeys(seed)
                return Keys(repository, args.release, source, args.alpha, seed=seed)

            keys = keys_of(0)
            found = result[source] = {}
            if row_store:
                found["warm_up"] = warm_up(address, keys_of, args, metrics_url, big)
            for n in (1, 100):
                sequential(client, keys, n, 20, metrics_url, big)  # the connection and the path warmed
                found[f"rows{n}"] = point = sequential(client, keys, n, args.requests, metrics_url, big)
                print(f"{source} {n}-row: p50 {point['p50_ms']:.2f} ms, p99 {point['p99_ms']:.2f} ms, "
                      f"hit rate {'-' if point.get('hit_rate') is None else format(point['hit_rate'], '.4f')}", flush=True)
            point = found["rows100"]
            if fio_result and point.get("cold_blocks_per_request"):
                # the disk's own time for this many 4 KiB reads at the queue depth used, from fio's IOPS, beside the
                # request's cold-read wall time (the seconds during which any of its read calls was reading: the
                # chain's two threads each read for both DLRMs, at once)
                depth = fio_result["serving_depth"]
                fio_ms = point["cold_blocks_per_request"] / fio_result[f"fio_qd{depth}"]["iops"] * 1e3
                point["fio_ms_for_these_reads"] = fio_ms
                point["read_time_over_fio"] = point["reading_ms_per_request"] / fio_ms
            if "throughput" in args.parts and source in ("zipf", "synthetic"):
                points = []
                for clients in args.clients:
                    before = metrics(metrics_url)
                    refused = []
                    times, wall = closed_loops(address, lambda k: keys_of(100 + k), 100,
                                               max(20, int(args.seconds * 40 / clients)), clients, refused)
                    points.append({"clients": clients, "rows_per_s": len(times) * 100 / wall, "refused": len(refused),
                                   "p50_ms": percentile(times, 0.5) * 1e3, "p99_ms": percentile(times, 0.99) * 1e3,
                                   **counted(before, metrics(metrics_url), len(times), big)})
                    print(f"{source} {clients} clients x 100 rows: {points[-1]['rows_per_s']:,.0f} rows/s, "
                          f"p99 {points[-1]['p99_ms']:.1f} ms", flush=True)
                inside = [p for p in points if p["p99_ms"] <= args.p99_ms]
                found["throughput"] = {"points": points, "p99_bound_ms": args.p99_ms,
                                       "best": max(inside, key=lambda p: p["rows_per_s"], default=None)}
        result["rss_anon_end"] = rss_anon(pid)
        result["hot_bytes_end"] = totals(metrics(metrics_url), "ensemble_table_hot_bytes")
        return result
    finally:
        process.terminate()
        process.wait(60)


def print_serve(result: dict) -> None:
    """The serve part as a table."""
    print(f"\nready {result['ready_seconds']:.1f} s; warm file {result['warm_file_seconds']:.1f} s "
          f"({result['warm_file_hot_bytes'] / 2**20:,.0f} MiB); RssAnon after load "
          f"{result['rss_anon_after_load'] / 2**30:.2f} GiB, at the end {result['rss_anon_end'] / 2**30:.2f} GiB; "
          f"hot tier at the end {result['hot_bytes_end'] / 2**30:.2f} GiB")
    print("| keys | rows | p50 ms | p99 ms | hit rate (large tables) | cold rows / request | read ms / request |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for source in ("zipf", "counts", "synthetic"):
        for n in (1, 100):
            point = result.get(source, {}).get(f"rows{n}")
            if point:
                hit = (f"{point['hit_rate']:.4f} ({point['hit_rate_large_tables'] or 0:.4f})"
                       if "hit_rate" in point else "-")
                print(f"| {source} | {n} | {point['p50_ms']:.2f} | {point['p99_ms']:.2f} | {hit} | "
                      f"{point.get('cold_rows_per_request', 0):.1f} | {point.get('read_ms_per_request', 0):.2f} |")
        point = result.get(source, {}).get("rows100") or {}
        if point.get("fio_ms_for_these_reads"):
            print(f"| {source} | 100: cold reads | {point['cold_blocks_per_request']:.0f} blocks | "
                  f"{point['reading_ms_per_request']:.2f} ms (wall; calls summed {point['read_ms_per_request']:.2f}) | "
                  f"fio {point['fio_ms_for_these_reads']:.2f} ms "
                  f"| x{point['read_time_over_fio']:.2f} | |")
        loops = result.get(source, {}).get("throughput")
        if loops:
            for point in loops["points"]:
                hit = "-" if point.get("hit_rate") is None else f"{point['hit_rate']:.4f}"
                print(f"| {source} | 100 x {point['clients']} clients | {point['p50_ms']:.2f} | {point['p99_ms']:.2f} "
                      f"| {hit} | {point['rows_per_s']:,.0f} rows/s | |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", required=True)
    p.add_argument("--release", type=int, default=None)
    p.add_argument("--parts", nargs="+", default=["disk", "capacity", "serve"],
                   choices=["disk", "capacity", "serve", "throughput", "policies", "reads", "warm"])
    p.add_argument("--cache-gib", type=float, default=6.0)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--sources", nargs="+", default=["zipf", "counts"], choices=["zipf", "counts"])
    p.add_argument("--requests", type=int, default=1000, help="measured requests per size and key source")
    p.add_argument("--warm-rows", type=int, default=1000, help="rows of a warm-up request")
    p.add_argument("--warm-requests", type=int, default=25, help="warm-up requests per client per block")
    p.add_argument("--warm-settle", type=float, default=0.002, help="a block's hit rate this close to the last ends it")
    p.add_argument("--max-warm-blocks", type=int, default=400)
    p.add_argument("--clients", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--seconds", type=float, default=20.0, help="throughput: about this long a point")
    p.add_argument("--p99-ms", type=float, default=50.0)
    p.add_argument("--server-cpus", default=None)
    p.add_argument("--policy-block", type=int, default=2000, help="policies: requests per reported block")
    p.add_argument("--policy-blocks", type=int, default=40, help="policies: blocks per policy")
    p.add_argument("--read-rows", type=int, default=100, help="reads: rows a call")
    p.add_argument("--read-calls", type=int, default=30, help="reads: calls a point")
    p.add_argument("--read-depths", nargs="+", type=int, default=[32, 128], help="reads: queue depths")
    p.add_argument("--read-turns", type=int, default=3, help="reads: rounds over the depths")
    p.add_argument("--warm-fill", type=float, default=1.25, help="warm: the warm file's rows over the tier's slots")
    p.add_argument("--warm-scratch", default="build/bench/warm", help="warm: where its warm files are written (kept)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--out", default="build/bench")
    args = p.parse_args(argv)
    repository, out = Path(args.repository), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = summary()
    fio_result = None

    def written(part: str, value) -> None:  # each part's file as soon as it is measured (the disk is in every file)
        write_results(out, f"tables-{part}.json", "benchmarks.tables", machine, disk=fio_result, **{part: value})

    read_result = None
    if "reads" in args.parts:  # before fio: the disk reads slower for minutes after fio's bursts on the build VM
        read_result = reads(repository, args)
    if "disk" in args.parts:
        fio_result = disk(repository)
        print(json.dumps(fio_result, indent=1))
        if args.parts == ["disk"]:
            written("disk", fio_result)
    if "capacity" in args.parts:
        written("capacity", capacity(repository, args.release))
    if "serve" in args.parts:
        result = serve(repository, out, args, fio_result)
        print_serve(result)
        if fio_result:  # the disk drifts: measured again after the serving figures
            result["disk_after"] = disk(repository)
            print(json.dumps(result["disk_after"], indent=1))
        written("serve", result)
    if "warm" in args.parts:
        written("warm", warm(repository, args))
    if "policies" in args.parts:
        written("policies", policies(repository, out, args))
    if read_result is not None:
        for point in read_result["points"]:
            fio_at = (fio_result or {}).get(f"fio_qd{point['depth']}")
            point["fio_us_per_block"] = 1e6 / fio_at["iops"] if fio_at else None
            point["over_fio"] = point["us_per_block"] / point["fio_us_per_block"] if fio_at else None
            print(f"reads depth {point['depth']} turn {point['turn']}: {point['us_per_block']:.1f} us a block"
                  + (f", fio {point['fio_us_per_block']:.1f} us (x{point['over_fio']:.2f})" if fio_at else ""))
        written("reads", read_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
