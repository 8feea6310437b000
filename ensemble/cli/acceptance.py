"""The GPU acceptance run: one command for the first host with NVIDIA GPUs (``make gpu-acceptance``).

NOT RUN on this project's machines (no GPU, no Docker engine). Its parts that need neither (the
readiness wait, scoring through a server, the comparison, the report) are tested against the CPU
server; the Docker commands are checked against docker-compose.yml by unit tests.

Steps (each command is printed before it runs; ``--dry-run`` prints them and stops):

1. ``docker compose --profile gpu up --build --detach triton``: the two GPU trainer stages, export
   and ``ensemble check --target gpu`` run first (``depends_on``), then NGC Triton with
   ``--model-config-name=gpu``, whose warm-up makes every model infer before it reports ready.
2. Wait for ``/v2/health/ready`` (``--strict-readiness``: every model ready).
3. Copy the served repository out of the container and load it in the CPU in-process pipeline
   (:class:`ensemble.scoring.pipeline.Pipeline`, CPU: compiled trees / XGBoost, TorchScript, TFLite).
4. Score fresh synthetic rows (a seed training never used) through the GPU-served ranker and the
   CPU pipeline; compare every output within :data:`TOLERANCES`.
5. A short locust run against the GPU server (the load-test harness's own command).
6. Write ``report.json`` and ``report.md`` with the GPU name (``nvidia-smi``), the container
   release, the comparison and the load test; exit 1 unless everything passed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.features.fresh import fresh_rows
from ensemble.operate.lifecycle import wait_ready
from ensemble.models import triton_releases

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SERVICE = "triton"  # the GPU profile's server in docker-compose.yml
REPOSITORY_IN_CONTAINER = "/models"  # its --model-repository

# Largest |GPU - CPU| accepted per output, on probabilities in [0, 1]. The two sides run the same
# trained weights but not the same arithmetic: FIL sums the trees in float32 in another order
# than the compiled trees / XGBoost (measured here: <= 4e-7 between CPU tree paths; 1e-4 leaves
# room for FIL); the GPU DLRMs run TF32 matmuls (10-bit mantissa, TensorFlow's default on Ampere
# and later) and whatever float16 the Keras mixed-precision policy kept, against float32 TorchScript
# and TFLite on the CPU: 5e-3 on a probability is ~2% of a logit unit near 0.5. The blend combines
# the three, so it gets the DLRMs' bound.
TOLERANCES: dict[str, float] = {
    schema.SCORE_XGB.name: 1e-4,
    schema.SCORE_DLRM_TORCH.name: 5e-3,
    schema.SCORE_DLRM_TF.name: 5e-3,
    schema.SCORE.name: 5e-3,
}


@dataclass(frozen=True)
class AcceptanceOptions:
    """Attributes: url of the GPU server's HTTP port; out (report folder); rows to compare and
    their seed; load-test users and seconds; readiness timeout (training runs first); compose
    file; keep (leave the services up afterwards); dry_run (print the commands only)."""

    url: str = "http://localhost:8000"
    out: Path = Path("build/gpu-acceptance")
    rows: int = 4096
    seed: int = 2024
    users: int = 16
    seconds: float = 60.0
    ready_timeout: float = 7200.0
    compose_file: Path = COMPOSE_FILE
    keep: bool = False
    dry_run: bool = False


def compose(options: AcceptanceOptions, *args: str) -> list[str]:
    """A ``docker compose`` command on the GPU profile of the project's compose file."""
    return ["docker", "compose", "-f", str(options.compose_file), "--profile", "gpu", *args]


