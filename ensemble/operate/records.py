"""Where running servers and fleets record themselves, and what the servers on a repository hold.

Every tritonserver that :class:`ensemble.operate.server.TritonServer` starts writes a record
(``server-<pid>.json`` in :func:`run_dir`: its process, repository and HTTP address) and removes it
when it stops; a fleet writes its own (:mod:`ensemble.fleet.release`). ``ensemble export`` reads the
servers' records to keep every version a running server on the same repository reports loaded
(:func:`loaded_versions`): a model version a server holds is never removed under it. The record of
a process that has ended does not count.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

RUN_DIR_ENV = "ENSEMBLE_RUN_DIR"
ASK_TIMEOUT = 2.0  # seconds a server has to answer one readiness question


def run_dir() -> Path:
    """``$ENSEMBLE_RUN_DIR``, else a folder of this user's in the temporary directory."""
    return Path(os.environ.get(RUN_DIR_ENV) or Path(tempfile.gettempdir()) / f"ensemble-{os.getuid()}")


def _server_path(pid: int) -> Path:
    return run_dir() / f"server-{pid}.json"


def record_server(pid: int, repository: str | Path, http_url: str) -> None:
    """Record a started tritonserver (best effort: a server whose record cannot be written still serves)."""
    path = _server_path(pid)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"pid": pid, "repository": str(Path(repository).resolve()), "http": http_url}) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def forget_server(pid: int) -> None:
    _server_path(pid).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def servers_on(repository: str | Path) -> list[dict]:
    """The records of live servers started on ``repository``; records of ended processes are removed."""
    wanted = str(Path(repository).resolve())
    found = []
    for path in sorted(run_dir().glob("server-*.json")) if run_dir().is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not alive(pid):
            path.unlink(missing_ok=True)
            continue
        if record.get("repository") == wanted:
            found.append(record)
    return found


def _ready(http_url: str, model: str, version: int) -> bool:
    base = http_url if "://" in http_url else f"http://{http_url}"
    try:
        with urllib.request.urlopen(f"{base}/v2/models/{model}/versions/{version}/ready", timeout=ASK_TIMEOUT) as reply:
            return reply.status == 200
    except urllib.error.HTTPError:
        return False


def loaded_versions(repository: str | Path) -> dict[str, dict[int, str]]:
    """model name -> {version: why} for every version in ``repository`` that a live server started
    on it reports ready. A server that does not answer keeps every version (it may hold any)."""
    repository = Path(repository)
    on_disk = {folder.name: sorted(int(v.name) for v in folder.iterdir() if v.is_dir() and v.name.isdigit())
               for folder in repository.iterdir() if folder.is_dir()} if repository.is_dir() else {}
    found: dict[str, dict[int, str]] = {}
    for record in servers_on(repository):
        where = f"tritonserver {record['pid']} at {record['http']}"
        held: dict[str, dict[int, str]] = {}
        try:
            for model, versions in on_disk.items():
                for version in versions:
                    if _ready(record["http"], model, version):
                        held.setdefault(model, {})[version] = f"loaded by {where}"
        except (urllib.error.URLError, OSError):
            held = {model: {v: f"{where} did not answer: it may hold it" for v in versions}
                    for model, versions in on_disk.items()}
        for model, versions in held.items():
            for version, why in versions.items():
                found.setdefault(model, {}).setdefault(version, why)
    return found
