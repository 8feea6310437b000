"""`ensemble` command line: subcommands by group, each a thin wrapper, each group's parser beside its commands:
:mod:`~ensemble.cli.build` (synth, train, export), :mod:`~ensemble.cli.operate` (tables, serve, deploy, rollback,
experiment, declare, engines, check), :mod:`~ensemble.cli.score` (score, rank, materialize),
:mod:`~ensemble.cli.measure` (baseline-serve, loadtest, cost, demo); :mod:`~ensemble.cli.common` the options
they share. ``ensemble.data.criteo`` imports pandas (~0.4 s): the commands import it where they use it, so that
``--help`` and argument errors answer at once."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from ensemble.cli import build, measure, operate, score
from ensemble.cli.build import _train_config  # noqa: F401 - the tests build a training config as `train` does
from ensemble.cli.common import _Help


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ensemble", description="Criteo ranking ensemble on Triton",
                                     formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (build, operate, score, measure):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # TensorFlow's C++ info and warning lines (CPU features, SavedModel loading, the TFLite
    # converter's notes) say nothing a user of these commands acts on; its errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # NVTabular calls its CPU mode experimental on every Dataset; the CPU is this project's default
    # path on purpose (the GPU one: docs/gpu-deployment.md).
    warnings.filterwarnings("ignore", message="Initializing an NVTabular Dataset in CPU mode")
    args = build_parser().parse_args(argv)
    # Before any library imports grpc (NVTabular does, through tritonclient): the commands' gRPC
    # clients then poll on their calling threads (ensemble/base/grpc_polling.py). After the parse, so
    # that --help and argument errors answer without it.
    from ensemble.base.grpc_polling import import_grpc

    import_grpc()
    from ensemble.dataset import SpecError
    from ensemble.models.manifest import MissingRelease
    from ensemble.repository.declared import DeclaredMissing

    try:
        return args.func(args)
    except (SpecError, MissingRelease, DeclaredMissing) as exc:
        # a spec that cannot describe the data, data that does not match it, a release asked for that
        # the repository does not hold, a declaration that names one: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