def commands(options: AcceptanceOptions) -> dict[str, list[str]]:
    """Every external command the run uses, by step name (what ``--dry-run`` prints)."""
    return {
        "up": compose(options, "up", "--build", "--detach", SERVICE),
        "copy_repository": compose(options, "cp", f"{SERVICE}:{REPOSITORY_IN_CONTAINER}",
                                   str(options.out / "repository")),
        "gpu_name": ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        "gpu_name_in_container": compose(options, "exec", "-T", SERVICE, "nvidia-smi",
                                         "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
        "logs": compose(options, "logs", "--no-color", "--tail", "200"),  # trainers' too: they run first
        "down": compose(options, "down"),
    }


def parse_gpus(csv_text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader`` -> one
    dict per GPU."""
    gpus = []
    for line in csv_text.strip().splitlines():
        name, driver, memory = (part.strip() for part in line.rsplit(",", 2))
        gpus.append({"name": name, "driver": driver, "memory": memory})
    return gpus


def score_served(url: str, dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
    """Every ranker output from a server, [B] each."""
    from clients.triton import RankerClient

    client = RankerClient(url, "http")
    try:
        return {name: np.asarray(value).reshape(-1) for name, value in
                client.score(dense, categorical, all_scores=True).items()}
    finally:
        client.close()


def score_in_process(repository: Path, dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
    """Every ranker output from the CPU in-process pipeline on ``repository``, [B] each."""
    from ensemble.scoring.pipeline import Pipeline

    scores = Pipeline.from_repository(repository).score(dense, categorical)
    return {name: np.asarray(value).reshape(-1) for name, value in scores.items()}


@dataclass(frozen=True)
class Comparison:
    """One output, GPU-served against CPU in-process."""

    output: str
    tolerance: float
    max_abs: float
    p99_abs: float
    auc_gpu: float
    auc_cpu: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance


def compare(gpu: dict[str, np.ndarray], cpu: dict[str, np.ndarray], labels: np.ndarray,
            tolerances: dict[str, float] = TOLERANCES) -> list[Comparison]:
    """Compare every output in ``tolerances``; raises ValueError if one is missing or misshaped."""
    from ensemble.models.metrics import auc
    from loadtest.statistics import percentile

    results = []
    for name, tolerance in tolerances.items():
        if name not in gpu or name not in cpu or gpu[name].shape != cpu[name].shape:
            raise ValueError(f"output '{name}': GPU {getattr(gpu.get(name), 'shape', None)}, "
                             f"CPU {getattr(cpu.get(name), 'shape', None)}")
        diff = np.abs(gpu[name].astype(np.float64) - cpu[name].astype(np.float64))
        results.append(Comparison(name, tolerance, float(diff.max()), float(percentile(diff.ravel(), 0.99)),
                                  auc(labels, gpu[name]), auc(labels, cpu[name])))
    return results


@dataclass
class Report:
    """What the run found (written as report.json and report.md)."""

    release: str = triton_releases.PINNED.image
    gpus: list[dict[str, str]] = field(default_factory=list)
    ready_after_s: float | None = None
    rows: int = 0
    comparisons: list[dict] = field(default_factory=list)
    load_test: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (not self.errors and bool(self.comparisons) and all(c["ok"] for c in self.comparisons)
                and self.load_test.get("failures", 1) == 0)

    def markdown(self) -> str:
        gpu = "; ".join(f"{g['name']} (driver {g['driver']}, {g['memory']})" for g in self.gpus) or "unknown"
        lines = [f"# GPU acceptance: {'PASSED' if self.passed else 'FAILED'}", "",
                 f"- machine: {gpu}", f"- container: {self.release}",
                 f"- ready after: {self.ready_after_s:.0f} s" if self.ready_after_s is not None else "- ready: no",
                 "", f"## GPU-served vs CPU in-process, {self.rows} fresh rows", "",
                 "| output | max abs diff | p99 abs diff | tolerance | AUC GPU | AUC CPU | ok |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c['output']} | {c['max_abs']:.2e} | {c['p99_abs']:.2e} | {c['tolerance']:.0e} | "
                  f"{c['auc_gpu']:.4f} | {c['auc_cpu']:.4f} | {'yes' if c['ok'] else 'NO'} |" for c in self.comparisons]
        if self.load_test:
            lt = self.load_test
            lines += ["", f"## Load test ({lt.get('users')} users, 1 row per request, {lt.get('seconds')} s, "
                          f"locust on the GPU host)", "",
                      "| requests | failures | req/s | p50 ms | p90 ms | p99 ms |", "| --- | --- | --- | --- | --- | --- |",
                      f"| {lt.get('requests', 0):.0f} | {lt.get('failures', 0):.0f} | {lt.get('requests_per_s', 0):.1f} "
                      f"| {lt.get('p50_ms', 0):.1f} | {lt.get('p90_ms', 0):.1f} | {lt.get('p99_ms', 0):.1f} |"]
        lines += ["", *(f"- error: {e}" for e in self.errors)]
        return "\n".join(lines) + "\n"

    def write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({**asdict(self), "passed": self.passed}, indent=1))
        (out / "report.md").write_text(self.markdown())
        return out / "report.md"


def load_test(url: str, data_file: Path, users: int, seconds: float, out: Path) -> dict:
    """A headless locust run with the load-test harness's own command; its aggregated row."""
    from loadtest.runner import Pinning, RunnerOptions, locust_command, read_locust_csv

    prefix = out / "locust"
    cmd = locust_command("triton-http", url, 1, users, seconds, RunnerOptions(), data_file, Pinning(None, None), prefix)
    subprocess.run(cmd, capture_output=True, timeout=seconds + 120, check=False)
    return {"users": users, "seconds": seconds, **read_locust_csv(prefix)}


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def _gpus(options: AcceptanceOptions) -> list[dict[str, str]]:
    for key in ("gpu_name", "gpu_name_in_container"):
        try:
            return parse_gpus(_run(commands(options)[key], capture_output=True, text=True, timeout=60).stdout)
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
    return []


def run(options: AcceptanceOptions) -> Report:
    """The whole acceptance run (see the module docstring); the report is written either way."""
    from ensemble.data import criteo

    report, steps = Report(rows=options.rows), commands(options)
    options.out.mkdir(parents=True, exist_ok=True)
    try:
        _run(steps["up"])
        report.ready_after_s = wait_ready(options.url, None, options.ready_timeout, "the GPU server", poll=2.0)
        report.gpus = _gpus(options)
        shutil.rmtree(options.out / "repository", ignore_errors=True)
        _run(steps["copy_repository"])
        dense, categorical, labels = fresh_rows(options.rows, options.seed, scale=0.1, labels=True)
        gpu = score_served(options.url, dense, categorical)
        cpu = score_in_process(options.out / "repository", dense, categorical)
        report.comparisons = [{**asdict(c), "ok": c.ok} for c in compare(gpu, cpu, labels)]
        frame = criteo.synthesize(criteo.SynthConfig(rows=20_000, scale=0.1, seed=options.seed + 1)).frame
        holdout = criteo.write_criteo(frame, options.out / "holdout.tsv")
        report.load_test = load_test(options.url, holdout, options.users, options.seconds, options.out)
    except Exception as exc:  # noqa: BLE001 - every failure goes into the report, with the server's log
        report.errors.append(f"{type(exc).__name__}: {exc}")
        logs = subprocess.run(steps["logs"], capture_output=True, text=True, check=False)
        (options.out / "compose.log").write_text(logs.stdout + logs.stderr)
    finally:
        if not options.keep:
            subprocess.run(steps["down"], check=False)
    print(report.write(options.out).read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ensemble.cli.acceptance", description=__doc__.splitlines()[0])
    defaults = AcceptanceOptions()
    parser.add_argument("--url", default=defaults.url, help="the GPU server's HTTP address")
    parser.add_argument("--out", default=str(defaults.out), help="report folder")
    parser.add_argument("--rows", type=int, default=defaults.rows, help="fresh rows to compare")
    parser.add_argument("--users", type=int, default=defaults.users, help="load-test users")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="load-test seconds")
    parser.add_argument("--ready-timeout", type=float, default=defaults.ready_timeout,
                        help="seconds to wait for readiness (training runs first)")
    parser.add_argument("--keep", action="store_true", help="leave the services running")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    args = parser.parse_args(argv)
    options = AcceptanceOptions(args.url, Path(args.out), args.rows, users=args.users, seconds=args.seconds,
                                ready_timeout=args.ready_timeout, keep=args.keep, dry_run=args.dry_run)
    if options.dry_run:
        for name, cmd in commands(options).items():
            print(f"{name}: {' '.join(cmd)}")
        return 0
    return 0 if run(options).passed else 1


if __name__ == "__main__":
    sys.exit(main())
