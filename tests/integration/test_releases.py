"""Live releases against a real server under concurrent load: `deploy` switches every model of
the ranker at once with no failed request, `rollback` goes back, and a release that fails its
checks is refused while the serving one stays."""

from __future__ import annotations

import json
import shutil

import pytest

from ensemble import cli
from ensemble.operate.control import Control, ControlError
from ensemble.operate.deploy import DeployError, deploy
from ensemble.repository.export import TrainedArtifacts, export_repository
from ensemble.schema import Model
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_port
from tests.helpers import ADMIN_KEY, Load, fresh_rows


@pytest.fixture()
def served_copy(trained, tmp_path):
    """A private copy of the trained repository (this test exports into it) and its server."""
    repository = tmp_path / "repo"
    shutil.copytree(trained.repository, repository)
    server = TritonServer(ServerOptions(repository, http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), log_file=tmp_path / "tritonserver.log",
                                        admin_key=ADMIN_KEY))
    server.start()
    yield repository, server
    server.stop()


def test_deploy_and_rollback_under_load_fail_no_request(trained, served_copy, capsys):
    repository, server = served_copy
    control = Control.of(server.http_url)
    first = control.serving_release()
    new = int(export_repository(TrainedArtifacts.under(trained.workdir), repository)[Model.RANKER].name)
    assert new > first and control.serving_release() == first  # exporting alone changes nothing served
    # No retries: every failure counts, refusals included (nothing here is near its deadline).
    with Load(server.http_url, fresh_rows(64, seed=43), attempts=1) as load:
        urls = ["--url", server.http_url, "--grpc-url", server.grpc_url, "--repository", str(repository)]
        assert cli.main(["deploy", *urls]) == 0
        assert control.serving_release() == new
        assert cli.main(["rollback", *urls]) == 0
        assert control.serving_release() == first
    out = capsys.readouterr().out
    print(f"\nlive releases: {load.sent} requests during deploy + rollback, {load.failed} failed, "
          f"{load.refused} refused")
    assert f"serving release {new}" in out and f"serving release {first}" in out
    assert load.sent > 50 and load.failed == 0 and load.refused == 0, load.errors[:3]


def test_a_server_started_later_serves_the_declared_release(trained, served_copy, tmp_path):
    from ensemble.repository import declared
    from ensemble.operate.deploy import rollback

    repository, server = served_copy
    first = Control.of(server.http_url).serving_release()
    new = int(export_repository(TrainedArtifacts.under(trained.workdir), repository)[Model.RANKER].name)
    assert declared.read(repository) is None  # exported, not deployed: nothing declared
    deploy(server.http_url, repository, log=lambda _: None, grpc_url=server.grpc_url)
    assert declared.read(repository) == new
    rollback(server.http_url, repository, log=lambda _: None, grpc_url=server.grpc_url)
    assert declared.read(repository) == first
    later = TritonServer(ServerOptions(repository, http_port=free_port(), grpc_port=free_port(),
                                       metrics_port=free_port(), log_file=tmp_path / "later.log", admin_key=ADMIN_KEY))
    later.start()
    try:  # the newest exported release is `new`; the declared one serves
        assert Control.of(later.http_url).serving_release() == first
        assert Control.of(later.http_url).config()["version_policy"] == {"specific": {"versions": [first]}}
    finally:
        later.stop()


