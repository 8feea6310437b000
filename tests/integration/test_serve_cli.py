"""`ensemble serve`: binds loopback, waits until ready, stops cleanly on SIGTERM/SIGINT, and
exits non-zero with the server's log tail when the server cannot start."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ensemble.operate import allocator, processes
from ensemble.base.machine import free_port


def _serve(repository, *extra):
    ports = [free_port() for _ in range(3)]
    cmd = [sys.executable, "-m", "ensemble", "serve", "--repository", str(repository),
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), ports


def _server_pid(serve: subprocess.Popen, http_port: int) -> int:
    """The tritonserver ``ensemble serve`` started on ``http_port`` (its command line names the port)."""
    return next(iter(processes.arguments_ending(serve.pid, f"--http-port={http_port}")))


def _metric_families(metrics_port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


# Latency summaries: off by default (Triton's own default), on when asked for or when quantiles are given.
@pytest.mark.parametrize("sig, extra, summaries", [(signal.SIGTERM, (), False),
                                                   (signal.SIGINT, ("--latency-quantiles", "0.5:0.05,0.99:0.01"), True)],
                         ids=["sigterm-default", "sigint-quantiles"])
def test_serve_until_signal(trained, sig, extra, summaries):
    proc, ports = _serve(trained.repository, *extra)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        assert f"127.0.0.1:{ports[0]}" in line
        preloaded = allocator.library(allocator.Allocator.AUTO)  # tcmalloc when this machine has it
        assert proc.stdout.readline().rstrip().endswith(f"allocator: {preloaded or 'the system' + chr(39) + 's'}")
        maps = Path(f"/proc/{_server_pid(proc, ports[0])}/maps").read_text()
        assert ("libtcmalloc" in maps) == (preloaded is not None)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/models/ranker/ready", timeout=5) as reply:
            assert reply.status == 200
        families = _metric_families(ports[2])
        assert {"nv_inference_request_success", "nv_inference_request_duration_us"} <= families
        assert ("nv_inference_request_summary_us" in families) == summaries, sorted(families)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=2)


def test_serve_fails_with_log_tail(trained, tmp_path):
    broken = tmp_path / "repo"
    shutil.copytree(trained.repository, broken)
    (broken / "blend" / "1" / "blend.json").write_text("{}")  # no longer matches its manifest
    proc, _ = _serve(broken)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "checksum mismatch" in err and "blend" in err


def test_serve_refuses_an_allocator_it_cannot_find(trained, monkeypatch):
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    from ensemble.operate.server import ServerError, ServerOptions, TritonServer

    with pytest.raises(ServerError, match=allocator.PACKAGE):
        TritonServer(ServerOptions(trained.repository, http_port=free_port(), grpc_port=free_port(),
                                   metrics_port=free_port(), allocator=allocator.Allocator.TCMALLOC)).start()
    assert allocator.library(allocator.Allocator.AUTO) is None  # then auto runs on the system's allocator
    assert allocator.preloaded({"LD_PRELOAD": "x.so"}, allocator.Allocator.AUTO) == {"LD_PRELOAD": "x.so"}

