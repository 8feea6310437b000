"""`ensemble score` against the real server: equals --local, Dask equals single process,
and a server that dies mid-run never leaves a partial file that looks complete."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tritonclient.http

from benchmarks.batch_scoring import SharedMemorySettings
from clients.batch.score import ScoreSettings
from clients.batch import read_parts, score_files
from ensemble import cli, schema
from ensemble.data import criteo
from ensemble.operate.control import admin_headers
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_port
from tests.helpers import SYNTH


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    frame = criteo.synthesize(criteo.SynthConfig(rows=50_000, scale=SYNTH.scale, seed=501)).frame
    tsv = criteo.write_criteo(frame, root / "day.tsv")
    gz = criteo.write_criteo(frame.iloc[:7000], root / "small.tsv.gz")
    table = frame.iloc[:9000].copy()
    table.insert(0, "request_id", np.arange(9000) + 10**6)
    for col in schema.DENSE_COLUMNS:
        table[col] = table[col].astype("float64")
    parquet = root / "rows.parquet"
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), parquet, row_group_size=2500)
    return {"root": root, "tsv": tsv, "gz": gz, "parquet": parquet, "frame": frame}


def _score(*argv) -> int:
    return cli.main(["score", *map(str, argv), "--no-progress"])


def test_50k_rows_through_server_equal_local(server, trained, inputs):
    out = inputs["root"]
    assert _score(inputs["tsv"], "--local", "--repository", trained.repository, "--output", out / "local.parquet",
                  "--all-scores") == 0
    assert _score(inputs["tsv"], "--url", server.http_url, "--output", out / "http.parquet", "--all-scores",
                  "--partition-mb", "1", "--concurrency", "3") == 0
    local, http = pd.read_parquet(out / "local.parquet"), pd.read_parquet(out / "http.parquet")
    assert len(local) == len(http) == 50_000
    np.testing.assert_array_equal(http[schema.LABEL], inputs["frame"][schema.LABEL])  # order kept
    for name in ("score", "score_xgb", "score_dlrm_torch", "score_dlrm_tf"):
        assert np.max(np.abs(local[name] - http[name])) <= 1e-5, name


def test_gz_parquet_and_csv(server, inputs, capsys):
    out = inputs["root"]
    assert _score(inputs["gz"], inputs["parquet"], "--url", f"grpc://{server.grpc_url}",
                  "--output", out / "mixed.csv", "--batch-size", "1000") == 0
    assert "16000 rows" in capsys.readouterr().out
    mixed = pd.read_csv(out / "mixed.csv")
    assert len(mixed) == 16_000
    assert mixed["request_id"].iloc[7000:].tolist() == list(range(10**6, 10**6 + 9000))  # ids passed through
    assert mixed["label"].notna().all()


def test_dask_local_cluster_equals_single_process(server, inputs):
    out = inputs["root"]
    assert _score(inputs["tsv"], "--url", server.http_url, "--output", out / "single.parquet") == 0
    assert _score(inputs["tsv"], "--url", server.http_url, "--url", f"grpc://{server.grpc_url}",
                  "--output", out / "dask", "--dask-local", "2", "--partition-mb", "2") == 0
    single = pd.read_parquet(out / "single.parquet")
    parts = pd.concat(list(read_parts(out / "dask")), ignore_index=True)
    assert len(list((out / "dask").glob("part-*.parquet"))) > 2
    np.testing.assert_array_equal(parts[schema.LABEL], single[schema.LABEL])
    assert np.max(np.abs(parts["score"] - single["score"])) <= 1e-5


def _run_against(port_http: int, path, output, retries: int):
    cmd = [sys.executable, "-m", "ensemble", "score", str(path), "--url", f"127.0.0.1:{port_http}",
           "--output", str(output), "--batch-size", "512", "--concurrency", "2", "--retries", str(retries),
           "--backoff", "0.5", "--no-progress"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture()
def own_server(trained, tmp_path):
    options = ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), log_file=tmp_path / "own.log")
    srv = TritonServer(options).start()
    yield srv
    srv.stop()


def _kill_mid_run(server, proc, output) -> None:
    """SIGKILL the server once the run has written some scored rows (the file has grown)."""
    partial = output.with_name(output.name + ".partial")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.stat().st_size > 20_000:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before the server could be killed"
    server.kill()


def test_server_killed_mid_run_fails_cleanly(own_server, inputs):
    output = inputs["root"] / "killed.parquet"
    proc = _run_against(own_server.options.http_port, inputs["tsv"], output, retries=2)
    _kill_mid_run(own_server, proc, output)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "rows" in err and "failed" in err
    assert not output.exists() and not output.with_name(output.name + ".partial").exists()


def test_server_restarted_mid_run_completes_correctly(own_server, inputs, pipeline):
    output = inputs["root"] / "restarted.parquet"
    proc = _run_against(own_server.options.http_port, inputs["tsv"], output, retries=10)
    _kill_mid_run(own_server, proc, output)
    own_server.start()  # same ports
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    got = pd.read_parquet(output)
    frame = inputs["frame"]
    from clients.inputs import to_tensors

    want = pipeline.score(*to_tensors(frame))["score"].ravel()
    assert len(got) == len(frame) and np.max(np.abs(got["score"] - want)) <= 1e-5


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_requests_score_what_request_bodies_do(server, inputs, protocol):
    """The batch-scoring benchmark's shared-memory transport (tensors in system shared memory,
    Triton's extension) gives the scores that request bodies give, and leaves no region registered
    with the server or present in /dev/shm."""
    out, url = inputs["root"], server.grpc_url if protocol == "grpc" else server.http_url
    bodies = score_files([str(inputs["gz"])], str(out / f"bodies-{protocol}.parquet"),
                         ScoreSettings(urls=(url,), protocol=protocol, batch_size=3000, all_scores=True),
                         progress=False)
    settings = SharedMemorySettings(urls=(url,), protocol=protocol, batch_size=3000, concurrency=2, all_scores=True)
    status = tritonclient.http.InferenceServerClient(server.http_url)
    admin = admin_headers(grpc=False)  # the server is keyed: listing regions is an admin call
    try:
        shared = score_files([str(inputs["gz"])], str(out / f"shm-{protocol}.parquet"), settings, progress=False)
        registered = [r for r in status.get_system_shared_memory_status(headers=admin) if r["name"].startswith("ensemble-bench-")]
        assert len(registered) >= 2  # a scoring thread's input and output regions at least
    finally:
        settings.close()
    assert not [r for r in status.get_system_shared_memory_status(headers=admin) if r["name"].startswith("ensemble-bench-")]
    assert not [r for r in registered if Path("/dev/shm", r["key"].lstrip("/")).exists()]
    assert bodies.rows == shared.rows == 7000
    expected, got = pd.read_parquet(out / f"bodies-{protocol}.parquet"), pd.read_parquet(out / f"shm-{protocol}.parquet")
    np.testing.assert_array_equal(got[schema.LABEL], expected[schema.LABEL])
    for name in ("score", "score_xgb", "score_dlrm_torch", "score_dlrm_tf"):
        assert np.max(np.abs(got[name] - expected[name])) <= 1e-5, name
