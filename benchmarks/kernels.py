"""The DLRMs' forward pass in C (``ensemble/models/_dlrm.c``) built for AVX2 and for AVX-512, on the
exported models' own weights: time a row at each batch size, and whether the two builds give the
same floats.

Not a test: prints a table and writes ``<out>/dlrm-kernels.json`` (machine, command, every point).
The two builds alternate within each repetition (``_dlrm.wide``), so the VM's drifts in speed hit
both alike; pin it to a core with ``--cpu``. On a CPU without AVX-512 only the AVX2 build runs and
the table says so. Usage (after ``make demo``)::

    .venv/bin/python -m benchmarks.kernels --repository model_repository --cpu 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import write_results
from ensemble.machine import summary


def kernels(repository: Path) -> dict:
    """Each DLRM's C forward pass in the repository's newest release (the weights its scorer checked
    at load)."""
    from ensemble.models import dlrm_tf, dlrm_torch
    from ensemble.schema import Model
    from ensemble.serving.runtime import release_versions

    versions = release_versions(repository)
    found = {"dlrm_torch": dlrm_torch.TorchScorer(versions[Model.DLRM_TORCH]).kernel,
             "dlrm_tf": dlrm_tf.TFScorer(versions[Model.DLRM_TF]).kernel}
    missing = [name for name, kernel in found.items() if kernel is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)}: no C forward pass on this machine (not built, or no AVX2+FMA)")
    return found


def run(models: dict, rows: tuple[int, ...], repetitions: int, budget_rows: int = 100_000, seed: int = 0) -> list[dict]:
    """Per model and batch size: each build's microseconds a row (median over repetitions of a timed
    loop of ~``budget_rows`` rows), and whether their outputs are bit for bit the same."""
    from ensemble.models import _dlrm
    from ensemble.models.dlrm_kernel import cardinalities

    builds = [False, True] if _dlrm.wide(True) else [False]
    rng = np.random.default_rng(seed)
    results = []
    try:
        for name, weights in models.items():
            for n in rows:
                dense = rng.normal(size=(n, weights.bottom[0][0].shape[0])).astype(np.float32)
                ids = np.stack([rng.integers(0, max(int(c), 1), n) for c in cardinalities(weights)], axis=1)
                ids = ids.astype(np.int64)
                loops = max(5, budget_rows // n)
                times: dict[bool, list[float]] = {wide: [] for wide in builds}
                outs = {wide: np.empty(n, np.float32) for wide in builds}
                for _ in range(repetitions):
                    for wide in builds:
                        _dlrm.wide(wide)
                        weights.into(dense, ids, outs[wide])  # warm
                        started = time.perf_counter()
                        for _ in range(loops):
                            weights.into(dense, ids, outs[wide])
                        times[wide].append((time.perf_counter() - started) / loops / n * 1e6)
                point = {"model": name, "rows": n, "avx2_us_per_row": statistics.median(times[False])}
                if True in times:
                    point["avx512_us_per_row"] = statistics.median(times[True])
                    point["speedup"] = point["avx2_us_per_row"] / point["avx512_us_per_row"]
                    point["same_floats"] = bool(np.array_equal(outs[True].view(np.int32), outs[False].view(np.int32)))
                results.append(point)
    finally:
        _dlrm.wide(True)
    return results


def table(results: list[dict]) -> str:
    lines = ["| model | rows a call | AVX2 us/row | AVX-512 us/row | speedup | same floats |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        wide = (f"{r['avx512_us_per_row']:.3f} | {r['speedup']:.2f}x | {'yes' if r['same_floats'] else 'NO'}"
                if "speedup" in r else "not on this CPU | | ")
        lines.append(f"| {r['model']} | {r['rows']} | {r['avx2_us_per_row']:.3f} | {wide} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="model_repository", help="an exported model repository")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100, 1400])
    p.add_argument("--repetitions", type=int, default=9)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    p.add_argument("--out", default="build/bench", help="folder of dlrm-kernels.json")
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    machine = summary()
    results = run(kernels(Path(args.repository)), tuple(args.rows), args.repetitions)
    print(table(results))
    write_results(args.out, "dlrm-kernels.json", "benchmarks.kernels", machine, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
