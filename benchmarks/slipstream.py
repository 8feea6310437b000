"""Slipstream benchmark: plain DLRM training vs Slipstream on the same data, in one run.

Synthetic Zipf data at full Criteo cardinality (``--scale 1.0``) goes through the project's own
out-of-core features (``ensemble train``'s path: raw parts -> NVTabular -> tensor shards); then
the PyTorch DLRM trains from the same shards, plainly (``dlrm_torch.train``) and with Slipstream
(``slipstream.train``), once per seed, the two methods alternating so that machine noise hits
both alike. A seed changes the initialisation and the batch order, so the spread of plain
training over seeds is the yardstick for an AUC difference.

Prints a table and writes ``OUT.md`` and ``OUT.json`` (``--out``, default ``docs/results/slipstream``)::

    python -m benchmarks.slipstream --rows 4000000 --seeds 2 --epochs 2 --out docs/results/slipstream-4m-rows-2-epochs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ensemble.base import machine
from ensemble.models.slipstream import StaleTracker

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("plain", "slipstream", "random")


class RandomSkip(StaleTracker):
    """The control: once the first window has closed, skip each input with probability D, whatever
    its embeddings (same warm-up, windows and batch packing as Slipstream). Equal AUC to
    Slipstream's at an equal skipped share would mean the choice of inputs does not matter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rng = np.random.default_rng(0)

    def skip(self, ids: np.ndarray) -> np.ndarray:
        if not self.active:
            return np.zeros(len(ids), bool)
        return self._rng.random(len(ids)) < self.config.drop_share


@dataclass
class Result:
    """One training run; ``rows_per_s``: input rows consumed (skipped ones included) per second."""

    method: str
    seed: int
    seconds: float
    rows_per_s: float
    steps: int
    skipped_share: float
    test_auc: float
    test_logloss: float
    detail: dict


def prepare(rows: int, scale: float, workdir: Path, log=print):
    """Synthesize (once per rows/scale) and build the shards; returns (train, valid, test) ShardSets
    and the cardinalities. Reuses what an earlier run with the same rows and scale left."""
    from ensemble.data import criteo
    from ensemble.data.shards import ShardSet
    from ensemble.features import out_of_core, transforms

    marker = workdir / "prepared.json"
    wanted = {"rows": rows, "scale": scale}
    split_dirs = [workdir / "shards" / s.value for s in out_of_core.Split]
    if not (marker.is_file() and wanted.items() <= json.loads(marker.read_text()).items()):
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        tsv = workdir / "synthetic.tsv"
        summary = criteo.write_synthetic(criteo.SynthConfig(rows=rows, scale=scale, seed=0), tsv)
        log(f"synthesized {summary.rows} rows in {time.perf_counter() - start:.0f}s "
            f"(generator's best AUC {summary.best_auc:.4f})")
        start = time.perf_counter()
        out_of_core.build_shards([tsv], workdir, workdir / "workflow")
        tsv.unlink()
        log(f"features and shards in {time.perf_counter() - start:.0f}s")
        marker.write_text(json.dumps(wanted | {"best_auc": summary.best_auc}))
    cards = transforms.LeanTransform.load(workdir / "workflow").cardinalities
    return tuple(ShardSet.load(d) for d in split_dirs), cards, json.loads(marker.read_text())


