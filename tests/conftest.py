"""Shared fixtures: a small trained model repository, built once per test session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from ensemble.data import criteo
from ensemble.base.grpc_polling import import_grpc

from tests.helpers import SYNTH

import_grpc()  # first, whichever test imports gRPC: the session's clients poll as the project's do


@dataclass(frozen=True)
class Trained:
    workdir: Path
    repository: Path
    train: pd.DataFrame
    valid: pd.DataFrame
    test: pd.DataFrame
    report: dict


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Trained:
    from ensemble.runs import training
    from ensemble.repository.export import TrainedArtifacts, export_repository
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.xgb import XGBConfig

    root = tmp_path_factory.mktemp("trained")
    path = criteo.write_criteo(criteo.synthesize(SYNTH).frame, root / "criteo.tsv")
    train, valid, test = criteo.split(criteo.read_criteo([path]))
    config = training.TrainConfig(xgb=XGBConfig(rounds=40, max_depth=6),
                                  dlrm=DLRMConfig(epochs=1, embedding_dim=8, bottom_mlp=(32,), top_mlp=(32,)))
    report = training.train_all(train, valid, test, root / "work", config, log=lambda _: None)
    repository = root / "model_repository"
    export_repository(TrainedArtifacts.under(root / "work"), repository)
    return Trained(root / "work", repository, train, valid, test, report)


@pytest.fixture(scope="session")
def pipeline(trained):
    from ensemble.scoring.pipeline import Pipeline

    return Pipeline.from_repository(trained.repository)


@pytest.fixture(scope="session")
def movielens_run(tmp_path_factory):
    """``ensemble demo --dataset movielens100k`` once per session: (its folder, its summary); the
    repository is ``<folder>/repository``."""
    from ensemble.cli.demo import DemoOptions
    from ensemble.cli.demo_movielens import DLRM_EPOCHS, run_movielens_demo
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.registry import Layout
    from ensemble.operate.server import ServerOptions
    from ensemble.base.machine import free_port
    from ensemble.runs.training import TrainConfig

    root = tmp_path_factory.mktemp("movielens")
    server = ServerOptions(root / "repository", http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                           log_file=root / "tritonserver-demo.log", layout=Layout.FUSED)
    options = DemoOptions(train=TrainConfig(dlrm=DLRMConfig(epochs=DLRM_EPOCHS)), workdir=root / "work",
                          repository=root / "repository", server=server)
    summary = run_movielens_demo(options, log=lambda _line: None)
    return root, summary
