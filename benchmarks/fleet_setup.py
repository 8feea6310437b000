"""What the fleet benchmarks share: a private copy of a repository with releases exported into it, and
``ensemble serve --replicas N`` started on it as a subprocess, with its run directory set for the
``ensemble`` commands this process runs (deploy, experiment) to find it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ensemble.base.machine import free_port


def private_repository(repository: str | Path, workdirs: list[str | Path], prefix: str,
                       serve_newest: bool = True) -> tuple[Path, Path, list[int]]:
    """(scratch folder, a copy of ``repository`` in it, the releases exported into the copy from each
    of ``workdirs`` in turn). The copy declares its newest release before those exports, or with
    ``serve_newest=False`` the first one exported (what a fleet started on it serves)."""
    from ensemble.repository import declared
    from ensemble.operate.deploy import available_releases
    from ensemble.repository.export import TrainedArtifacts, export_repository

    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    copy = scratch / "repository"
    shutil.copytree(repository, copy)
    declared.path(copy).unlink(missing_ok=True)
    if serve_newest:
        declared.write(copy, available_releases(copy)[-1], prefix)
    exported = []
    for workdir in workdirs:
        export_repository(TrainedArtifacts.under(Path(workdir)), copy, keep=len(workdirs) + 2)
        exported.append(available_releases(copy)[-1])
        if not serve_newest and len(exported) == 1:
            declared.write(copy, exported[0], prefix)
    return scratch, copy, exported


@dataclass
class ServedFleet:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int  # replica i serves its metrics on this port + i
    env: dict
    log: list[str]

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def record(self):
        """The fleet's record (ensemble.fleet.release.find), or None when it did not start."""
        from ensemble.fleet import release as fleet_release

        return fleet_release.find(self.gateway)


def serve_fleet(repository: Path, replicas: int, scratch: Path) -> ServedFleet:
    """``ensemble serve --replicas N`` on ``repository``, once it says it is ready (or has ended)."""
    from ensemble.operate import records

    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    env = {**os.environ, records.RUN_DIR_ENV: str(scratch / "run")}
    ensemble = str(Path(sys.executable).parent / "ensemble")
    process = subprocess.Popen([ensemble, "serve", "--repository", str(repository), "--replicas", str(replicas),
                                "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                                "--metrics-port", str(metrics_port), "--log-file", str(scratch / "logs" / "triton.log")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    log: list[str] = []
    for line in process.stdout:
        log.append(line.rstrip())
        if line.startswith("ready:") or process.poll() is not None:
            break
    threading.Thread(target=lambda: [log.append(line.rstrip()) for line in process.stdout], daemon=True).start()
    os.environ[records.RUN_DIR_ENV] = env[records.RUN_DIR_ENV]
    return ServedFleet(process, http_port, grpc_port, metrics_port, env, log)
