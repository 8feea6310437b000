"""Shadow scoring's cost and fidelity: server CPU per request with and without a shadow share, and the
histogram of score differences against the offline difference of the two releases on the same rows.

Not a test: prints a table and writes ``<out>/shadow-cost.json``. What it runs, on loopback:

1. A private copy of ``--repository`` with two releases exported into it: the serving one from
   ``--workdir`` (declared) and a candidate from ``--candidate-workdir`` (a model trained
   differently, so the scores differ).
2. ``ensemble serve --replicas N`` on it, then ``ensemble experiment start --candidate C --share P``
   with ``--shadow S``.
3. Phases of ``--seconds`` alternate, with the shadow share on and off (the gateway's routes
   switched in one step, both releases loaded throughout): ``--clients`` plain tritonclient clients
   send 1-row requests, one at a time, with a pause between them (a fixed load, not overload), rows
   drawn in turn from ``--rows`` synthetic rows. Per phase: requests answered and the tritonserver
   processes' CPU seconds (user + system, from /proc), so CPU per request.
4. The replicas' ``ensemble_shadow_score_difference`` histograms against the same rows scored
   in-process by both releases: mean |difference| and the share of rows under each bucket bound.

The targets (issue "Try a new ranker on live traffic"): CPU per request +<= 12% at a 10% shadow share
against no shadow at the same load; the histogram reproduces the offline difference. Usage::

    .venv/bin/python -m benchmarks.shadow_cost --repository model_repository --workdir build \
        --candidate-workdir build-candidate
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks import write_results
from benchmarks.fleet_setup import private_repository, serve_fleet
from ensemble import schema
from ensemble.base.machine import summary


def _cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def _tritonservers(ports: list[int]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"tritonserver") and any(f"--http-port={p}".encode() in argv for p in ports):
                found.append(int(entry.name))
    return found


def _client(address: str, protocol: str, rows, pause: float, stop: threading.Event, counts: list[int],
            errors: list[str], first: int) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(address)
    dense, cats = rows
    k = first
    while not stop.is_set():
        i = k % len(dense)
        inputs = [module.InferInput(schema.DENSE.name, [1, dense.shape[1]], "FP32"),
                  module.InferInput(schema.CATEGORICAL.name, [1, cats.shape[1]], "BYTES")]
        inputs[0].set_data_from_numpy(dense[i:i + 1])
        inputs[1].set_data_from_numpy(cats[i:i + 1])
        try:
            client.infer(schema.Model.RANKER.value, inputs)
            counts[0] += 1
        except Exception as exc:  # noqa: BLE001 - every failure counts
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        k += 1
        time.sleep(pause)
    client.close()


def _histogram(ports: list[int], candidate: int) -> tuple[float, float, dict[float, float]]:
    """(count, sum, {bound: cumulative count}) of ensemble_shadow_score_difference for ``candidate``,
    summed over the replicas' metrics ports."""
    count = total = 0.0
    buckets: dict[float, float] = {}
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if not line.startswith("ensemble_shadow_score_difference") or f'candidate="{candidate}"' not in line \
                    or 'model="ranker"' not in line:
                continue
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("ensemble_shadow_score_difference_count"):
                count += value
            elif line.startswith("ensemble_shadow_score_difference_sum"):
                total += value
            elif line.startswith("ensemble_shadow_score_difference_bucket"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                key = float("inf") if bound == "+Inf" else float(bound)
                buckets[key] = buckets.get(key, 0.0) + value
    return count, total, buckets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--workdir", default="build", help="a training's workdir: the serving release's export")
    parser.add_argument("--candidate-workdir", required=True, help="a training's workdir: the candidate's export")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.002, help="seconds each client waits between requests")
    parser.add_argument("--share", type=float, default=1.0, help="the candidate's percent of requests")
    parser.add_argument("--shadow", type=float, default=10.0, help="percent of the serving release's requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="per phase")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--server-cpu", type=int, default=None, help="pin every tritonserver thread to this CPU")
    parser.add_argument("--client-cpu", type=int, default=None, help="pin this process (the clients) to this CPU")
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args(argv)

    from ensemble import cli
    from ensemble.data import criteo
    from ensemble.features import transforms
    from ensemble.fleet.release import _route
    from ensemble.scoring.pipeline import Pipeline

    scratch, repository, (serving, candidate) = private_repository(
        args.repository, [args.workdir, args.candidate_workdir], "shadow-cost-", serve_newest=False)

    frame = criteo.synthesize(criteo.SynthConfig(rows=args.rows, scale=0.01, seed=31)).frame
    rows = (transforms.dense_array(frame), transforms.encode_categorical(frame))
    offline = np.abs(Pipeline.from_repository(repository, threads=1, release=candidate).score(*rows)["score"].ravel()
                     - Pipeline.from_repository(repository, threads=1, release=serving).score(*rows)["score"].ravel())

    served = serve_fleet(repository, args.replicas, scratch)
    gateway, grpc_port, metrics_port = served.gateway, served.grpc_port, served.metrics_port
    phases, errors = [], []
    try:
        if served.record() is None or cli.main(["experiment", "start", "--url", gateway, "--candidate", str(candidate),
                                                "--share", f"{args.share:g}", "--shadow", f"{args.shadow:g}"]) != 0:
            print("\n".join(served.log[-30:]), file=sys.stderr)
            return 1
        fleet = served.record()
        arms = fleet.gateway.arms
        pids = _tritonservers([r.http_port for r in fleet.gateway.replicas])
        if args.server_cpu is not None:
            for pid in pids:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    os.sched_setaffinity(int(task.name), {args.server_cpu})
        if args.client_cpu is not None:
            os.sched_setaffinity(0, {args.client_cpu})
        metrics_ports = [metrics_port + i for i in range(args.replicas)]
        for round_ in range(args.rounds):
            for shadow in (args.shadow, 0.0) if round_ % 2 == 0 else (0.0, args.shadow):
                fleet = _route(fleet, serving, arms=arms, shadow=shadow)
                stop, counts = threading.Event(), [[0] for _ in range(args.clients)]
                threads = [threading.Thread(target=_client, args=(
                    gateway if i % 2 == 0 else f"127.0.0.1:{grpc_port}", "http" if i % 2 == 0 else "grpc", rows,
                    args.pause, stop, counts[i], errors, i * 97), daemon=True) for i in range(args.clients)]
                for t in threads:
                    t.start()
                time.sleep(1.0)  # under way before the window opens
                answered0, cpu0, shadowed0 = sum(c[0] for c in counts), _cpu_seconds(pids), \
                    _histogram(metrics_ports, candidate)[0]
                time.sleep(args.seconds)
                answered1, cpu1, shadowed1 = sum(c[0] for c in counts), _cpu_seconds(pids), \
                    _histogram(metrics_ports, candidate)[0]
                stop.set()
                for t in threads:
                    t.join(30)
                n = answered1 - answered0
                point = {"round": round_ + 1, "shadow": shadow, "answered": n, "shadowed": shadowed1 - shadowed0,
                         "cpu_s": cpu1 - cpu0, "cpu_ms_per_request": (cpu1 - cpu0) / max(n, 1) * 1e3}
                phases.append(point)
                print(point, flush=True)
        time.sleep(1.0)
        count, total, buckets = _histogram(metrics_ports, candidate)
        cli.main(["experiment", "abort", "--url", gateway])
    finally:
        served.stop()
    ratios = []
    for round_ in range(1, args.rounds + 1):
        on = next(p for p in phases if p["round"] == round_ and p["shadow"])
        off = next(p for p in phases if p["round"] == round_ and not p["shadow"])
        ratios.append(on["cpu_ms_per_request"] / off["cpu_ms_per_request"])
    bounds = sorted(b for b in buckets if b != float("inf"))
    served_share = {b: buckets[b] / count if count else float("nan") for b in bounds}
    offline_share = {b: float(np.mean(offline <= b)) for b in bounds}
    result = {"serving": serving, "candidate": candidate, "shadow": args.shadow, "share": args.share,
              "phases": phases, "cpu_ratio": ratios, "failed": len(errors), "errors": errors[:5],
              "histogram": {"count": count, "mean": total / count if count else float("nan"),
                            "share_at_or_under": {str(b): s for b, s in served_share.items()}},
              "offline": {"rows": len(offline), "mean": float(offline.mean()),
                          "share_at_or_under": {str(b): s for b, s in offline_share.items()}},
              "replicas": args.replicas, "clients": args.clients, "pause": args.pause,
              "server_cpu": args.server_cpu, "client_cpu": args.client_cpu}
    print("| round | CPU ms per request, shadow off | shadow on | ratio |\n| --- | --- | --- | --- |")
    for round_, ratio in enumerate(ratios, 1):
        on = next(p for p in phases if p["round"] == round_ and p["shadow"])
        off = next(p for p in phases if p["round"] == round_ and not p["shadow"])
        print(f"| {round_} | {off['cpu_ms_per_request']:.3f} | {on['cpu_ms_per_request']:.3f} | {ratio:.3f}x |")
    print(f"\nmedian ratio {statistics.median(ratios):.3f}x; {len(errors)} failed requests")
    print(f"score difference: histogram of {count:.0f} shadowed rows mean {result['histogram']['mean']:.5f}, "
          f"offline over the {len(offline)} rows sent mean {offline.mean():.5f}")
    print("| at or under | served histogram | offline |\n| --- | --- | --- |")
    for b in bounds:
        print(f"| {b:g} | {served_share[b]:.3f} | {offline_share[b]:.3f} |")
    write_results(args.out, "shadow-cost.json", "benchmarks.shadow_cost", summary(), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
