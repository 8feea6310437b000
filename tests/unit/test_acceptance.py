"""The GPU acceptance run (ensemble/cli/acceptance.py), checked without a GPU or Docker: its commands
agree with docker-compose.yml and the Makefile, and its comparison and report behave. The parts
that talk to a server run against the real CPU server in tests/integration/test_acceptance_parts.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from ensemble import schema
from ensemble.cli import acceptance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_commands_name_the_gpu_profile_and_its_server(compose):
    options = acceptance.AcceptanceOptions(out=Path("build/x"))
    steps = acceptance.commands(options)
    triton = compose["services"][acceptance.SERVICE]
    assert "gpu" in triton["profiles"] and "--model-config-name=gpu" in triton["command"]
    assert f"--model-repository={acceptance.REPOSITORY_IN_CONTAINER}" in triton["command"]
    for name, cmd in steps.items():
        if cmd[0] == "docker":
            assert cmd[:6] == ["docker", "compose", "-f", str(acceptance.COMPOSE_FILE), "--profile", "gpu"], name
    assert steps["up"][6:] == ["up", "--build", "--detach", acceptance.SERVICE]
    assert steps["copy_repository"][6:] == ["cp", f"triton:{acceptance.REPOSITORY_IN_CONTAINER}", "build/x/repository"]
    # The default URL is the port the service publishes; readiness is strict (every model ready).
    port = re.search(r":(\d+)$", options.url).group(1)
    assert f"{port}:8000" in triton["ports"] and "--strict-readiness=true" in triton["command"]


def test_dry_run_prints_every_command(capsys):
    assert acceptance.main(["--dry-run", "--out", "build/y"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":", 1)[0] for line in out] == list(acceptance.commands(acceptance.AcceptanceOptions()))
    assert any("docker compose -f" in line and "up --build --detach triton" in line for line in out)


def test_makefile_target_runs_the_module():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-acceptance: setup\n\t\$\(BIN\)/python -m ensemble\.cli\.acceptance \$\(ARGS\)$", makefile, re.M)
    assert "gpu-acceptance" in re.search(r"^\.PHONY:.*$", makefile, re.M).group(0)


def test_nvidia_smi_csv_is_parsed():
    text = "NVIDIA A100-SXM4-80GB, 550.54.15, 81920 MiB\nNVIDIA L4, 550.54.15, 23034 MiB\n"
    assert acceptance.parse_gpus(text) == [
        {"name": "NVIDIA A100-SXM4-80GB", "driver": "550.54.15", "memory": "81920 MiB"},
        {"name": "NVIDIA L4", "driver": "550.54.15", "memory": "23034 MiB"}]


def test_tolerances_cover_every_ranker_output():
    assert set(acceptance.TOLERANCES) == {t.name for t in schema.RANKER_OUTPUTS}


def _scores(rng, n=500):
    return {name: rng.uniform(0, 1, n).astype(np.float32) for name in acceptance.TOLERANCES}


def test_compare_passes_within_and_fails_beyond_the_tolerance():
    rng = np.random.default_rng(0)
    cpu, labels = _scores(rng), rng.integers(0, 2, 500)
    near = {k: v + np.float32(acceptance.TOLERANCES[k] / 2) for k, v in cpu.items()}
    assert all(c.ok for c in acceptance.compare(near, cpu, labels))
    far = dict(near, score_xgb=cpu["score_xgb"] + np.float32(1e-3))
    failed = [c.output for c in acceptance.compare(far, cpu, labels) if not c.ok]
    assert failed == ["score_xgb"]
    with pytest.raises(ValueError, match="output 'score_dlrm_tf'"):
        acceptance.compare({k: v for k, v in near.items() if k != "score_dlrm_tf"}, cpu, labels)


def test_report_passes_only_when_everything_did(tmp_path):
    rng = np.random.default_rng(1)
    cpu, labels = _scores(rng), rng.integers(0, 2, 500)
    report = acceptance.Report(gpus=acceptance.parse_gpus("NVIDIA L4, 550.54.15, 23034 MiB"), ready_after_s=12.0,
                               rows=500, comparisons=[{**c.__dict__, "ok": c.ok} for c in
                                                      acceptance.compare(cpu, cpu, labels)],
                               load_test={"users": 4, "seconds": 5, "requests": 100.0, "failures": 0.0,
                                          "requests_per_s": 20.0, "p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0})
    assert report.passed
    text = report.write(tmp_path).read_text()
    assert "PASSED" in text and "NVIDIA L4" in text and "tritonserver:25.02-py3" in text
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True
    report.errors.append("TimeoutError: not ready")
    assert not report.passed and "FAILED" in report.markdown()
    assert not acceptance.Report().passed  # nothing compared is not a pass
