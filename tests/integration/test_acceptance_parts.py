"""The parts of the GPU acceptance run that need no GPU, against the real CPU tritonserver: the
readiness wait, scoring every ranker output through the server and in process, the comparison
and a short locust run, ending in a report. (The served side here is the CPU layout, so the two
sides agree far inside the GPU tolerances; on a GPU host the served side is FIL/libtorch/TF.)"""

from __future__ import annotations

import pytest

from ensemble.cli import acceptance
from ensemble.features.fresh import fresh_rows
from ensemble.data import criteo


def test_wait_ready_on_a_running_server_and_timeout_on_a_closed_port(server):
    from ensemble.base.machine import free_port

    from ensemble.operate.lifecycle import wait_ready

    assert wait_ready(f"http://{server.http_url}", timeout=30) < 30
    with pytest.raises(RuntimeError, match="not ready after"):
        wait_ready(f"http://127.0.0.1:{free_port()}", timeout=1.0, poll=0.2)


def test_served_and_in_process_scores_compare_and_report(server, trained, tmp_path):
    url = f"http://{server.http_url}"
    dense, categorical, labels = fresh_rows(600, seed=99, scale=0.1, labels=True)
    served = acceptance.score_served(url, dense, categorical)
    local = acceptance.score_in_process(trained.repository, dense, categorical)
    comparisons = acceptance.compare(served, local, labels)
    assert [c.output for c in comparisons] == list(acceptance.TOLERANCES)
    assert all(c.ok and c.max_abs <= 1e-5 for c in comparisons), comparisons
    frame = criteo.synthesize(criteo.SynthConfig(rows=500, scale=0.1, seed=98)).frame
    holdout = criteo.write_criteo(frame, tmp_path / "holdout.tsv")
    load = acceptance.load_test(url, holdout, users=2, seconds=3, out=tmp_path)
    assert load["requests"] > 0 and load["failures"] == 0, load
    report = acceptance.Report(rows=600, ready_after_s=0.0, comparisons=[{**c.__dict__, "ok": c.ok}
                                                                         for c in comparisons], load_test=load)
    assert report.passed and "| score_xgb |" in report.write(tmp_path).read_text()
