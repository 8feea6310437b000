"""Commands that make a release: `synth`, `train`, `export`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ensemble.models.slipstream import SlipstreamConfig

# `ensemble.data.criteo` imports pandas (~0.4 s): imported inside the commands that use it, so that
# `--help` and argument errors answer at once.


from ensemble.cli.common import _command, _synth_config, _add_synth, _widths, dataset_shapes

def _train_config(args):
    from ensemble.runs import training
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.xgb import XGBConfig
    from ensemble.base.device import resolve_device
    from ensemble.models.xgb import XGBMatrix
    from ensemble.runs.training import TrainConfig

    from ensemble import dataset
    from ensemble.base import model_size as sizes

    extra = {"xgb_matrix": XGBMatrix(args.xgb_matrix)} if getattr(args, "xgb_matrix", None) else {}
    spec = dataset.load_spec(getattr(args, "dataset", None) or dataset.DEFAULT)
    size = sizes.resolve(args.model_size, dict(spec.model), {
        "embedding_dim": args.embedding_dim, "bottom_mlp": args.bottom_mlp, "top_mlp": args.top_mlp,
        "xgb_rounds": args.xgb_rounds, "xgb_depth": args.xgb_depth})
    spec = dataset.with_table_shape(spec, getattr(args, "table_shape", None))
    row_store = {"auto": None, "on": True, "off": False}[getattr(args, "row_store", "auto") or "auto"]
    return training.TrainConfig(
        spec=spec, row_store=row_store, table_budget_gib=getattr(args, "table_budget_gib", 8.0),
        init_from=Path(args.init_from) if getattr(args, "init_from", None) else None,
        freq_threshold=args.freq_threshold,
        xgb=XGBConfig(rounds=size.xgb_rounds, max_depth=size.xgb_depth),
        dlrm=DLRMConfig(epochs=args.epochs or DLRMConfig().epochs, embedding_dim=size.embedding_dim,
                        bottom_mlp=size.bottom_mlp, top_mlp=size.top_mlp),
        device=resolve_device(args.device),
        # Stages (the GPU deployment trains torch and TensorFlow models in separate images).
        models=tuple(args.models.split(",")) if getattr(args, "models", None) else TrainConfig().models,
        reuse_features=getattr(args, "reuse_features", False),
        slipstream=_slipstream_config(args),
        **extra,
    )

def _slipstream_config(args) -> SlipstreamConfig | None:
    """`--slipstream` and its settings (only the train command has them)."""
    if not getattr(args, "slipstream", False):
        return None
    return SlipstreamConfig(hot_share=args.slip_hot_share, drop_share=args.slip_drop_share, alpha=args.slip_alpha,
                            window=args.slip_window, warmup_steps=args.slip_warmup_steps)

def _add_slipstream(p: argparse.ArgumentParser) -> None:
    defaults = SlipstreamConfig()
    p.add_argument("--slipstream", action="store_true",
                   help="train dlrm_torch with Slipstream: skip inputs whose hot embeddings went stale "
                        "(docs/training.md; dlrm_tf trains as usual)")
    p.add_argument("--slip-hot-share", type=float, default=defaults.hot_share,
                   help="Λ: a table row is hot when this share of training inputs looks it up")
    p.add_argument("--slip-drop-share", type=float, default=defaults.drop_share,
                   help="D: target share of inputs skipped once skipping starts")
    p.add_argument("--slip-alpha", type=float, default=defaults.alpha,
                   help="α: skip an input when this share of its 26 lookups are stale")
    p.add_argument("--slip-window", type=int, default=defaults.window,
                   help="optimizer steps between embedding snapshots (staleness = change over one window)")
    p.add_argument("--slip-warmup-steps", type=int, default=defaults.warmup_steps,
                   help="steps trained on every input before the first snapshot")

def cmd_synth(args) -> int:
    from ensemble.data import criteo

    summary = criteo.write_synthetic(_synth_config(args), args.output)
    print(f"wrote {summary.rows} rows to {summary.path}; click rate {summary.click_rate:.3f}; "
          f"best possible AUC (the generator's own probabilities) {summary.best_auc:.4f}")
    return 0

def cmd_train(args) -> int:
    from ensemble.runs import training
    from ensemble.models.distributed import dask_client

    if args.dask_scheduler and args.dask_local:
        print("error: give --dask-scheduler or --dask-local, not both", file=sys.stderr)
        return 2
    if args.slipstream and (args.dask_scheduler or args.dask_local):
        print("error: --slipstream trains in one process; it does not combine with a Dask cluster", file=sys.stderr)
        return 2
    from dataclasses import replace

    from ensemble import dataset

    spec = dataset.load_spec(args.dataset)
    if spec.name != dataset.DEFAULT:  # a dataset of its own: files with a header, in memory
        if args.dask_scheduler or args.dask_local or args.slipstream:
            print(f"error: {spec.name}: --dask-* and --slipstream train Criteo files only", file=sys.stderr)
            return 2
        from ensemble.data import tables

        frame = tables.read_table(args.input, spec, nrows=args.nrows)
        train, valid, test = tables.split(frame, args.valid_fraction, args.test_fraction, time=spec.time)
        report = training.train_all(train, valid, test, args.workdir, replace(_train_config(args), spec=spec))
        print(json.dumps(report.get("test", report), indent=1))
        return 0
    with dask_client(args.dask_scheduler, args.dask_local) as client:
        report = training.train_files(args.input, args.workdir, _train_config(args), nrows=args.nrows,
                                      valid=args.valid_fraction, test=args.test_fraction, client=client)
    print(json.dumps(report.get("test", report), indent=1))
    return 0

def cmd_export(args) -> int:
    from ensemble.operate.records import loaded_versions
    from ensemble.repository.export import TrainedArtifacts, export_repository

    workdir = Path(args.workdir)
    written = export_repository(TrainedArtifacts.under(workdir), args.repository, keep=args.keep,
                                loaded=loaded_versions(args.repository), log=print)
    for model, folder in written.items():
        print(f"{model.value:<11} {folder}")
    return 0

def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="build", help="training artifacts and reports")
    p.add_argument("--freq-threshold", type=int, default=None,
                   help="Categorify frequency threshold for every categorical column (default: the dataset spec's; Criteo 3)")
    p.add_argument("--model-size", choices=["demo", "seed"], default=None,
                   help="demo: 16-wide embeddings, 64-32 / 128-64 MLPs, up to 400 trees of depth 8; seed: the DLRM "
                        "reference's Criteo size (128, 512-256-128 / 1024-1024-512-256-1) and up to 1,000 trees "
                        "(default: the dataset spec's [model] size, else demo; the options below change it)")
    p.add_argument("--xgb-rounds", type=int, default=None, help="most boosting rounds (early stopping)")
    p.add_argument("--xgb-depth", type=int, default=None, help="the trees' maximum depth")
    p.add_argument("--epochs", type=int, default=None,
                   help="most DLRM epochs; the best on validation is kept (default 2; the movielens100k demo: 4)")
    p.add_argument("--embedding-dim", type=int, default=None, help="DLRM embedding width (the bottom MLP's output)")
    p.add_argument("--bottom-mlp", type=_widths, default=None, metavar="W,W,...",
                   help="the DLRMs' bottom MLP hidden widths, e.g. 512,256")
    p.add_argument("--top-mlp", type=_widths, default=None, metavar="W,W,...",
                   help="the DLRMs' top MLP hidden widths, e.g. 1024,1024,512,256")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="cpu",
                   help="gpu: mixed precision and GPU trees (written for GPUs, not run on this project's machines)")
    p.add_argument("--table-shape", choices=sorted(dataset_shapes()), default=None,
                   help="hash every categorical column into a built-in shape's rows: criteo-1tb is the DLRM seed's "
                        "Criteo Terabyte model (ids capped at 40M: 204,184,588 rows per DLRM)")
    p.add_argument("--row-store", choices=["auto", "on", "off"], default="auto",
                   help="keep the DLRMs' tables out of memory (docs/tables.md): a step "
                        "reads and updates its batch's rows only, the export writes every row to disk; auto: when "
                        "a table has 1,000,000 rows or more")
    p.add_argument("--table-budget-gib", type=float, default=8.0, metavar="GIB",
                   help="with a row store: memory the rows training touched may take, then a file of the work folder")
    p.add_argument("--init-from", default=None, metavar="REPOSITORY",
                   help="with a row store: the rows a step touches first start from this repository's serving "
                        "release (declared, else newest) instead of their initialization; its next export shares "
                        "the unchanged table files with that release")


def add_commands(sub) -> None:
    """This group's subcommands, in the order `ensemble --help` lists them."""

    p = _command(sub, "synth", "write a synthetic Criteo-format TSV")
    _add_synth(p, 300_000)
    p.add_argument("--output", default="build/data/synthetic.tsv", help=".gz suffix compresses")
    p.set_defaults(func=cmd_synth)

    p = _command(sub, "train", "fit features and train xgb, dlrm_torch, dlrm_tf and the blend")
    p.add_argument("input", nargs="+",
                   help="Criteo TSV day files (.gz too), in time order; with --dataset: CSV/TSV files with a header "
                        "row, or Parquet")
    p.add_argument("--dataset", default="criteo",
                   help="the data's spec: a built-in name (criteo, movielens100k) or a spec file (docs/your-data.md)")
    p.add_argument("--nrows", type=int, default=None, help="read at most this many rows (all when unset)")
    p.add_argument("--valid-fraction", type=float, default=0.1,
                   help="share of rows for validation (file order, or the spec's time column's)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of rows held out for test (the last)")
    _add_train(p)
    p.add_argument("--models", default=None,
                   help="train only these (comma-separated: xgb,dlrm_torch,dlrm_tf); the blend is fitted once all "
                        "three have scores in --workdir")
    p.add_argument("--reuse-features", action="store_true",
                   help="reuse the workflow an earlier stage fitted in --workdir instead of fitting it again")
    p.add_argument("--xgb-matrix", choices=["quantile", "external"], default="quantile",
                   help="trees' training rows: quantile = bin indexes in memory (~40 B a row); external = "
                        "pages cached on disk (memory flat in rows, slower)")
    p.add_argument("--dask-scheduler", default=None, help="address of a running Dask scheduler to train on")
    p.add_argument("--dask-local", type=int, default=0, help="start a LocalCluster with N worker processes to train on")
    _add_slipstream(p)
    p.set_defaults(func=cmd_train)

    p = _command(sub, "export", "write a new version of every model into the repository")
    p.add_argument("--workdir", default="build", help="where `train` left the artifacts")
    p.add_argument("--repository", default="model_repository", help="the Triton model repository to write")
    p.add_argument("--keep", type=int, default=2,
                   help="versions to keep per model (2 keeps one to roll back to); the declared release, the versions "
                        "its declaration lists, an experiment's candidates, what a running server on the repository "
                        "has loaded, and their steps are kept as well (each named)")
    p.set_defaults(func=cmd_export)
