"""Tables larger than memory (ensemble.tables) against the real tritonserver, at a small scale that still takes
every path: a table of 2M rows (on disk) beside small ones (in RAM), a hot tier far smaller than the table,
cold reads, a block failing its checksum, a missing file, a slow disk (a throttled blkio cgroup), the python
backend layouts refusing the release, and a release changing a few rows deployed under load."""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from benchmarks.tables import forge
from ensemble.models.registry import Layout
from ensemble.operate.server import ServerError, ServerOptions, TritonServer
from ensemble.base.machine import free_port
from ensemble.schema import Model
from tests.helpers import ADMIN_KEY

BIG = 2_000_000  # C1's rows: past ensemble.tables.SMALL_ROWS, so on disk
DIM = 8
BUCKETS = (BIG, 3, 50, 5000, *([300] * 22))


@pytest.fixture(scope="session")
def row_store(tmp_path_factory):
    """A release whose DLRMs keep their tables in a row store: (repository, workdir, frames)."""
    from ensemble import schema
    from ensemble.runs import training
    from ensemble.data import criteo
    from ensemble.models.dlrm import DLRMConfig
    from ensemble.models.xgb import XGBConfig
    from ensemble.repository.export import TrainedArtifacts, export_repository

    root = tmp_path_factory.mktemp("row-store")
    path = criteo.write_criteo(criteo.synthesize(criteo.SynthConfig(rows=12_000, scale=0.05, seed=5)).frame,
                               root / "criteo.tsv")
    train, valid, test = criteo.split(criteo.read_criteo([path]))
    config = training.TrainConfig(spec=schema.CRITEO.with_hash_buckets(BUCKETS), row_store=True,
                                  xgb=XGBConfig(rounds=20, max_depth=4),
                                  dlrm=DLRMConfig(epochs=1, embedding_dim=DIM, bottom_mlp=(16,), top_mlp=(16,)))
    training.train_all(train, valid, test, root / "work", config, log=lambda _: None)
    repository = root / "repository"
    export_repository(TrainedArtifacts.under(root / "work"), repository)
    return repository, root / "work", config, (train, valid, test)


def _server(repository: Path, log: Path, layout: Layout = Layout.NATIVE, cache_gib: float = 0.0005, **tables):
    env = {"ENSEMBLE_EMBEDDING_CACHE_GIB": f"{cache_gib:g}", **tables}
    return TritonServer(ServerOptions(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                      log_file=log, layout=layout, admin_key=ADMIN_KEY, tables=env))


def _rows(n: int, seed: int, c1_ids=None) -> tuple[np.ndarray, np.ndarray]:
    """n request rows; C1's values forged so that their ids are c1_ids (else random ids)."""
    rng = np.random.default_rng(seed)
    dense = rng.lognormal(1.0, 1.0, (n, 13)).astype(np.float32)
    cats = np.array([[f"{rng.integers(0, 10**6):08x}".encode() for _ in range(26)] for _ in range(n)], dtype=object)
    ids = rng.integers(0, BIG, n) if c1_ids is None else np.asarray(c1_ids)
    cats[:, 0] = [forge(b"c1", int(i)) for i in ids]
    return dense, cats