def test_export_keeps_what_serves_and_a_server_refuses_a_declared_release_that_is_gone(trained, served_copy, tmp_path,
                                                                                        capsys):
    from ensemble.repository import declared
    from ensemble.operate.deploy import available_releases
    from ensemble.operate.server import ServerError
    from ensemble.scoring.pipeline import release_versions

    repository, server = served_copy
    first = Control.of(server.http_url).serving_release()
    steps = release_versions(repository, first)
    export = ["export", "--workdir", str(trained.workdir), "--repository", str(repository), "--keep", "1"]
    assert cli.main(export) == 0  # the server has `first` loaded: kept, and said
    out = capsys.readouterr().out
    assert f"kept ranker {first}: loaded by tritonserver {server.process.pid}" in out, out
    assert first in available_releases(repository)
    server.stop()
    declared.write(repository, first, "rollback")  # the oldest release declared, no server running
    assert cli.main(export) == 0
    out = capsys.readouterr().out
    assert f"kept ranker {first}: the declared release" in out, out
    assert available_releases(repository)[0] == first and len(available_releases(repository)) == 2
    assert all(folder.is_dir() for folder in steps.values())  # and the steps it names
    later = TritonServer(ServerOptions(repository, http_port=free_port(), grpc_port=free_port(),
                                       metrics_port=free_port(), log_file=tmp_path / "later.log", admin_key=ADMIN_KEY))
    try:  # the declared release serves, not the newest export
        later.start()
        assert Control.of(later.http_url).ready_versions() == [first]
    finally:
        later.stop()
    declared.write(repository, 999, "rollback")  # a release the repository does not hold: refused, named
    refused = TritonServer(ServerOptions(repository, http_port=free_port(), grpc_port=free_port(),
                                         metrics_port=free_port(), log_file=tmp_path / "refused.log", admin_key=ADMIN_KEY))
    with pytest.raises(ServerError, match=r"not started: release 999, declared by rollback .*ensemble declare"):
        refused.start()
    assert refused.process is None


def test_a_release_with_a_damaged_file_is_refused_and_the_serving_one_stays(trained, served_copy):
    repository, server = served_copy
    serving = Control.of(server.http_url).serving_release()
    written = export_repository(TrainedArtifacts.under(trained.workdir), repository)
    (written[Model.XGB] / "xgboost.json").write_text("{}")
    with pytest.raises(DeployError, match="refused"):
        deploy(server.http_url, repository, log=lambda _: None)
    assert Control.of(server.http_url).serving_release() == serving


def test_a_release_with_worse_held_out_auc_is_refused(trained, served_copy, tmp_path):
    repository, server = served_copy
    report = json.loads((trained.workdir / "train_report.json").read_text())
    worse = json.loads(json.dumps(report))
    worse["test"]["blend"]["auc"] = report["test"]["blend"]["auc"] - 0.05
    for name, content in (("good.json", report), ("worse.json", worse)):
        (tmp_path / name).write_text(json.dumps(content))
    artifacts = TrainedArtifacts.under(trained.workdir)
    good = export_repository(TrainedArtifacts(artifacts.workflow_dir, artifacts.models_dir, tmp_path / "good.json"),
                             repository)[Model.RANKER]
    deploy(server.http_url, repository, log=lambda _: None)
    assert Control.of(server.http_url).serving_release() == int(good.name)
    export_repository(TrainedArtifacts(artifacts.workflow_dir, artifacts.models_dir, tmp_path / "worse.json"), repository)
    with pytest.raises(DeployError, match="held-out AUC"):
        deploy(server.http_url, repository, log=lambda _: None)
    assert Control.of(server.http_url).serving_release() == int(good.name)


def test_model_control_needs_the_key_when_one_is_set(trained, tmp_path, monkeypatch):
    server = TritonServer(ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), log_file=tmp_path / "log", admin_key="k3y"))
    server.start()
    try:
        monkeypatch.delenv("ENSEMBLE_ADMIN_KEY", raising=False)
        with pytest.raises(ControlError, match="403"):
            Control.of(server.http_url).serving_release()
        monkeypatch.setenv("ENSEMBLE_ADMIN_KEY", "k3y")
        assert Control.of(server.http_url).serving_release() is not None
    finally:
        server.stop()


def test_a_public_address_without_a_key_is_refused(trained, tmp_path):
    from ensemble.operate.server import ServerError

    server = TritonServer(ServerOptions(trained.repository, host="0.0.0.0", http_port=free_port(),
                                        grpc_port=free_port(), metrics_port=free_port(), log_file=tmp_path / "log"))
    with pytest.raises(ServerError, match="ENSEMBLE_ADMIN_KEY"):
        server.start()
    assert server.process is None
