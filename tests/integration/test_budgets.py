"""Serving budgets that are facts, not timings: which processes load which frameworks, memory."""

from __future__ import annotations

import subprocess
import sys


def test_stub_processes_load_only_their_frameworks(fused_server):
    processes = fused_server.backend_processes()
    assert set(processes) == {"ranker", "rank"}
    assert processes["rank"]["frameworks"] == []  # ranking requests: numpy, the ranker does the work
    # the models' runtimes (XGBoost's library, TorchScript, TensorFlow Lite's), not TensorFlow itself
    assert processes["ranker"]["frameworks"] == ["litert", "torch", "xgboost"], processes["ranker"]


def test_server_memory_under_three_gib(layout_server):
    assert 0 < layout_server.resident_memory_bytes() < 3 * 2**30


def test_light_steps_import_no_framework_in_process(trained):
    code = (
        "import sys; from ensemble.scoring.pipeline import load_step, latest_version; from pathlib import Path\n"
        f"repo = Path({str(trained.repository)!r})\n"
        "for m in ('features', 'blend'): load_step(m, latest_version(repo / m))\n"
        "heavy = [m for m in ('torch', 'tensorflow', 'nvtabular', 'pandas', 'xgboost') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cpu_seconds_are_split_by_process_and_grow_with_work(fused_server):
    server = fused_server
    from clients.triton import RankerClient
    from tests.helpers import fresh_rows

    before = server.cpu_seconds()
    assert set(before) == {"tritonserver", "ranker", "rank"}
    before.pop("rank")  # ranking requests only: these flat requests never reach it
    dense, cats = fresh_rows(100, seed=77)
    client = RankerClient(server.http_url, "http")
    try:
        for _ in range(150):
            client.infer(dense, cats)
    finally:
        client.close()
    after = server.cpu_seconds()
    grew = {name: after[name] - before[name] for name in before}
    assert all(seconds > 0 for seconds in grew.values()), grew  # every process did part of the work
