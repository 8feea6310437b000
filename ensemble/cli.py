"""`ensemble` command line: subcommands in pipeline order, each a thin wrapper."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from ensemble import data, schema


def _synth_config(args) -> data.SynthConfig:
    return data.SynthConfig(rows=args.rows, scale=args.scale, seed=args.seed)


def _train_config(args):
    from ensemble import training
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.xgb import XGBConfig

    return training.TrainConfig(
        freq_threshold=args.freq_threshold,
        xgb=XGBConfig(rounds=args.xgb_rounds),
        dlrm=DLRMConfig(epochs=args.epochs, embedding_dim=args.embedding_dim),
        device=training.resolve_device(args.device),
    )


def _server_options(args):
    from ensemble.serve import ServerOptions

    return ServerOptions(Path(args.repository), host=args.host, http_port=args.http_port,
                         grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                         model_config_name=args.model_config_name,
                         log_file=Path(args.log_file) if args.log_file else None)


def cmd_synth(args) -> int:
    synth = data.synthesize(_synth_config(args))
    from ensemble.metrics import auc

    path = data.write_criteo(synth.frame, args.output)
    print(f"wrote {len(synth.frame)} rows to {path}; click rate {synth.frame[schema.LABEL].mean():.3f}; "
          f"best possible AUC (the generator's own probabilities) {auc(synth.frame[schema.LABEL], synth.probability):.4f}")
    return 0


def cmd_train(args) -> int:
    from ensemble import training

    frame = data.read_criteo(args.input, nrows=args.nrows)
    train, valid, test = data.split(frame, args.valid_fraction, args.test_fraction)
    report = training.train_all(train, valid, test, args.workdir, _train_config(args))
    print(json.dumps(report["test"], indent=1))
    return 0


def cmd_export(args) -> int:
    from ensemble.export import TrainedArtifacts, export_repository

    workdir = Path(args.workdir)
    written = export_repository(TrainedArtifacts(workdir / "workflow", workdir / "models"),
                                args.repository, keep=args.keep)
    for model, folder in written.items():
        print(f"{model.value:<11} {folder}")
    return 0


def cmd_serve(args) -> int:
    from ensemble.serve import ServerError, TritonServer

    server = TritonServer(_server_options(args))
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    try:
        server.start()
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready: HTTP http://{server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}")
    print(f"log: {server.log_file}", flush=True)
    while not stop and server.alive():
        time.sleep(0.5)
    if not stop:
        print(f"error: tritonserver exited with code {server.process.returncode}\n{server.log_tail()}",
              file=sys.stderr)
        server.stop()
        return 1
    server.stop()
    print("stopped")
    return 0


def cmd_demo(args) -> int:
    from ensemble.demo import DemoOptions, run_demo

    options = DemoOptions(synth=_synth_config(args), train=_train_config(args), workdir=Path(args.workdir),
                          repository=Path(args.repository), server=_server_options(args),
                          keep_serving=args.keep_serving)
    run_demo(options)
    return 0


def _add_synth(p: argparse.ArgumentParser, rows: int) -> None:
    p.add_argument("--rows", type=int, default=rows, help="rows to generate")
    p.add_argument("--scale", type=float, default=0.01,
                   help="category cardinalities as a fraction of Criteo's (1.0 = millions of values)")
    p.add_argument("--seed", type=int, default=0)


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="build", help="training artifacts and reports")
    p.add_argument("--freq-threshold", type=int, default=3, help="Categorify frequency threshold")
    p.add_argument("--xgb-rounds", type=int, default=400, help="most boosting rounds (early stopping)")
    p.add_argument("--epochs", type=int, default=2, help="DLRM epochs")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="cpu",
                   help="gpu: mixed precision and GPU trees (written for GPUs, not run on this project's machines)")


def _add_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repository", default="model_repository")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-config-name", default=None, help="e.g. gpu: read configs/<name>.pbtxt")
    p.add_argument("--log-file", default=None, help="server log (default: a temp file)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ensemble", description="Criteo ranking ensemble on Triton")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic Criteo-format TSV")
    _add_synth(p, 300_000)
    p.add_argument("--output", default="build/data/synthetic.tsv", help=".gz suffix compresses")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("train", help="fit features and train xgb, dlrm_torch, dlrm_tf and the blend")
    p.add_argument("input", nargs="+", help="Criteo TSV day files (.gz too), in time order")
    p.add_argument("--nrows", type=int, default=None)
    p.add_argument("--valid-fraction", type=float, default=0.1)
    p.add_argument("--test-fraction", type=float, default=0.1)
    _add_train(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a new version of every model into the repository")
    p.add_argument("--workdir", default="build")
    p.add_argument("--repository", default="model_repository")
    p.add_argument("--keep", type=int, default=2, help="versions to keep per model")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="run tritonserver on the repository until SIGINT/SIGTERM")
    _add_server(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="synthesize, train, export, serve, check parity, measure")
    _add_synth(p, 300_000)
    _add_train(p)
    _add_server(p)
    p.add_argument("--keep-serving", action="store_true", help="keep the server up after the demo")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