def _newest(model_dir: Path) -> Path:
    return max((p for p in model_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def _metrics(server) -> dict:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("ensemble_table_"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def _total(metrics: dict, family: str, table: str | None = None) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(family + "{") and (table is None or f'table="{table}"' in k))


def test_a_row_store_release_serves_the_pipelines_scores_reading_cold_rows_from_disk(row_store, tmp_path):
    from clients.triton import RankerClient
    from ensemble.scoring.pipeline import Pipeline

    repository, _, _, _ = row_store
    pipeline = Pipeline.from_repository(repository)
    server = _server(repository, tmp_path / "tritonserver.log")
    server.start()
    try:
        client = RankerClient(server.grpc_url, "grpc")
        for n, seed in ((1, 1), (100, 2), (100, 3)):
            dense, cats = _rows(n, seed)
            served = client.infer(dense, cats, all_scores=True)
            local = pipeline.score(dense, cats)
            for name, value in local.items():
                assert np.allclose(np.ravel(served[name]), np.ravel(value), atol=1e-5), name
        metrics = _metrics(server)
        assert _total(metrics, "ensemble_table_cold_rows_total", "C1") > 100  # random ids of 2M rows: from disk
        assert _total(metrics, "ensemble_table_cold_rows_total", "C2") == 0  # a small table: in RAM
        unique = _total(metrics, "ensemble_table_unique_keys_total")
        hits = _total(metrics, "ensemble_table_hot_hits_total")
        assert 0 < hits < unique and _total(metrics, "ensemble_table_read_seconds_count") >= 3
        reading = _total(metrics, "ensemble_table_reading_seconds_total")
        summed = _total(metrics, "ensemble_table_read_seconds_sum")
        assert 0 < reading <= summed * 1.001 + 1e-6  # overlapping calls count once in the wall time
        budget = 0.0005 * 2**30
        assert 0 < _total(metrics, "ensemble_table_hot_bytes") <= budget  # the tier holds rows, within its budget
        from ensemble.operate.monitoring import TABLE_METRIC_PREFIX, dashboard_metric_names

        panels = {n for n in dashboard_metric_names() if n.startswith(TABLE_METRIC_PREFIX)}
        exported = {k.split("{")[0] for k in metrics}
        assert len(panels) >= 6 and panels <= exported, panels - exported  # the dashboard's tables row reads them
    finally:
        server.stop()


def test_the_fused_layout_refuses_a_row_store_release(row_store, tmp_path):
    repository, _, _, _ = row_store
    server = _server(repository, tmp_path / "fused.log", layout=Layout.FUSED)
    with pytest.raises(ServerError, match="native layout: ensemble serve --layout native"):
        server.start()


def test_a_block_failing_its_checksum_answers_unavailable_naming_the_table_and_the_rest_is_served(row_store, tmp_path):
    from clients.triton import RankerClient
    from ensemble.tables import files
    from tritonclient.utils import InferenceServerException

    repository, _, _, _ = row_store
    copy = tmp_path / "repository"
    shutil.copytree(repository, copy)
    version = _newest(copy / "dlrm_torch")
    table = version / "tables" / "C1.rows"
    per = files.per_block(files.read_header(table).fmt, DIM)
    with open(table, "r+b") as handle:  # block 1000: one byte flipped
        handle.seek((1 + 1000) * files.BLOCK + 7)
        byte = handle.read(1)
        handle.seek((1 + 1000) * files.BLOCK + 7)
        handle.write(bytes([byte[0] ^ 0x10]))
    server = _server(copy, tmp_path / "tritonserver.log")
    server.start()
    try:
        for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            client = RankerClient(url, protocol)  # infer: no retries
            bad = _rows(1, 7, c1_ids=[1000 * per + 2])
            with pytest.raises(Exception) as caught:
                client.infer(*bad)
            text = str(caught.value)
            assert "table C1: block 1000 of" in text and "fails its checksum" in text, text
            if isinstance(caught.value, InferenceServerException):
                assert caught.value.status() in ("StatusCode.UNAVAILABLE", "503"), caught.value.status()
            good = _rows(5, 8, c1_ids=[1001 * per + k for k in range(5)])
            assert len(client.infer(*good)["score"]) == 5  # the server keeps serving
        assert _total(_metrics(server), "ensemble_table_read_failures_total") >= 2
    finally:
        server.stop()


def test_a_missing_table_file_fails_the_load_naming_the_file(row_store, tmp_path):
    repository, _, _, _ = row_store
    copy = tmp_path / "repository"
    shutil.copytree(repository, copy)
    version = _newest(copy / "dlrm_tf")
    (version / "tables" / "C1.rows").unlink()
    server = _server(copy, tmp_path / "tritonserver.log")
    with pytest.raises(ServerError, match=r"C1\.rows"):
        server.start()


BLKIO = Path("/sys/fs/cgroup/blkio")


def _device_of(path: Path) -> str:
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    whole = Path(f"/sys/dev/block/{major}:{minor}")
    if (whole / "partition").is_file():  # a partition: throttle its disk
        return (whole.resolve().parent / "dev").read_text().strip()
    return f"{major}:{minor}"


def test_a_slow_disk_answers_unavailable_at_the_deadline_and_the_server_keeps_serving(row_store, tmp_path):
    """The table's disk throttled to 5 reads a second (a blkio cgroup holding tritonserver): a request whose
    cold reads cannot finish by its client's deadline is answered UNAVAILABLE naming the table."""
    from clients.triton import RankerClient
    from ensemble.operate import processes

    if not (BLKIO / "cgroup.procs").is_file() or os.geteuid() != 0:
        pytest.fail("a slow disk needs the cgroup v1 blkio controller and root (the CI machine has both)")
    repository, _, _, _ = row_store
    server = _server(repository, tmp_path / "tritonserver.log", ENSEMBLE_TABLE_READ_TIMEOUT_MS="300")
    server.start()
    group = BLKIO / f"ensemble-slow-{os.getpid()}"
    group.mkdir()
    device = _device_of(repository)
    try:
        for pid in processes.tree(server.process.pid):
            (group / "cgroup.procs").write_text(str(pid))
        (group / "blkio.throttle.read_iops_device").write_text(f"{device} 5")
        client = RankerClient(server.grpc_url, "grpc", timeout=5.0)  # the server's cap (300 ms) comes first
        started = time.monotonic()
        with pytest.raises(Exception, match=r"table C1: cold reads did not finish within the request's deadline"):
            client.infer(*_rows(100, 11))  # ~100 cold blocks at 5 reads a second
        assert time.monotonic() - started < 5
        (group / "blkio.throttle.read_iops_device").write_text(f"{device} 0")
        # the slow calls taught the admission policy slow times: it may refuse for a moment (UNAVAILABLE,
        # retried with backoff as clients do), then the server answers again
        deadline = time.monotonic() + 30
        while True:
            try:
                assert len(client.infer(*_rows(1, 12))["score"]) == 1
                break
            except Exception as exc:  # noqa: BLE001 - only refusals are retried
                assert "UNAVAILABLE" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.5)
        assert _total(_metrics(server), "ensemble_table_read_failures_total", "C1") >= 1
    finally:
        (group / "blkio.throttle.read_iops_device").write_text(f"{device} 0")
        for pid in (group / "cgroup.procs").read_text().split():
            (BLKIO / "cgroup.procs").write_text(pid)
        server.stop()
        group.rmdir()


def test_a_release_changing_a_few_rows_shares_the_table_files_and_deploys_under_load(row_store, tmp_path):
    from dataclasses import replace

    from ensemble.runs import training
    from ensemble.operate.control import Control
    from ensemble.operate.deploy import deploy
    from ensemble.repository.export import TrainedArtifacts, export_repository
    from ensemble.scoring.pipeline import Pipeline
    from ensemble.tables.files import TablesManifest
    from tests.helpers import Load

    repository, workdir, config, (train, valid, test) = row_store
    copy = tmp_path / "repository"
    shutil.copytree(repository, copy)
    shutil.copytree(workdir, tmp_path / "work")
    # the DLRMs trained on: from the serving release's rows and MLPs, a little new data (the trees stay)
    fresh = train.sample(2000, random_state=3)
    training.train_all(fresh, valid, test, tmp_path / "work", replace(config, init_from=copy, reuse_features=True,
                                                                      models=("dlrm_torch", "dlrm_tf")),
                       log=lambda _: None)
    server = _server(copy, tmp_path / "tritonserver.log", cache_gib=0.002)
    server.start()
    try:
        control = Control.of(server.http_url, grpc=server.grpc_url)
        old = control.serving_release()
        new = int(export_repository(TrainedArtifacts.under(tmp_path / "work"), copy)[Model.RANKER].name)
        for step in ("dlrm_torch", "dlrm_tf"):
            manifest = TablesManifest.load(_newest(copy / step))
            c1 = next(t for t in manifest.tables if t.name == "C1")
            assert c1.shared_from is not None and c1.delta is not None and c1.delta.rows > 0
            assert manifest.written_bytes < 0.2 * manifest.shared_bytes  # the changed rows, not the table
            assert 0 < manifest.changed_rows < sum(t.rows for t in manifest.tables)
            warm = [folder / "tables" / "warm.rows" for folder in (_newest(copy / step), copy / step / "1")]
            assert warm[0].stat().st_ino == warm[1].stat().st_ino  # the warm file shared: the warm start kept
        dense, cats = _rows(64, 21)
        with Load(server.http_url, (dense, cats), attempts=1) as load:
            deploy(server.http_url, copy, log=lambda _: None, grpc_url=server.grpc_url)
        assert control.serving_release() == new and new != old
        assert load.sent > 20 and load.failed == 0, load.errors[:3]
        # every answer is one release's: the new one's scores equal its pipeline's
        from clients.triton import RankerClient

        served = RankerClient(server.grpc_url, "grpc").infer(dense, cats)["score"]
        assert np.allclose(np.ravel(served), np.ravel(Pipeline.from_repository(copy, release=new).score(dense, cats)["score"]),
                       atol=1e-5)
    finally:
        server.stop()


def test_a_fleets_cold_tier_in_a_redis_cluster_gives_the_disks_answers(row_store, tmp_path):
    """The large tables' blocks in a real Redis Cluster (three nodes), the release's large files gone from the
    server's folder: the same scores as from the disk; a node that goes away: UNAVAILABLE naming the table."""
    from clients.triton import RankerClient
    from ensemble import cli
    from ensemble.native import _tables
    from ensemble.online.local import LocalRedisCluster, cluster_ports

    if not _tables.has_redis():
        pytest.fail("this build has no Redis client: install libhiredis-dev (make setup does)")
    repository, _, _, _ = row_store
    cluster = LocalRedisCluster(cluster_ports(3), tmp_path / "redis").start()
    copy = tmp_path / "repository"
    shutil.copytree(repository, copy)
    servers = []
    try:
        assert cli.main(["tables", "--repository", str(copy), "--to-redis", cluster.url]) == 0
        for step in ("dlrm_torch", "dlrm_tf"):  # the server's folder keeps only the small files
            (_newest(copy / step) / "tables" / "C1.rows").unlink()
        disk = _server(repository, tmp_path / "disk.log")
        remote = _server(copy, tmp_path / "redis.log", ENSEMBLE_TABLE_COLD=cluster.url)
        servers = [disk, remote]
        for server in servers:
            server.start()
        dense, cats = _rows(100, 31)
        from_disk = RankerClient(disk.grpc_url, "grpc").infer(dense, cats, all_scores=True)
        from_redis = RankerClient(remote.grpc_url, "grpc").infer(dense, cats, all_scores=True)
        for name in from_disk:
            assert np.array_equal(from_disk[name], from_redis[name]), name
        assert _total(_metrics(remote), "ensemble_table_cold_rows_total", "C1") > 50
        for node in cluster.nodes:  # the cold tier goes away
            node.kill()
        with pytest.raises(Exception, match=r"table C1: (the cold tier(:| redis://)|cold reads did not finish)"):
            RankerClient(remote.grpc_url, "grpc").infer(*_rows(100, 32))
        assert remote.alive() and _total(_metrics(remote), "ensemble_table_read_failures_total", "C1") >= 1
    finally:
        for server in servers:
            server.stop()
        cluster.stop()
