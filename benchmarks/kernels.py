"""The models' C kernels on the exported release: both DLRMs' forward pass (``ensemble/native/_dlrm.c``)
and the trees (``ensemble/native/_trees.c``), each in its narrow build and, where the CPU has AVX-512,
its wide one: time a row at each batch size, and whether the two builds give the same floats.

The narrow build is the DLRMs' AVX2 build and the trees' 8-lane walk; the wide build is each module's
AVX-512 path (``wide()``). Not a test: prints a table and writes ``<out>/kernels.json`` (machine,
command, every point). The two builds alternate within each repetition, so the VM's drifts in speed
hit both alike; pin it to a core with ``--cpu``. On a CPU without AVX-512 only the narrow build runs
and the table says so. ``--against`` adds other builds of the modules, such as ones from an older
commit (a ``_dlrm`` and/or a ``_trees`` shared object), each timed in the same alternation on the same
weights and rows against the build this process runs (the wide one where the CPU has it), its floats
compared too. Usage (after ``make demo``)::

    .venv/bin/python -m benchmarks.kernels --repository model_repository --cpu 1
    # against the modules of another commit:
    git worktree add /tmp/before <commit>
    (cd /tmp/before && "$OLDPWD/.venv/bin/python" setup.py build_ext --inplace)
    .venv/bin/python -m benchmarks.kernels --cpu 1 --against /tmp/before/ensemble/models/_{dlrm,trees}.*.so
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
from ensemble.base.machine import summary

MODULES = ("_dlrm", "_trees")


def kernels(repository: Path) -> dict:
    """The C kernels of the repository's newest release: each DLRM's forward pass (the weights its
    scorer checked at load) and the trees as arrays."""
    from ensemble.models import dlrm_tf, dlrm_torch, xgb
    from ensemble.schema import Model
    from ensemble.scoring.pipeline import release_versions

    versions = release_versions(repository)
    found = {"dlrm_torch": dlrm_torch.TorchScorer(versions[Model.DLRM_TORCH]).kernel,
             "dlrm_tf": dlrm_tf.TFScorer(versions[Model.DLRM_TF]).kernel,
             "xgb": xgb.TreeScorer(versions[Model.XGB]).kernel}
    missing = [name for name, kernel in found.items() if kernel is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)}: no C kernel on this machine (not built, or no AVX2+FMA)")
    return found


def load_build(path: str | Path):
    """Another build of ``ensemble.native._dlrm`` or ``_trees`` (a shared object named as the build
    names it, such as one built from an older commit), loaded beside this one."""
    module = next((m for m in MODULES if Path(path).name.startswith(m + ".")), None)
    spec = importlib.util.spec_from_file_location(f"against.{module}", path) if module else None
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a build of {' or '.join(MODULES)}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _calls(kernel, against: dict):
    """(the module whose ``wide()`` picks the build, ``inputs(n, rng)`` -> (this build's call, the
    other build's call or None), each call writing n floats into its argument). Both builds are
    called the same way, straight into the module, so neither pays a Python wrapper the other does not."""
    from ensemble.native import _dlrm, _trees

    if hasattr(kernel, "node_column"):  # the trees as arrays
        other = against.get("_trees")

        def tree_inputs(n, rng):
            x = (rng.normal(size=(n, kernel.n_features)) * 3).astype(np.float32)
            x[rng.random(x.shape) < 0.1] = np.nan

            def call(module):
                return lambda out: module.predict(x, kernel.n_features, kernel.node_column, kernel.node_threshold,
                                                  kernel.leaves, kernel.depth, kernel.base_margin, out)

            return call(_trees), None if other is None else call(other)

        return _trees, tree_inputs

    from ensemble.models.dlrm_kernel import cardinalities

    other = against.get("_dlrm")
    other = None if other is None else other.Weights(kernel.bottom, kernel.table, kernel.offsets, kernel.pair_i,
                                                     kernel.pair_j, kernel.top)

    def dlrm_inputs(n, rng):
        dense = rng.normal(size=(n, kernel.bottom[0][0].shape[0])).astype(np.float32)
        ids = np.stack([rng.integers(0, max(int(c), 1), n) for c in cardinalities(kernel)], axis=1).astype(np.int64)

        def call(weights):
            return lambda out: weights(dense, ids, out)

        return call(kernel.native), None if other is None else call(other)

    return _dlrm, dlrm_inputs


def run(models: dict, rows: tuple[int, ...], repetitions: int, budget_rows: int = 100_000, seed: int = 0,
        against: list | None = None) -> list[dict]:
    """Per model and batch size: each build's microseconds a row (median over repetitions of a timed
    loop of ~``budget_rows`` rows), and whether their outputs are bit for bit the same. With ``against``
    (other builds' modules, :func:`load_build`), the one of the model's module too, on the same weights
    and rows, and its ratio to the build this process runs (per repetition, then the median)."""
    others = {m.__name__.rsplit(".", 1)[-1]: m for m in against or ()}
    if len(others) < len(against or ()):
        raise SystemExit("--against: one build of each module at most")
    rng = np.random.default_rng(seed)
    results = []
    for name, kernel in models.items():
        module, inputs = _calls(kernel, others)
        builds: list = [False, True] if module.wide(True) else [False]
        ours = builds[-1]
        try:
            for n in rows:
                call, theirs = inputs(n, rng)
                timed = builds + (["against"] if theirs is not None else [])
                loops = max(5, budget_rows // n)
                times: dict = {build: [] for build in timed}
                outs = {build: np.empty(n, np.float32) for build in timed}
                for repetition in range(repetitions):
                    for build in timed if repetition % 2 == 0 else timed[::-1]:
                        if build == "against":
                            f = theirs
                        else:
                            module.wide(build)
                            f = call
                        f(outs[build])  # warm
                        started = time.perf_counter()
                        for _ in range(loops):
                            f(outs[build])
                        times[build].append((time.perf_counter() - started) / loops / n * 1e6)
                point = {"model": name, "rows": n, "narrow_us_per_row": statistics.median(times[False])}
                if True in times:
                    point["wide_us_per_row"] = statistics.median(times[True])
                    point["speedup"] = point["narrow_us_per_row"] / point["wide_us_per_row"]
                    point["same_floats"] = bool(np.array_equal(outs[True].view(np.int32), outs[False].view(np.int32)))
                if theirs is not None:
                    point["against_us_per_row"] = statistics.median(times["against"])
                    point["against_over_this"] = statistics.median(
                        a / b for a, b in zip(times["against"], times[ours]))
                    point["against_same_floats"] = bool(np.array_equal(outs["against"].view(np.int32),
                                                                       outs[ours].view(np.int32)))
                results.append(point)
        finally:
            module.wide(True)
    return results


def table(results: list[dict]) -> str:
    against = any("against_us_per_row" in r for r in results)
    lines = ["| model | rows a call | narrow us/row | AVX-512 us/row | speedup | same floats |"
             + (" --against us/row | its time over this build's | same floats |" if against else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if against else "")]
    for r in results:
        wide = (f"{r['wide_us_per_row']:.3f} | {r['speedup']:.2f}x | {'yes' if r['same_floats'] else 'NO'}"
                if "speedup" in r else "not on this CPU | | ")
        other = ""
        if "against_us_per_row" in r:
            other = (f" {r['against_us_per_row']:.3f} | {r['against_over_this']:.2f}x | "
                     f"{'yes' if r['against_same_floats'] else 'NO'} |")
        elif against:
            other = " | | |"
        lines.append(f"| {r['model']} | {r['rows']} | {r['narrow_us_per_row']:.3f} | {wide} |{other}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default="model_repository", help="an exported model repository")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 100, 1400])
    p.add_argument("--repetitions", type=int, default=9)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    p.add_argument("--out", default="build/bench", help="folder of kernels.json")
    p.add_argument("--against", nargs="+", default=None, metavar="SO",
                   help="other builds of ensemble.native._dlrm and/or _trees (their shared objects) to time alongside")
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    machine = summary()
    against = [load_build(path) for path in args.against or ()]
    results = run(kernels(Path(args.repository)), tuple(args.rows), args.repetitions, against=against)
    print(table(results))
    write_results(args.out, "kernels.json", "benchmarks.kernels", machine, against=args.against, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
