"""The release a repository's servers serve, as the last ``ensemble deploy`` or ``rollback`` declared it.

``deploy`` and ``rollback`` write ``<repository>/ranker/serving.json`` after a switch that passed its
checks; every start of a server on that repository (``ensemble serve``, a restart by the
supervisor, another replica) loads that release instead of the newest exported one. Without the
file (nothing deployed yet) a server serves the newest release. A file that names a release the
repository no longer holds is an operator's declaration that cannot be kept: :func:`read` raises
:class:`DeclaredMissing` (naming the release and the fix) and a server refuses to start rather than
serve a release nobody deployed. Exporting never changes what is declared, and never deletes what is
declared (:func:`kept`): a new release serves only once it is deployed.

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

from ensemble.models.manifest import RELEASE_FILE
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


class DeclaredMissing(RuntimeError):
    """``serving.json`` names a release the repository does not hold (or cannot be read)."""


def _record(repository: str | Path) -> dict | None:
    """The file's content; None when there is no file. Raises :class:`DeclaredMissing` when it
    cannot be read as a declaration."""
    target = path(repository)
    try:
        text = target.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DeclaredMissing(f"{target} cannot be read ({exc.strerror}); fix its permissions, or remove it "
                              "to serve the newest release") from exc
    try:
        record = json.loads(text)
        int(record["release"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DeclaredMissing(f"{target} is not a declaration ({text[:60]!r}); declare a release with "
                              f"`ensemble declare --repository {repository} --release N`, or remove the file "
                              "to serve the newest release") from exc
    return record


def _present(repository: str | Path) -> list[int]:
    folder = Path(repository) / Model.RANKER.value
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()) if folder.is_dir() else []


def read(repository: str | Path) -> int | None:
    """The declared release; None when nothing is declared (the newest serves).

    Raises:
        DeclaredMissing: the file names a release the repository does not hold, or is not a
            declaration; the message names the release and how to fix it.
    """
    record = _record(repository)
    if record is None:
        return None
    release = int(record["release"])
    if not (Path(repository) / Model.RANKER.value / str(release)).is_dir():
        by = f" by {record['by']}" if record.get("by") else ""
        at = f" at {record['at']}" if record.get("at") else ""
        raise DeclaredMissing(
            f"release {release}, declared{by}{at} in {path(repository)}, is not in the repository "
            f"(it holds {', '.join(map(str, _present(repository))) or 'no release'}); restore it, or declare one "
            f"that is there: `ensemble declare --repository {repository} --release N` (`--clear` serves the newest)")
    return release


def experiment(repository: str | Path) -> Experiment | None:
    """The declared experiment, when the repository still holds every candidate; else None.

    Raises:
        DeclaredMissing: as :func:`read`.
    """
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


def versions(repository: str | Path) -> list[int] | None:
    """The versions a server on ``repository`` loads: the declared release and any other the
    declaration lists that the repository still holds; None when nothing is declared.

    Raises:
        DeclaredMissing: as :func:`read`.
    """
    release = read(repository)
    if release is None:
        return None
    try:
        listed = [int(v) for v in json.loads(path(repository).read_text()).get("versions", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        listed = []
    folder = Path(repository) / Model.RANKER.value
    return sorted({release} | {v for v in listed if (folder / str(v)).is_dir()})


def kept(repository: str | Path) -> dict[str, dict[int, str]]:
    """What export must not remove, with why: model name -> {version: reason}.

    The declared release, every version the declaration lists (a fleet's release in progress) and
    every experiment candidate, whether or not the repository still holds them; and each of those
    releases' step versions (their ``release.json``). A declaration that cannot be read keeps
    nothing more than the files do (export never rewrites it).
    """
    try:
        record = _record(repository)
    except DeclaredMissing:
        return {}
    if record is None:
        return {}
    found: dict[str, dict[int, str]] = {}
    ranker = found.setdefault(Model.RANKER.value, {})
    try:
        ranker[int(record["release"])] = "the declared release"
        for r, _ in (record.get("experiment") or {}).get("arms") or ():
            ranker.setdefault(int(r), "an experiment's candidate")
        for v in record.get("versions") or ():
            ranker.setdefault(int(v), "listed by the declaration (a release across a fleet)")
    except (ValueError, TypeError, AttributeError):
        pass
    for release in sorted(ranker):
        steps = release_steps(repository, release)
        for model, version in steps.items():
            found.setdefault(model, {}).setdefault(version, f"a step of release {release}")
    return found


def release_steps(repository: str | Path, release: int) -> dict[str, int]:
    """model name -> step version that ``release``'s ``release.json`` names ({} when unreadable)."""
    try:
        listed = json.loads((Path(repository) / Model.RANKER.value / str(release) / RELEASE_FILE).read_text())["versions"]
        return {str(m): int(v) for m, v in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
