"""Ranking requests at their limit beside a 1-row closed loop: does the loop keep its latency?

One client sends 1-row requests back to back (the closed loop); in the loaded phases a second, in a
process of its own, sends
ranking requests of ``max_candidates`` candidates back to back with a deadline (its request timeout).
Phases alternate, quiet and loaded, so the VM's drifts in speed hit both alike; the table gives the
loop's p50 and p99 in each and their ratio, and the ranking requests' latency, refusals and misses
(an answer later than its deadline). The server and the two clients can be pinned.

Not a test: prints a table and writes ``<out>/rank-beside.json``. ::

    .venv/bin/python -m benchmarks.rank_beside --repository model_repository --rounds 4 --seconds 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path


from benchmarks import percentile, write_results
from ensemble import schema
from ensemble.base.machine import summary


def _loop(url: str, protocol: str, rows, seconds: float) -> list[float]:
    """Latencies (ms) of 1-row requests sent back to back for ``seconds``."""
    from clients.triton import RankerClient, Retry

    client = RankerClient(url, protocol, retry=Retry(attempts=1))
    dense, cats = rows
    times, i, end = [], 0, time.monotonic() + seconds
    while time.monotonic() < end:
        k = i % len(dense)
        start = time.perf_counter()
        client.score(dense[k:k + 1], cats[k:k + 1])
        times.append((time.perf_counter() - start) * 1e3)
        i += 1
    client.close()
    return times


def _ranker(url: str, protocol: str, candidates, deadline_s: float, stop, results, cpu: int | None,
            idle: bool) -> None:
    """Ranking requests back to back until ``stop``, in a process of its own (so that its client's
    work does not hold the loop's interpreter): latencies of the answered ones, refusals, misses.
    ``idle``: the process runs at SCHED_IDLE, so that its own work (encoding 8,192 candidates, reading
    the answers) never delays the loop's client when both share a core."""
    from ensemble.base.grpc_polling import import_grpc

    import_grpc()
    from clients.triton import RankerClient, Retry

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    out = {"latencies": [], "refused": 0, "missed": 0, "errors": 0}
    client = RankerClient(url, protocol, timeout=deadline_s, retry=Retry(attempts=1))
    while not stop.is_set():
        start = time.perf_counter()
        try:
            client.rank(None, candidates)
            took = time.perf_counter() - start
            out["latencies"].append(took * 1e3)
            out["missed"] += took > deadline_s
        except Exception as exc:  # noqa: BLE001 - counted
            out["refused" if "deadline" in str(exc) else "errors"] += 1
            time.sleep(0.01)
    client.close()
    results.put(out)


def run(repository: Path, rounds: int, seconds: float, protocol: str, candidates: int, deadline_s: float,
        server_cpus: str | None, loop_cpu: int | None, rank_cpu: int | None, idle_client: bool = True,
        layout: str = "native") -> list[dict]:
    from ensemble.base.grpc_polling import import_grpc

    import_grpc()
    from ensemble.data import criteo
    from ensemble.features import transforms
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port

    frame = criteo.synthesize(criteo.SynthConfig(rows=max(candidates, 1000), scale=0.01, seed=29)).frame
    dense, cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
    options = ServerOptions(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            cpu_list=server_cpus, layout=layout)
    results = []
    with TritonServer(options) as server:
        url = server.http_url if protocol == "http" else server.grpc_url
        _loop(url, protocol, (dense[:1000], cats[:1000]), 1.0)  # warm-up
        for round_ in range(rounds):
            for loaded in (False, True):
                context = multiprocessing.get_context("spawn")
                stop, answers = context.Event(), context.Queue()
                ranking = None
                if loaded:
                    ranking = context.Process(target=_ranker, args=(url, protocol, (dense[:candidates], cats[:candidates]),
                                                                    deadline_s, stop, answers, rank_cpu, idle_client),
                                               daemon=True)
                    ranking.start()
                    time.sleep(3.0)  # the process started and its ranking requests under way before the loop is measured
                if loop_cpu is not None:
                    os.sched_setaffinity(0, {loop_cpu})
                times = _loop(url, protocol, (dense[:1000], cats[:1000]), seconds)
                stop.set()
                out = answers.get(timeout=120) if ranking is not None else {}
                if ranking is not None:
                    ranking.join(60)
                point = {"round": round_ + 1, "rank_load": loaded, "requests": len(times),
                         "p50_ms": percentile(times, 0.5), "p99_ms": percentile(times, 0.99)}
                if loaded:
                    lat = out["latencies"]
                    point.update(rank_answered=len(lat), rank_refused=out["refused"], rank_missed=out["missed"],
                                 rank_errors=out["errors"], rank_p50_ms=percentile(lat, 0.5),
                                 rank_max_ms=max(lat) if lat else float("nan"))
                results.append(point)
                print(point, flush=True)
    return results


def table(results: list[dict], candidates: int, deadline_s: float) -> str:
    lines = [f"| round | loop p50 ms quiet / beside ranking | loop p99 ms quiet / beside | p99 ratio | "
             f"ranking requests of {candidates:,} (deadline {deadline_s * 1e3:.0f} ms): answered, p50 / max ms, "
             "refused, missed |", "| --- | --- | --- | --- | --- |"]
    for round_ in sorted({r["round"] for r in results}):
        quiet = next(r for r in results if r["round"] == round_ and not r["rank_load"])
        busy = next(r for r in results if r["round"] == round_ and r["rank_load"])
        lines.append(f"| {round_} | {quiet['p50_ms']:.3f} / {busy['p50_ms']:.3f} | {quiet['p99_ms']:.2f} / "
                     f"{busy['p99_ms']:.2f} | {busy['p99_ms'] / quiet['p99_ms']:.2f}x | {busy['rank_answered']}, "
                     f"{busy['rank_p50_ms']:.1f} / {busy['rank_max_ms']:.1f}, {busy['rank_refused']}, "
                     f"{busy['rank_missed']} |")
    ratios = [b["p99_ms"] / q["p99_ms"] for q, b in zip([r for r in results if not r["rank_load"]],
                                                         [r for r in results if r["rank_load"]])]
    lines.append(f"\nloop p99 beside ranking / quiet: median {statistics.median(ratios):.2f}x "
                 f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="model_repository", help="an exported model repository")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0, help="per phase")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--candidates", type=int, default=schema.MAX_BATCH_SIZE, help="per ranking request (the limit)")
    p.add_argument("--deadline-ms", type=float, default=1000.0, help="the ranking requests' timeout")
    p.add_argument("--server-cpus", default=None, help="run the server under taskset -c on these CPUs")
    p.add_argument("--loop-cpu", type=int, default=None, help="pin the closed loop's thread to this CPU")
    p.add_argument("--rank-cpu", type=int, default=None, help="pin the ranking client's thread to this CPU")
    p.add_argument("--ranking-client", choices=["idle", "normal"], default="idle",
                   help="the ranking client's scheduling class: idle (SCHED_IDLE: its own work never delays the "
                        "loop's client on a shared core, so the table shows what the server does) or normal")
    p.add_argument("--layout", choices=["native", "fused"], default="native", help="the CPU layout served")
    p.add_argument("--out", default="build/bench", help="folder of rank-beside.json")
    args = p.parse_args(argv)
    machine = summary()
    results = run(Path(args.repository), args.rounds, args.seconds, args.protocol, args.candidates,
                  args.deadline_ms / 1e3, args.server_cpus, args.loop_cpu, args.rank_cpu, args.ranking_client == "idle",
                  args.layout)
    print(table(results, args.candidates, args.deadline_ms / 1e3))
    write_results(args.out, "rank-beside.json", "benchmarks.rank_beside", machine, results=results,
                  candidates=args.candidates, deadline_ms=args.deadline_ms, ranking_client=args.ranking_client,
                  layout=args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
