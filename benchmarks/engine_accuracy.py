"""Held-out accuracy of a release's recorded DLRM engines against the frameworks' fp32: each DLRM's test AUC
through its recorded engine (the C pass, or OpenVINO in f32 or bf16) and through the framework (TorchScript,
LiteRT), the largest score difference, and the blend's AUC both ways (the blender weighs the three models'
scores as served).

Not a test: prints a table and writes ``<out>/engine-accuracy.json`` (machine, command, every figure). The
test rows are the last ``--test`` share of the labelled TSV files in row order, as ``ensemble train`` splits
them. ::

    .venv/bin/python -m benchmarks.engine_accuracy --repository model_repository build/data/synthetic.tsv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks import write_results
from ensemble.base.machine import summary


def main(argv=None) -> int:
    from ensemble import schema
    from ensemble.data import criteo
    from ensemble.features import transforms
    from ensemble.models import metrics
    from ensemble.schema import Model
    from ensemble.scoring.pipeline import Pipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="labelled Criteo TSV files, in order")
    parser.add_argument("--repository", required=True)
    parser.add_argument("--test", type=float, default=0.1, help="the held-out share at the end (train's split)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)

    _, _, test = criteo.split(criteo.read_criteo(args.files), test=args.test)
    pipeline = Pipeline.from_repository(args.repository)

    dense, categorical = transforms.dense_array(test), transforms.encode_categorical(test)
    labels = test["label"].to_numpy()
    features = pipeline.steps[Model.FEATURES].run({schema.DENSE.name: dense, schema.CATEGORICAL.name: categorical})
    x, ids = features[schema.DENSE_FEATURES.name], features[schema.CATEGORY_IDS.name]
    xgb = pipeline.steps[Model.XGB].run(features)
    xgb_score = next(iter(xgb.values())).reshape(-1)
    rows, scores = [], {"engine": {}, "framework": {}}
    for model in (Model.DLRM_TORCH, Model.DLRM_TF):
        scorer = pipeline.steps[model].fn  # the step's scorer (TorchScorer, TFScorer): its engine and framework
        served = np.concatenate([scorer(x[s:s + 8192], ids[s:s + 8192]).reshape(-1) for s in range(0, len(x), 8192)])
        framework = np.concatenate([np.asarray(scorer.framework(x[s:s + 8192], ids[s:s + 8192])).reshape(-1)
                                    for s in range(0, len(x), 8192)])
        scores["engine"][model] = served
        scores["framework"][model] = framework
        rows.append({"model": model.value, "engine": scorer.engine, "auc_engine": metrics.auc(labels, served),
                     "auc_framework_fp32": metrics.auc(labels, framework),
                     "max_abs_diff": float(np.abs(served - framework).max())})
    blend = pipeline.steps[Model.BLEND].fn.__self__
    for kind in ("engine", "framework"):
        blended = blend(xgb_score, scores[kind][Model.DLRM_TORCH], scores[kind][Model.DLRM_TF]).reshape(-1)
        rows.append({"model": f"blend ({kind} DLRMs)", "auc": metrics.auc(labels, blended)})
    rows.append({"model": "xgb", "auc": metrics.auc(labels, xgb_score)})
    for row in rows:
        print("  ".join(f"{k}={v:.5f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    write_results(args.out, "engine-accuracy.json", "benchmarks.engine_accuracy", summary(), test_rows=len(labels),
                  repository=str(Path(args.repository)), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
