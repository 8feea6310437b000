"""The release a repository's servers serve, as the last ``ensemble deploy`` or ``rollback`` declared it.

``deploy`` and ``rollback`` write ``<repository>/ranker/serving.json`` after a switch that passed its
checks; every start of a server on that repository (``ensemble serve``, a restart by the
supervisor, another replica) loads that release instead of the newest exported one. Without the
file (nothing deployed yet), or when it names a release that is no longer in the repository (export
keeps the newest ``--keep`` versions), a server serves the newest release, as before any deploy.
Exporting never changes what is declared: a new release serves only once it is deployed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ensemble.schema import Model

FILE_NAME = "serving.json"


def path(repository: str | Path) -> Path:
    return Path(repository) / Model.RANKER.value / FILE_NAME


def write(repository: str | Path, release: int, by: str) -> Path:
    """Declare ``release`` (atomically: a reader sees the old file or the new one)."""
    target = path(repository)
    tmp = target.with_name(f".{FILE_NAME}.{os.getpid()}")
    tmp.write_text(json.dumps({"release": int(release), "by": by,
                               "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    os.replace(tmp, target)
    return target


def read(repository: str | Path) -> int | None:
    """The declared release when the file names one that the repository still holds, else None."""
    try:
        release = int(json.loads(path(repository).read_text())["release"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return release if (Path(repository) / Model.RANKER.value / str(release)).is_dir() else None
