"""CPU baselines agree with Triton; the scenario runner writes a complete report (real locust)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ensemble.base.machine import free_port
from ensemble import schema
from ensemble.operate.lifecycle import terminate, wait_ready
from loadtest.runner import LOCUSTFILE, RunnerOptions, holdout_file, read_locust_csv, run
from tests.helpers import decodes_as_utf8, fresh_rows, post_infer


@pytest.fixture(scope="module")
def baselines(trained, tmp_path_factory):
    """naive and inproc (FastAPI), and mlserver (installed into its own environment, as the load
    test does)."""
    from loadtest.baselines import mlserver

    logs = tmp_path_factory.mktemp("baselines")
    urls, procs = {}, []
    for kind in ("naive", "inproc", "mlserver"):
        port = free_port()
        env = None
        if kind == "mlserver":
            mlserver.install()
            folder = mlserver.write_folder(logs / "mlserver", trained.repository, port, free_port(), free_port())
            cmd, env = mlserver.command(folder), mlserver.environment()
        else:
            cmd = [sys.executable, "-m", "ensemble", "baseline-serve", "--kind", kind,
                   "--repository", str(trained.repository), "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=open(logs / f"{kind}.log", "wb"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        procs.append(proc)
        urls[kind] = f"http://127.0.0.1:{port}"
    try:
        for kind, proc in zip(urls, procs):
            wait_ready(urls[kind], proc, what=f"baseline {kind} (log {logs / kind}.log)")
        yield urls
    finally:
        for proc in procs:
            terminate(proc, group=True)


def test_baselines_return_the_ensembles_scores(server, baselines):
    dense, cats = fresh_rows(300, seed=808)
    utf8 = np.array([all(decodes_as_utf8(v) for v in row) for row in cats])
    dense, cats = dense[utf8], cats[utf8]  # JSON carries text
    assert np.isnan(dense).any()
    for rows in (1, 37, len(dense)):
        for kind, url in baselines.items():
            # MLServer's JSON parser refuses a bare NaN: it gets the rows with missing values as 0
            sent = np.nan_to_num(dense[:rows]) if kind == "mlserver" else dense[:rows]
            body = schema.v2_json_request(sent, cats[:rows])
            status, triton = post_infer(f"http://{server.http_url}", body)
            assert status == 200, triton
            want = np.array(triton["outputs"][0]["data"])
            status, reply = post_infer(url, body)
            assert status == 200, (kind, reply)
            got = np.array(reply["outputs"][0]["data"])
            assert got.shape == want.shape and np.max(np.abs(got - want)) <= 1e-5, kind


def test_baselines_reject_bad_requests_and_keep_serving(baselines):
    bad = json.dumps({"inputs": [{"name": "dense", "shape": [1, 12], "datatype": "FP32", "data": [1.0] * 12}]})
    good = schema.v2_json_request(np.ones((1, 13), np.float32), np.full((1, 26), b"68fd1e64", dtype=object))
    for url in baselines.values():
        status, reply = post_infer(url, bad.encode())
        assert status == 400 and "shape" in reply["error"]
        assert post_infer(url, good)[0] == 200


def test_runner_writes_a_complete_report(fused_server, trained, tmp_path):
    """Against a server given by URL, whose statistics name its models."""
    server = fused_server
    options = RunnerOptions(repository=trained.repository, out=tmp_path / "report",
                            targets=("triton-http", "triton-grpc", "inproc"), rows=(1,), users=(2,),
                            duration=3, warmup=1, urls={"triton-http": f"http://{server.http_url}",
                                                        "triton-grpc": f"grpc://{server.grpc_url}"},
                            overload_seconds=0,  # the overload scenario: next test, fused layout only
                            perf_analyzer=(2,))  # one point per protocol (the full sweep: loadtest docs)
    report = run(options)
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert [s["target"] for s in results["scenarios"]] == ["triton-http", "triton-grpc", "inproc"]
    for scenario in results["scenarios"]:
        assert scenario["requests"] > 0 and scenario["failures"] == 0, scenario
    assert "ranker" in results["scenarios"][0]["stages"]  # per-model times from Triton's statistics
    assert results["scenarios"][0]["server_cpu_ms"] == {}  # a server given by URL is not ours to measure
    inproc_cpu = results["scenarios"][2]["server_cpu_ms"]
    assert list(inproc_cpu) == ["inproc"] and 0 < inproc_cpu["inproc"] < 1000
    assert len(list((tmp_path / "report" / "raw").glob("*_stats.csv"))) == 3
    for name in ("throughput_vs_p99.png", "latency_percentiles.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "Headline" in report.read_text()
    assert results["overload"] is None and "## Overload" not in report.read_text()
    swept = results["perf_analyzer"]
    assert [(p["target"], p["concurrency"], p["error"]) for p in swept] == [("triton-http", 2, ""),
                                                                            ("triton-grpc", 2, "")], swept
    assert all(p["rows_per_s"] > 0 for p in swept), swept


def test_runner_report_has_the_overload_scenario(server, trained, tmp_path):
    """The open-loop run at 2x capacity on triton-http."""
    options = RunnerOptions(repository=trained.repository, out=tmp_path / "report", targets=("triton-http",),
                            rows=(1,), users=(2,), duration=2, warmup=1,
                            urls={"triton-http": f"http://{server.http_url}"}, overload_seconds=2,
                            perf_analyzer=())  # the sweep: previous test
    report = run(options)
    overload = json.loads((tmp_path / "report" / "results.json").read_text())["overload"]
    assert overload["capacity_per_s"] > 0 and overload["runs"][0]["multiple"] == 2.0
    assert overload["runs"][0]["errors"] == 0 and overload["runs"][0]["sent"] > 0, overload["runs"][0]
    assert "## Overload (open loop)" in report.read_text()


def _locust(user: str, host: str, data_file, csv_prefix, seconds: int = 1, rows: int = 1):
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user, "--headless", "-u", "2", "-r", "2",
           "-t", f"{seconds}s", "--host", host, "--data-file", str(data_file), "--rows-per-request", str(rows),
           "--stop-timeout", "5", "--only-summary", "--loglevel", "WARNING", "--csv", str(csv_prefix)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def holdout(tmp_path_factory):
    return holdout_file(RunnerOptions(out=tmp_path_factory.mktemp("holdout")))


def test_grpc_locust_runs_end_and_their_csv_holds_the_final_counts(server, holdout, tmp_path):
    """Before the exit hook, about one gRPC run in ten printed its summary and then hung in
    interpreter shutdown; locust's own CSV also lagged the final counts by up to a second."""
    for attempt in range(6):
        prefix = tmp_path / f"grpc{attempt}"
        done = _locust("TritonGrpcUser", f"grpc://{server.grpc_url}", holdout, prefix, rows=1 + 99 * (attempt % 2))
        assert done.returncode == 0, done.stderr[-2000:]
        row = read_locust_csv(prefix)
        printed = next(line for line in (done.stdout + done.stderr).splitlines()
                       if line.strip().startswith("Aggregated"))  # the summary table's first one
        assert row["requests"] > 0 and row["failures"] == 0
        assert row["requests"] == int(printed.split()[1]), (row, printed)


def test_unreachable_target_stops_on_the_fail_ratio_with_failures_recorded(holdout, tmp_path):
    prefix = tmp_path / "down"
    done = _locust("JsonUser", f"http://127.0.0.1:{free_port()}", holdout, prefix, seconds=30)
    assert done.returncode == 3, done.stderr[-2000:]  # the fail-ratio stop, long before 30 s
    row = read_locust_csv(prefix)
    assert row["requests"] >= 50 and row["failures"] == row["requests"]
    failures = (tmp_path / "down_failures.csv").read_text()
    assert "no response" in failures and "Connection refused" in failures