def run_one(method: str, seed: int, config, slip, sets, log=print) -> Result:
    from ensemble.models import dlrm_torch, metrics, slipstream
    from ensemble.models.dlrm import score_source

    train, valid, test = sets
    config = replace(config, seed=seed)
    source = train.source(config.batch_size, seed)
    start = time.perf_counter()
    if method == "plain":
        model, detail = dlrm_torch.train(config, source, valid.source(65536, shuffle=False), log=log), {}
        steps = config.epochs * -(-train.rows // config.batch_size)
        skipped = 0.0
    else:
        model, stats = slipstream.train(config, slip, source, valid.source(65536, shuffle=False), log=log,
                                        tracker_class=RandomSkip if method == "random" else None)
        detail = asdict(stats)
        steps, skipped = sum(stats.steps_per_epoch), stats.skipped_share
    seconds = time.perf_counter() - start
    scores, labels = score_source(lambda d, i: dlrm_torch.predict(model, d, i), test.source(65536, shuffle=False))
    result = Result(method, seed, seconds, config.epochs * train.rows / seconds, steps, skipped,
                    metrics.auc(labels, scores), metrics.log_loss(labels, scores), detail)
    log(f"{method} seed {seed}: {seconds:.1f}s, {result.rows_per_s:,.0f} rows/s, {steps} steps, "
        f"skipped {skipped:.1%}, test AUC {result.test_auc:.4f}")
    return result


def summarize(results: list[Result]) -> dict:
    by = {m: [r for r in results if r.method == m] for m in METHODS if any(r.method == m for r in results)}
    med = {m: statistics.median(r.seconds for r in rs) for m, rs in by.items()}
    auc = {m: statistics.mean(r.test_auc for r in rs) for m, rs in by.items()}
    plain_aucs = [r.test_auc for r in by["plain"]]
    speedup = {m: med["plain"] / med[m] for m in by}
    auc_gap = {m: auc["plain"] - auc[m] for m in by}
    return {"median_seconds": med, "mean_test_auc": auc, "speedup": speedup, "auc_gap": auc_gap,
            "plain_auc_spread": max(plain_aucs) - min(plain_aucs),
            "skipped_share": {m: statistics.mean(r.skipped_share for r in rs) for m, rs in by.items()},
            "target_met": speedup["slipstream"] >= 1.3 and auc_gap["slipstream"] <= 0.002}


def markdown(report: dict) -> str:
    s, a = report["summary"], report["args"]
    lines = [f"# Slipstream benchmark ({a['rows']:,} rows, scale {a['scale']}, {a['epochs']} epoch(s))", "",
             f"Machine: {report['machine']}; load average before the run {report['load_before']} "
             f"(a shared VM: other jobs may have run; compare within this run, medians over seeds).", "",
             f"Data: synthetic Zipf Criteo at full cardinality, {report['rows']['train']:,} train / "
             f"{report['rows']['valid']:,} valid / {report['rows']['test']:,} test rows; "
             f"table rows after Categorify: {report['table_rows']:,}. "
             f"Slipstream: {report['slipstream']}.", "",
             "| method | seed | train s | rows/s | steps | skipped | test AUC | test logloss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['method']} | {r['seed']} | {r['seconds']:.1f} | {r['rows_per_s']:,.0f} | {r['steps']} | "
                     f"{r['skipped_share']:.1%} | {r['test_auc']:.4f} | {r['test_logloss']:.4f} |")
    lines += ["", "| method | median train s | speedup | mean test AUC | AUC below plain | skipped |",
              "|---|---|---|---|---|---|"]
    for m in s["median_seconds"]:
        lines.append(f"| {m} | {s['median_seconds'][m]:.1f} | {s['speedup'][m]:.2f}x | {s['mean_test_auc'][m]:.4f} | "
                     f"{s['auc_gap'][m]:+.4f} | {s['skipped_share'][m]:.1%} |")
    lines += ["", f"Plain training's AUC spread over seeds: {s['plain_auc_spread']:.4f}. Target (Slipstream >= 1.3x "
              f"faster, AUC within 0.002 of plain): **{'met' if s['target_met'] else 'not met'}**.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.slipstream import SlipstreamConfig

    defaults = SlipstreamConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000, help="synthetic rows (80%% train, 10%% valid, 10%% test)")
    p.add_argument("--scale", type=float, default=1.0, help="cardinality as a share of Criteo's")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seeds", type=int, default=2, help="runs per method (seed 0, 1, ...)")
    p.add_argument("--no-control", action="store_true", help="leave out the random-skip control")
    p.add_argument("--hot-share", type=float, default=defaults.hot_share)
    p.add_argument("--drop-share", type=float, default=defaults.drop_share)
    p.add_argument("--alpha", type=float, default=defaults.alpha)
    p.add_argument("--window", type=int, default=defaults.window)
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    p.add_argument("--workdir", default="/tmp/slipstream-benchmark", help="data and shards (reused when present)")
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "slipstream"), help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)

    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    sets, cards, data = prepare(args.rows, args.scale, Path(args.workdir))
    config = DLRMConfig(epochs=args.epochs, cardinalities=cards)
    slip = SlipstreamConfig(hot_share=args.hot_share, drop_share=args.drop_share, alpha=args.alpha,
                            window=args.window, warmup_steps=args.warmup_steps)
    results = []
    for seed in range(args.seeds):
        methods = METHODS[:2] if args.no_control else METHODS
        order = methods if seed % 2 == 0 else methods[::-1]  # alternate, so drifting load hits all alike
        results += [run_one(method, seed, config, slip, sets) for method in order]
    report = {"machine": machine.summary(), "load_before": load_before,
              "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
              "args": vars(args), "data": data, "table_rows": sum(cards),
              "rows": {"train": sets[0].rows, "valid": sets[1].rows, "test": sets[2].rows},
              "dlrm": asdict(replace(config, cardinalities=())), "slipstream": asdict(slip),
              "results": [asdict(r) for r in results], "summary": summarize(results)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
