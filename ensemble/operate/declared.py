"""The release a repository's servers serve, as the last ``ensemble deploy`` or ``rollback`` declared it.

``deploy`` and ``rollback`` write ``<repository>/ranker/serving.json`` after a switch that passed its
checks; every start of a server on that repository (``ensemble serve``, a restart by the
supervisor, another replica) loads that release instead of the newest exported one. Without the
file (nothing deployed yet), or when it names a release that is no longer in the repository (export
keeps the newest ``--keep`` versions), a server serves the newest release, as before any deploy.
Exporting never changes what is declared: a new release serves only once it is deployed.

During a release across a fleet (:mod:`ensemble.fleet.release`) the file also lists the versions
every replica must hold (the serving release and the one being switched to), so a replica that
starts in the middle of the switch can answer for either. During an experiment
(:mod:`ensemble.fleet.experiment`) it also records the candidates and their shares: a replica that
restarts loads them, and a fleet that restarts routes to them again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ensemble.schema import Model

FILE_NAME = "serving.json"


def path(repository: str | Path) -> Path:
    return Path(repository) / Model.RANKER.value / FILE_NAME


def write(repository: str | Path, release: int, by: str, versions: list[int] | None = None,
          experiment: Experiment | None = None) -> Path:
    """Declare ``release`` and the ``versions`` a server loads (default: that release alone), and
    the ``experiment`` under way (its candidates are loaded too), atomically: a reader sees the old
    file or the new one."""
    target = path(repository)
    tmp = target.with_name(f".{FILE_NAME}.{os.getpid()}")
    loaded = sorted({int(v) for v in versions or ()} | {int(release)}
                    | {r for r, _ in (experiment.arms if experiment else ())})
    record = {"release": int(release), "versions": loaded, "by": by,
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if experiment is not None:
        record["experiment"] = {"arms": [[r, p] for r, p in experiment.arms], "key": experiment.key,
                                "shadow": experiment.shadow, "started": experiment.started}
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, target)
    return target


@dataclass(frozen=True)
class Experiment:
    """An experiment beside the declared release: ``arms`` are the candidates, ``(release,
    percent of requests)`` each; ``key``: the request header whose value keeps a request's arm
    (None: each request's arm is drawn at random); ``shadow``: percent of the serving release's
    requests the candidates score too; ``started``: when (UTC, ISO 8601)."""

    arms: tuple[tuple[int, float], ...]
    key: str | None = None
    started: str = ""
    shadow: float = 0.0


def experiment(repository: str | Path) -> Experiment | None:
    """The declared experiment, when the declared release is valid and the repository still holds
    every candidate; else None."""
    if read(repository) is None:
        return None
    try:
        found = json.loads(path(repository).read_text()).get("experiment")
        if not found:
            return None
        arms = tuple((int(r), float(p)) for r, p in found["arms"])
        key = found.get("key") or None
        started = str(found.get("started", ""))
        shadow = float(found.get("shadow") or 0.0)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    folder = Path(repository) / Model.RANKER.value
    if not arms or any(not (folder / str(r)).is_dir() for r, _ in arms):
        return None
    return Experiment(arms, key, started, shadow)


def read(repository: str | Path) -> int | None:
    """The declared release when the file names one that the repository still holds, else None."""
    try:
        release = int(json.loads(path(repository).read_text())["release"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return release if (Path(repository) / Model.RANKER.value / str(release)).is_dir() else None


def versions(repository: str | Path) -> list[int] | None:
    """The versions a server on ``repository`` loads: the declared release and any other the
    declaration lists that the repository still holds; None when nothing valid is declared."""
    release = read(repository)
    if release is None:
        return None
    try:
        listed = [int(v) for v in json.loads(path(repository).read_text()).get("versions", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        listed = []
    folder = Path(repository) / Model.RANKER.value
    return sorted({release} | {v for v in listed if (folder / str(v)).is_dir()})
