"""`ensemble demo`: synthesize -> fit -> train -> export -> serve -> check parity -> measure."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ensemble import schema
from ensemble.base import machine
from ensemble.runs import training
from ensemble.base.console import framework_info_quieted
from ensemble.data import criteo
from ensemble.data.edge_cases import edge_case_rows
from ensemble.features import transforms
from ensemble.repository.export import TrainedArtifacts, export_repository
from ensemble.scoring.pipeline import Pipeline
from ensemble.operate.lifecycle import run_until_signal
from ensemble.operate.server import ServerOptions, TritonServer


@dataclass(frozen=True)
class DemoOptions:
    synth: criteo.SynthConfig = field(default_factory=criteo.SynthConfig)
    train: training.TrainConfig = field(default_factory=training.TrainConfig)
    workdir: Path = Path("build")
    repository: Path = Path("model_repository")
    server: ServerOptions | None = None  # repository filled in from above
    keep_serving: bool = False
    parity_rows: int = 2000
    latency_requests: int = 300


def _percentiles(samples: list[float]) -> dict[str, float]:
    from loadtest.statistics import percentile

    return {"p50_ms": percentile(samples, 0.5) * 1e3, "p99_ms": percentile(samples, 0.99) * 1e3, "n": len(samples)}


def _timed(fn: Callable[[], object], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def run_demo(options: DemoOptions, log: Callable[[str], None] = print) -> dict:
    """Run the whole pipeline once and return the summary (also written to the workdir)."""
    from clients.triton import RankerClient

    started = time.perf_counter()
    workdir = Path(options.workdir)
    summary: dict = {"machine": machine.summary(),
                     "synth": asdict(options.synth)}

    log(f"1/6 synthesizing {options.synth.rows} rows (cardinality scale {options.synth.scale})")
    synth = criteo.synthesize(options.synth)
    path = criteo.write_criteo(synth.frame, workdir / "data" / "synthetic.tsv")
    frame = criteo.read_criteo([path])
    train, valid, test = criteo.split(frame)
    n_test = len(test)
    from ensemble.models.metrics import auc
    summary["best_possible_test_auc"] = auc(test[schema.LABEL], synth.probability[-n_test:])
    log(f"    click rate {frame[schema.LABEL].mean():.3f}; the generator's own (best possible) "
        f"test AUC {summary['best_possible_test_auc']:.4f}")

    log("2/6 fitting NVTabular features and training xgb, dlrm_torch, dlrm_tf, blend")
    report = training.train_all(train, valid, test, workdir, options.train, log)
    summary["accuracy"] = report["test"]
    summary["train_seconds"] = report["seconds"]
    for name, m in report["test"].items():
        log(f"    {name:<11} test AUC {m['auc']:.4f}  log loss {m['logloss']:.4f}")

    log(f"3/6 exporting the model repository to {options.repository}")
    export_repository(TrainedArtifacts.under(workdir), options.repository)

    summary["lean_transform"] = _transform_timings(workdir / "workflow", test)
    log(f"    features, 1 row: lean {summary['lean_transform']['lean_1row_ms']:.4f} ms, "
        f"NVTabular Workflow.transform {summary['lean_transform']['nvtabular_1row_ms']:.1f} ms (medians)")

    server_options = options.server or ServerOptions(Path(options.repository))
    server_options = replace(server_options, repository=Path(options.repository))
    log("4/6 starting tritonserver")
    server = TritonServer(server_options)
    start = time.perf_counter()
    server.start()
    summary["server_start_seconds"] = time.perf_counter() - start
    summary["layout"] = server.options.layout.value if hasattr(server.options.layout, "value") else str(
        server.options.layout)
    http = grpc = None
    try:
        log(f"    ready in {summary['server_start_seconds']:.1f}s: HTTP {server.http_url}, "
            f"gRPC {server.grpc_url}, metrics {server.metrics_url}")
        http = RankerClient(server.http_url, "http")
        grpc = RankerClient(server.grpc_url, "grpc")

        log("5/6 parity: served scores vs the in-process pipeline on fresh random rows")
        fresh = criteo.synthesize(criteo.SynthConfig(rows=options.parity_rows, scale=options.synth.scale,
                                                 seed=options.synth.seed + 1000)).frame
        dense = np.concatenate([transforms.dense_array(fresh), edge_case_rows(np.random.default_rng(7))[0]])
        cats = np.concatenate([transforms.encode_categorical(fresh), edge_case_rows(np.random.default_rng(7))[1]])
        with framework_info_quieted():  # LiteRT's XNNPACK line, at the first TFLite call
            pipeline = Pipeline.from_repository(options.repository, threads=1)
            local = pipeline.score(dense, cats)
        served = http.score(dense, cats, all_scores=True)
        diffs = {k: float(np.max(np.abs(served[k] - local[k].ravel()))) for k in served}
        summary["parity_max_abs_diff"] = diffs
        summary["parity_rows"] = int(len(dense))
        summary["example"] = _example_scores(pipeline, synth.frame)
        ok = max(diffs.values()) <= 1e-5
        log(f"    {len(dense)} rows, max |served - in-process|: "
            + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()) + ("  OK" if ok else "  MISMATCH"))

        log("6/6 latency sample (sequential requests, one client, this machine)")
        summary["latency"] = {}
        for label, client in (("http", http), ("grpc", grpc)):
            for rows in (1, 100):
                d, c = dense[:rows], cats[:rows]
                client.infer(d, c)  # warm-up
                samples = _timed(lambda: client.infer(d, c), options.latency_requests)
                summary["latency"][f"{label}_{rows}rows"] = _percentiles(samples)
        for key, value in summary["latency"].items():
            log(f"    {key:<12} p50 {value['p50_ms']:.2f} ms  p99 {value['p99_ms']:.2f} ms  (n={value['n']})")
        summary["in_process_step_ms"] = _step_timings(pipeline, dense, cats)
        for rows, steps in summary["in_process_step_ms"].items():
            log(f"    in-process, 1 thread, {rows}: " + ", ".join(f"{k} {v:.3f}" for k, v in steps.items()) + " ms")
        summary["server_rss_mib"] = server.resident_memory_bytes() / 2**20
        summary["backend_processes"] = server.backend_processes()
        log(f"    server resident memory, all processes: {summary['server_rss_mib']:.0f} MiB")
        for model, proc in sorted(summary["backend_processes"].items()):
            log(f"      {model:<11} {proc['rss_mib']:6.0f} MiB  frameworks loaded: "
                f"{', '.join(proc['frameworks']) or 'none (numpy only)'}")
        finish(summary, workdir, started, ok, options, server, log, lambda: _check_readme(summary, log))
    finally:
        for client in (http, grpc):  # Triton waits for open connections before it exits (up to 30 s)
            if client is not None:
                client.close()
        server.stop()
    return summary


def finish(summary: dict, workdir: Path, started: float, ok: bool, options: DemoOptions, server: TritonServer,
           log: Callable[[str], None], before_verdict: Callable[[], None] | None = None) -> None:
    """A demo's last steps: write the summary, fail on a parity mismatch, keep serving if asked."""
    summary["seconds_total"] = time.perf_counter() - started
    (workdir / "demo_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log(f"done in {summary['seconds_total']:.0f}s; summary in {workdir / 'demo_summary.json'}")
    if before_verdict is not None:
        before_verdict()
    if not ok:
        raise SystemExit("served scores differ from the in-process pipeline")
    if options.keep_serving:
        log("serving until Ctrl-C")
        run_until_signal(server.alive)


# The README's example row: line 1,535 of the demo's synthetic data, all 26 of whose category values
# are in the demo model's vocabulary (README "Calling it").
EXAMPLE_ROW = 1534
EXAMPLE_UNSEEN_COLUMN = 3  # C4


def _example_scores(pipeline: Pipeline, frame) -> dict[str, float]:
    """In-process scores of the README's example row, as is and with C4 replaced by a value the
    model never saw."""
    row = frame.iloc[[EXAMPLE_ROW]]
    dense, cats = transforms.dense_array(row), transforms.encode_categorical(row)
    unseen = cats.copy()
    unseen[0, EXAMPLE_UNSEEN_COLUMN] = b"unseen00"
    score = lambda c: float(pipeline.score(dense, c)[schema.SCORE.name].ravel()[0])  # noqa: E731
    return {"row": EXAMPLE_ROW + 1, "score": score(cats), "score_c4_unseen": score(unseen)}


def _check_readme(summary: dict, log: Callable[[str], None]) -> None:
    """Say whether the README's demo figures are this build's (ensemble.runs.readme_figures)."""
    from ensemble.runs import readme_figures

    if not readme_figures.README.is_file():
        return
    log(readme_figures.verdict(readme_figures.README.read_text(), summary))


def _step_timings(pipeline: Pipeline, dense: np.ndarray, cats: np.ndarray) -> dict[str, dict[str, float]]:
    """Median time of each step called in-process back to back (warm caches): what the served
    chain's steps cost apart from serving."""
    out = {}
    for rows in (1, 100):
        tensors = {schema.DENSE.name: dense[:rows], schema.CATEGORICAL.name: cats[:rows]}
        out[f"{rows} rows"] = {}
        for model, step in pipeline.steps.items():
            step.run(tensors)
            out[f"{rows} rows"][model.value] = statistics.median(_timed(lambda: step.run(tensors), 200)) * 1e3
            tensors.update(step.run(tensors))
    return out


def _transform_timings(workflow_dir: Path, test) -> dict[str, float]:
    from ensemble.features.transforms import LeanTransform, load_workflow, nvtabular_transform

    lean = LeanTransform.load(workflow_dir)
    # NVTabular fails when a categorical column is null in every row of a call: use a full row.
    full = test[test[list(schema.CATEGORICAL_COLUMNS)].notna().all(axis=1)].iloc[:1]
    d, c = transforms.dense_array(full), transforms.encode_categorical(full)
    lean_ms = statistics.median(_timed(lambda: lean(d, c), 2000)) * 1e3
    workflow = load_workflow(workflow_dir)
    nvtabular_transform(workflow, full)  # warm-up
    nvt_ms = statistics.median(_timed(lambda: nvtabular_transform(workflow, full), 20)) * 1e3
    return {"lean_1row_ms": lean_ms, "nvtabular_1row_ms": nvt_ms}
