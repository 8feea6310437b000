"""`python -m loadtest.sweep`: the ranker's dynamic-batching settings, measured.

For each (queue delay, instance count) it writes the ``ranker`` config of the layout asked for
(``--layout``: the native one by default, or the fused one) from the typed builder
(:func:`ensemble.repository.configs.layout_specs`, with the two fields replaced) into a scratch copy of
the repository, starts tritonserver on it pinned like ``ensemble loadtest`` (server on the last core,
locust on the others), and runs one locust scenario per rows/request. Prints a table and writes
``sweep.json`` and ``sweep.md``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from ensemble.repository import configs
from ensemble.models.registry import Layout
from ensemble.schema import Model


def _repository_with(source: Path, into: Path, layout: Layout, queue_delay_us: int, instances: int) -> Path:
    repo = into / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(source, repo, symlinks=True)
    (models, _) = configs.layout_specs(layout)
    ranker = next(m for m in models if m.name == Model.RANKER.value)
    spec = replace(ranker, queue_delay_us=queue_delay_us, instances=instances)
    (repo / Model.RANKER.value / configs.config_file(layout)).write_text(configs.to_text(configs.model_config(spec)))
    return repo


def main(argv: list[str] | None = None) -> int:
    from ensemble.operate.server import ServerOptions, TritonServer
    from ensemble.base.machine import free_port
    from ensemble.base.machine import describe
    from loadtest.runner import Pinning, RunnerOptions, holdout_file, locust_command, read_locust_csv, served_rows_per_s

    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--repository", default="model_repository", help="an exported repository")
    p.add_argument("--layout", choices=[Layout.NATIVE.value, Layout.FUSED.value], default=Layout.NATIVE.value)
    p.add_argument("--out", default="build/loadtest/sweep", help="result folder")
    p.add_argument("--queue-delays", nargs="+", type=int, default=[0, 200, 1000], help="microseconds")
    p.add_argument("--instances", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100])
    p.add_argument("--users", type=int, default=16, help="concurrent locust users per scenario")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per scenario")
    args = p.parse_args(argv)

    out = Path(args.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)  # locust's CSVs, the held-out rows, the server log
    options = RunnerOptions(repository=Path(args.repository), out=out / "raw", duration=args.duration, warmup=2.0)
    pinning, data_file = Pinning.choose(True), holdout_file(options)
    results = []
    with tempfile.TemporaryDirectory(prefix="sweep-") as scratch:
        for delay in args.queue_delays:
            for instances in args.instances:
                repo = _repository_with(Path(args.repository), Path(scratch), Layout(args.layout), delay, instances)
                server = TritonServer(ServerOptions(repo, http_port=free_port(), grpc_port=free_port(),
                                                    metrics_port=free_port(), cpu_list=pinning.server,
                                                    log_file=out / "raw" / "tritonserver.log", layout=Layout(args.layout)))
                with server:
                    url = f"http://{server.http_url}"
                    for rows in args.rows:
                        import subprocess

                        warm = locust_command("triton-http", url, rows, args.users, 2, options, data_file, pinning, None)
                        subprocess.run(warm, capture_output=True, timeout=60, check=False)
                        prefix = out / "raw" / f"d{delay}_i{instances}_r{rows}"
                        cmd = locust_command("triton-http", url, rows, args.users, args.duration, options,
                                             data_file, pinning, prefix)
                        subprocess.run(cmd, capture_output=True, timeout=args.duration + 60, check=False)
                        stats = read_locust_csv(prefix)
                        row = {"queue_delay_us": delay, "instances": instances, "rows": rows,
                               "users": args.users, "rows_per_s": served_rows_per_s(stats, rows),
                               "p50_ms": stats["p50_ms"], "p99_ms": stats["p99_ms"], "failures": stats["failures"]}
                        results.append(row)
                        print(f"queue delay {delay:>5} us  instances {instances}  rows {rows:>3}: "
                              f"{row['rows_per_s']:>9,.0f} rows/s  p50 {row['p50_ms']:.0f} ms  "
                              f"p99 {row['p99_ms']:.0f} ms  failures {row['failures']:.0f}", flush=True)
    command = " ".join(["python -m loadtest.sweep", *(argv if argv is not None else sys.argv[1:])])
    (out / "sweep.json").write_text(json.dumps({"machine": describe(), "command": command,
                                                "pinning": {"server": pinning.server, "load": pinning.load},
                                                "results": results}, indent=1))
    m = describe()
    lines = [f"The {args.layout} layout, measured on {m['arch']}, {m['cores']} cores ({m['cpu']}), no GPU, server on CPU "
             f"{pinning.server}, locust on "
             f"CPU {pinning.load}, {args.users} users, {args.duration:g} s per scenario: `{command}`", "",
             "| queue delay (us) | instances | rows/request | rows/s | p50 ms | p99 ms | failures |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['queue_delay_us']} | {r['instances']} | {r['rows']} | {r['rows_per_s']:,.0f} | "
              f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['failures']:.0f} |" for r in results]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
