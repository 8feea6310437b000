"""The DLRMs' forward pass in C (``ensemble/models/_dlrm.c``) built for AVX2 and for AVX-512, on the
exported models' own weights: time a row at each batch size, and whether the two builds give the
same floats.

Not a test: prints a table and writes ``<out>/dlrm-kernels.json`` (machine, command, every point).
The two builds alternate within each repetition (``_dlrm.wide``), so the VM's drifts in speed hit
both alike; pin it to a core with ``--cpu``. On a CPU without AVX-512 only the AVX2 build runs and
the table says so. ``--against`` adds another build of the module, such as one from an older commit,
timed in the same alternation on the same weights against the build this process runs (the wide one
where the CPU has it), and compares its floats too. Usage (after ``make demo``)::

    .venv/bin/python -m benchmarks.kernels --repository model_repository --cpu 1
    # against the module of another commit:
    git worktree add /tmp/before <commit>
    (cd /tmp/before && "$OLDPWD/.venv/bin/python" setup.py build_ext --inplace)
    .venv/bin/python -m benchmarks.kernels --cpu 1 --against /tmp/before/ensemble/models/_dlrm.*.so
"""

from __future__ import annotations

import argparse
import importlib.util
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


def load_build(path: str | Path):
    """Another build of ``ensemble.models._dlrm`` (a shared object, such as one built from an older
    commit), loaded beside this one."""
    spec = importlib.util.spec_from_file_location("against._dlrm", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(models: dict, rows: tuple[int, ...], repetitions: int, budget_rows: int = 100_000, seed: int = 0,
        against=None) -> list[dict]:
    """Per model and batch size: each build's microseconds a row (median over repetitions of a timed
    loop of ~``budget_rows`` rows), and whether their outputs are bit for bit the same. With ``against``
    (another build's module, :func:`load_build`), that build too, on the same weights, and its ratio
    to the build this process runs (per repetition, then the median)."""
    from ensemble.models import _dlrm
    from ensemble.models.dlrm_kernel import cardinalities

    builds: list = [False, True] if _dlrm.wide(True) else [False]
    ours = builds[-1]
    if against is not None:
        builds.append("against")
    rng = np.random.default_rng(seed)
    results = []
    try:
        for name, weights in models.items():
            other = None if against is None else against.Weights(weights.bottom, weights.table, weights.offsets,
                                                                   weights.pair_i, weights.pair_j, weights.top)
            for n in rows:
                dense = rng.normal(size=(n, weights.bottom[0][0].shape[0])).astype(np.float32)
                ids = np.stack([rng.integers(0, max(int(c), 1), n) for c in cardinalities(weights)], axis=1)
                ids = ids.astype(np.int64)
                loops = max(5, budget_rows // n)
                times: dict = {build: [] for build in builds}
                outs = {build: np.empty(n, np.float32) for build in builds}
                for repetition in range(repetitions):
                    for build in builds if repetition % 2 == 0 else builds[::-1]:
                        if build == "against":
                            call = other
                        else:
                            _dlrm.wide(build)
                            call = weights.into
                        call(dense, ids, outs[build])  # warm
                        started = time.perf_counter()
                        for _ in range(loops):
                            call(dense, ids, outs[build])
                        times[build].append((time.perf_counter() - started) / loops / n * 1e6)
                point = {"model": name, "rows": n, "avx2_us_per_row": statistics.median(times[False])}
                if True in times:
                    point["avx512_us_per_row"] = statistics.median(times[True])
                    point["speedup"] = point["avx2_us_per_row"] / point["avx512_us_per_row"]
                    point["same_floats"] = bool(np.array_equal(outs[True].view(np.int32), outs[False].view(np.int32)))
                if other is not None:
                    point["against_us_per_row"] = statistics.median(times["against"])
                    point["against_over_this"] = statistics.median(
                        a / b for a, b in zip(times["against"], times[ours]))
                    point["against_same_floats"] = bool(np.array_equal(outs["against"].view(np.int32),
                                                                       outs[ours].view(np.int32)))
                results.append(point)
    finally:
        _dlrm.wide(True)
    return results


def table(results: list[dict]) -> str:
    against = any("against_us_per_row" in r for r in results)
    lines = ["| model | rows a call | AVX2 us/row | AVX-512 us/row | speedup | same floats |"
             + (" --against us/row | its time over this build's | same floats |" if against else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if against else "")]
    for r in results:
        wide = (f"{r['avx512_us_per_row']:.3f} | {r['speedup']:.2f}x | {'yes' if r['same_floats'] else 'NO'}"
                if "speedup" in r else "not on this CPU | | ")
        other = (f" {r['against_us_per_row']:.3f} | {r['against_over_this']:.2f}x | "
                 f"{'yes' if r['against_same_floats'] else 'NO'} |" if against else "")
        lines.append(f"| {r['model']} | {r['rows']} | {r['avx2_us_per_row']:.3f} | {wide} |{other}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="model_repository", help="an exported model repository")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100, 1400])
    p.add_argument("--repetitions", type=int, default=9)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    p.add_argument("--out", default="build/bench", help="folder of dlrm-kernels.json")
    p.add_argument("--against", default=None, metavar="SO",
                   help="another build of ensemble.models._dlrm (its shared object) to time alongside")
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    machine = summary()
    against = None if args.against is None else load_build(args.against)
    results = run(kernels(Path(args.repository)), tuple(args.rows), args.repetitions, against=against)
    print(table(results))
    write_results(args.out, "dlrm-kernels.json", "benchmarks.kernels", machine, against=args.against, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
