"""The ``mlserver`` baseline's installation and launch (its runtime: :mod:`loadtest.baselines.mlserver_runtime`).

MLServer 1.7.1 pins fastapi, starlette and prometheus-client to versions this project's other
parts do not use, so it gets a virtual environment of its own under ``build/tools/mlserver``; a
``.pth`` file there adds this project's environment after its own packages, so the runtime imports
the same ensemble code, torch, XGBoost and LiteRT the other servers run, while MLServer's pins win.

Batching is MLServer's own adaptive batching (off unless configured, as its documentation says),
set from a recorded sweep: :data:`ADAPTIVE_BATCHING`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from loadtest.perf_analyzer import ROOT, tool_pins

TOOLS = ROOT / "build" / "tools" / "mlserver"
RUNTIME = "loadtest.baselines.mlserver_runtime.RankerRuntime"
# MLServer's adaptive batching: up to this many requests per call, waiting at most this long for
# them (seconds). Its documentation leaves the values to experiment; see docs/load-testing.md.
ADAPTIVE_BATCHING = {"max_batch_size": 32, "max_batch_time": 0.001}


class MLServerError(RuntimeError):
    """MLServer could not be installed or started; the message says why."""


def python(dest: Path = TOOLS) -> Path:
    return dest / "bin" / "python"


def install(dest: Path = TOOLS, log=print) -> Path:
    """The environment's python, installing MLServer (the ``# tool: mlserver==`` pin) on first use."""
    version = tool_pins().get("mlserver")
    if version is None:
        raise MLServerError("requirements.txt has no '# tool: mlserver==' line")
    marker = dest / f".mlserver-{version}"
    if marker.is_file():
        return python(dest)
    log(f"installing MLServer {version} into {dest} (its own environment)")
    venv.EnvBuilder(with_pip=True, clear=True).create(dest)
    purelib = Path(sysconfig.get_paths()["purelib"])  # this environment's packages, after MLServer's own
    site = Path(subprocess.check_output([str(python(dest)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "zz_project_environment.pth").write_text(f"{purelib}\n")
    done = subprocess.run([str(python(dest)), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           f"mlserver=={version}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise MLServerError(f"pip could not install mlserver=={version}:\n{done.stderr[-2000:]}")
    marker.write_text(version)
    return python(dest)


def write_folder(folder: Path, repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                 threads: int = 1, batching: dict | None = None) -> Path:
    """MLServer's ``settings.json`` and the ranker's ``model-settings.json`` under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    # parallel_workers 0: inference in the server's own process (a worker pool would add a process
    # hop per request, which this baseline is meant not to have; the ranker is one model).
    (folder / "settings.json").write_text(json.dumps({
        "http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port, "parallel_workers": 0,
        "debug": False}, indent=1))
    model = folder / "ranker"
    model.mkdir(exist_ok=True)
    (model / "model-settings.json").write_text(json.dumps({
        "name": "ranker", "implementation": RUNTIME,
        "parameters": {"uri": str(Path(repository).resolve()), "extra": {"threads": threads}},
        **(ADAPTIVE_BATCHING if batching is None else batching)}, indent=1))
    return folder


def command(folder: Path, dest: Path = TOOLS) -> list[str]:
    return [str(dest / "bin" / "mlserver"), "start", str(folder)]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="install and run the mlserver baseline")
    p.add_argument("--repository", default="model_repository")
    p.add_argument("--folder", default=str(ROOT / "build" / "mlserver"))
    p.add_argument("--http-port", type=int, default=8020)
    p.add_argument("--grpc-port", type=int, default=8021)
    p.add_argument("--metrics-port", type=int, default=8022)
    p.add_argument("--no-batching", action="store_true", help="MLServer's default: no adaptive batching")
    args = p.parse_args(argv)
    install()
    folder = write_folder(Path(args.folder), Path(args.repository), args.http_port, args.grpc_port, args.metrics_port,
                          batching={} if args.no_batching else None)
    return subprocess.call(command(folder), env=environment())


if __name__ == "__main__":
    sys.exit(main())
