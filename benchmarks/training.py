"""Training benchmark: synthesize -> train (streaming; optionally in memory, an older tree's
in-memory path, and on a local Dask cluster) -> export -> serve -> score a few rows.

Every stage runs as its own process; its peak RSS is the largest resident set of that process
or any child it waited for (``wait4``'s ``ru_maxrss``). Prints a table and writes
``docs/results/training-<name>.json`` and ``.md``.

    python -m benchmarks.training --rows 200000 --scale 0.01 --name small --in-memory \\
        --baseline-tree /tmp/old-tree
    python -m benchmarks.training --rows 10000000 --scale 1.0 --name 10m --serve
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENSEMBLE = [sys.executable, "-m", "ensemble"]
MODELS = ("xgb", "dlrm_torch", "dlrm_tf", "blend")
STAGES = ("features", "xgb", "dlrm_torch", "dlrm_tf")

# In-memory training, the comparison for the streaming path: read the whole file, split, train_all.
# Run with the tree under test, or with another checkout on PYTHONPATH (--baseline-tree).
IN_MEMORY = """
import sys
from ensemble.runs import training
from ensemble.data import criteo
from ensemble.models.dlrm import DLRMConfig
from ensemble.models.xgb import XGBConfig
path, workdir, rounds, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
train, valid, test = criteo.split(criteo.read_criteo([path]))
config = training.TrainConfig(xgb=XGBConfig(rounds=rounds), dlrm=DLRMConfig(epochs=epochs))
training.train_all(train, valid, test, workdir, config)
"""


@dataclass
class Run:
    """One process: wall seconds, peak RSS (MiB), exit code."""

    name: str
    seconds: float
    peak_rss_mib: float
    returncode: int
    report: dict = field(default_factory=dict)


def run(name: str, argv: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT) -> Run:
    # cwd matters: `python -m` puts the working directory before PYTHONPATH on sys.path.
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    print(f"  {name}: {seconds:.1f}s, peak RSS {usage.ru_maxrss / 1024:.0f} MiB, exit {code}", flush=True)
    if code != 0:
        print(log.read_text()[-3000:], file=sys.stderr)
    return Run(name, seconds, usage.ru_maxrss / 1024, code)


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "TF_CPP_MIN_LOG_LEVEL": "2"}


def train_run(name: str, argv: list[str], workdir: Path, log: Path, env: dict, cwd: Path = ROOT) -> Run:
    result = run(name, argv, log, env, cwd)
    report_file = workdir / "train_report.json"
    if result.returncode == 0 and report_file.is_file():
        result.report = json.loads(report_file.read_text())
    return result


def tail_rows(path: Path, rows: int, out: Path) -> Path:
    """The last ``rows`` lines of a TSV (test-split rows) without reading the whole file."""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - rows * 400))
        lines = handle.read().splitlines()[-rows:]
    out.write_bytes(b"\n".join(lines) + b"\n")
    return out


def serve_and_score(repository: Path, rows_file: Path, work: Path, env: dict) -> dict:
    """Start `ensemble serve` on the exported repository, score the rows over HTTP, stop it."""
    from ensemble.base.machine import free_port

    ports = [str(free_port()) for _ in range(3)]
    log = work / "serve.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen([*ENSEMBLE, "serve", "--repository", str(repository), "--http-port", ports[0],
                                   "--grpc-port", ports[1], "--metrics-port", ports[2]],
                                  stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        while "ready:" not in log.read_text():
            if server.poll() is not None or time.perf_counter() - start > 900:
                raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        ready = time.perf_counter() - start
        scored = run("score (HTTP)", [*ENSEMBLE, "score", str(rows_file), "--url", f"127.0.0.1:{ports[0]}",
                                      "--output", str(work / "served.csv"), "--no-progress"], work / "score.log", env)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            _, status, usage = os.wait4(server.pid, 0)
        except ChildProcessError:
            usage = None
    import numpy as np
    import pandas as pd

    from ensemble.models import metrics

    scores = pd.read_csv(work / "served.csv")["score"].to_numpy()
    labels = np.array([int(line.split(b"\t", 1)[0]) for line in rows_file.read_bytes().splitlines()])
    return {"ready_seconds": ready, "rows": len(scores), "auc": metrics.auc(labels, scores),
            "score_seconds": scored.seconds, "server_peak_rss_mib": usage.ru_maxrss / 1024 if usage else None}


def stage_rows(result: Run) -> list[dict]:
    """Per training stage: seconds, rows/s (training rows, times epochs for the DLRMs), peak RSS."""
    rep = result.report
    if not rep:
        return []
    train_rows, epochs = rep["rows"]["train"], rep["config"]["dlrm"]["epochs"]
    out = []
    for stage in STAGES:
        seconds = rep["seconds"][stage]
        rows = train_rows * (epochs if stage.startswith("dlrm") else 1)
        out.append({"run": result.name, "stage": stage, "seconds": seconds, "rows_per_s": rows / seconds,
                    "peak_rss_mib_after": rep.get("peak_rss_mib_after", {}).get(stage)})
    return out


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(results: dict) -> str:
    lines = [f"# Training benchmark: {results['name']}", "",
             f"Machine: {results['machine']}. {results['note']}", "",
             f"Data: {results['rows']:,} rows, scale {results['scale']}, xgb rounds <= {results['xgb_rounds']}, "
             f"DLRM epochs {results['epochs']}.", "",
             "| process | seconds | peak RSS (MiB) |", "| --- | ---: | ---: |"]
    lines += [f"| {r['name']} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} |" for r in results["processes"]]
    lines += ["", "| run | stage | seconds | rows/s | process peak RSS after stage (MiB) |",
              "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {s['run']} | {s['stage']} | {s['seconds']:.1f} | {s['rows_per_s']:,.0f} | "
              f"{_mib(s['peak_rss_mib_after'])} |" for s in results["stages"]]
    lines += ["", "| run | " + " | ".join(f"{m} AUC" for m in MODELS) + " |", "| --- |" + " ---: |" * len(MODELS)]
    for name, aucs in results["auc"].items():
        lines.append(f"| {name} | " + " | ".join(f"{aucs.get(m, float('nan')):.4f}" for m in MODELS) + " |")
    if results.get("served"):
        s = results["served"]
        lines += ["", f"Served: the exported repository started in {s['ready_seconds']:.0f} s; {s['rows']:,} test rows "
                  f"scored over HTTP in {s['score_seconds']:.1f} s, AUC {s['auc']:.4f}; server process tree peak RSS "
                  f"{s['server_peak_rss_mib'] or 0:.0f} MiB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--input", default=None, help="an existing Criteo TSV instead of synthesizing")
    parser.add_argument("--name", default="small", help="results go to docs/results/training-NAME.*")
    parser.add_argument("--work", default=None, help="work folder (default build/bench-training-NAME)")
    parser.add_argument("--xgb-rounds", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--in-memory", action="store_true", help="also train in memory with this tree")
    parser.add_argument("--baseline-tree", default=None, help="also train in memory with an older checkout")
    parser.add_argument("--dask-local", type=int, default=0, help="also train on a LocalCluster of N workers")
    parser.add_argument("--serve", action="store_true", help="export, serve and score test rows over HTTP")
    args = parser.parse_args(argv)

    work = Path(args.work or ROOT / "build" / f"bench-training-{args.name}")
    work.mkdir(parents=True, exist_ok=True)
    env = _env(ROOT)
    processes: list[Run] = []
    data = Path(args.input) if args.input else work / "criteo.tsv"
    if not args.input:
        processes.append(run("synth", [*ENSEMBLE, "synth", "--rows", str(args.rows), "--scale", str(args.scale),
                                       "--output", str(data)], work / "synth.log", env))
    common = ["--xgb-rounds", str(args.xgb_rounds), "--epochs", str(args.epochs)]
    trains = [train_run("train (streaming)", [*ENSEMBLE, "train", str(data), "--workdir", str(work / "stream"), *common],
                        work / "stream", work / "train-stream.log", env)]
    if args.dask_local:
        trains.append(train_run(f"train (dask-local {args.dask_local})",
                                [*ENSEMBLE, "train", str(data), "--workdir", str(work / "dask"), *common,
                                 "--dask-local", str(args.dask_local)], work / "dask", work / "train-dask.log", env))
    if args.in_memory:
        trains.append(train_run("train (in memory, this tree)",
                                [sys.executable, "-c", IN_MEMORY, str(data), str(work / "memory"),
                                 str(args.xgb_rounds), str(args.epochs)], work / "memory", work / "train-memory.log", env))
    if args.baseline_tree:
        trains.append(train_run("train (in memory, before streaming)",
                                [*ENSEMBLE, "train", str(data), "--workdir", str(work / "baseline"), *common],
                                work / "baseline", work / "train-baseline.log", _env(Path(args.baseline_tree)),
                                Path(args.baseline_tree)))
    processes += trains
    served = None
    if args.serve and trains[0].returncode == 0:
        repository = work / "model_repository"
        processes.append(run("export", [*ENSEMBLE, "export", "--workdir", str(work / "stream"),
                                        "--repository", str(repository)], work / "export.log", env))
        served = serve_and_score(repository, tail_rows(data, 10_000, work / "tail.tsv"), work, env)

    from ensemble.base.machine import describe, summary

    results = {
        "name": args.name, "rows": trains[0].report.get("rows", {}) and sum(trains[0].report["rows"].values()),
        "scale": args.scale, "xgb_rounds": args.xgb_rounds, "epochs": args.epochs,
        "machine": summary(), "machine_detail": describe(), "python": platform.python_version(),
        "note": (f"Load average (1/5/15 min) at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; "
                 "other jobs on the machine slow every stage: compare within one run."),
        "processes": [{k: v for k, v in asdict(p).items() if k != "report"} for p in processes],
        "stages": [row for t in trains for row in stage_rows(t)],
        "auc": {t.name: {m: v["auc"] for m, v in t.report.get("test", {}).items()} for t in trains},
        "served": served,
        "reports": {t.name: t.report for t in trains},
    }
    out = ROOT / "docs" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"training-{args.name}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"training-{args.name}.md").write_text(markdown(results))
    print(markdown(results))
    return 0 if all(p.returncode == 0 for p in processes) else 1


if __name__ == "__main__":
    sys.exit(main())
