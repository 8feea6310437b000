"""Per-version manifest: files with checksums, library versions, the step's tensor schema.

Written by export next to the artifacts; checked before a step is loaded (a mismatch fails
loudly instead of serving a half-copied or edited model).
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import metadata
from pathlib import Path

from ensemble import schema
from ensemble.schema import Model

MANIFEST_FILE = "manifest.json"
# A release (a version of the ranker) lists the versions of its steps in this file, beside its manifest.
RELEASE_FILE = "release.json"
LIBRARIES = ("numpy", "pyarrow", "nvtabular", "xgboost-cpu", "xgboost", "torch",
             "tensorflow-cpu", "tensorflow", "keras", "nvidia-pytriton", "tritonclient")
LOG = logging.getLogger(__name__)


class ManifestError(RuntimeError):
    """An artifact folder does not match its manifest."""


class MissingRelease(FileNotFoundError):
    """A release asked for by number that the repository does not hold (or whose ``release.json`` is gone)."""

    def __init__(self, repository: str | Path, release: int) -> None:
        folder = Path(repository) / Model.RANKER.value
        held = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / RELEASE_FILE).is_file()) \
            if folder.is_dir() else []
        super().__init__(f"release {release} is not in {folder} (it holds {', '.join(map(str, held)) or 'no release'})")
        self.release = release


def library_versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_schema(model: Model) -> dict:
    step = schema.FUSED_STEP if model is Model.RANKER else schema.STEPS[model]
    describe = lambda ts: [{"name": t.name, "dtype": t.dtype.value, "dims": list(t.dims)} for t in ts]  # noqa: E731
    return {"inputs": describe(step.inputs), "outputs": describe(step.outputs)}


# A row store's table files (ensemble.tables) carry a CRC per 4 KiB block, checked on every read: the
# manifest records their size, so a load reads no table whole (a checksum of 28 GB would).
BLOCK_CHECKED = ".rows"


def _record(path: Path) -> str:
    return f"size:{path.stat().st_size}" if path.suffix == BLOCK_CHECKED else _sha256(path)


def write(version_dir: Path, model: Model, extra: dict | None = None) -> Path:
    """Checksum every file under ``version_dir`` (except model.py and the manifest; a row store's
    block-checked table files by their size)."""
    files = {
        p.relative_to(version_dir).as_posix(): _record(p)
        for p in sorted(version_dir.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST_FILE, "model.py") and "__pycache__" not in p.parts
    }
    body = {"model": model.value, "files": files, "libraries": library_versions(),
            "schema": step_schema(model), **(extra or {})}
    path = version_dir / MANIFEST_FILE
    path.write_text(json.dumps(body, indent=1, sort_keys=True))
    return path


def verify(version_dir: Path, model: Model, remote_tables: bool = False) -> dict:
    """Raise :class:`ManifestError` unless every listed file is present and unchanged and the
    schema is the one this code serves; warn when library versions differ. ``remote_tables``: a row store's
    block-checked table files may be absent (their blocks are read from a cold tier in Redis, which checks
    each block and the table's header)."""
    path = version_dir / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{version_dir}: no {MANIFEST_FILE}; export the model repository again")
    body = json.loads(path.read_text())
    if body.get("model") != model.value:
        raise ManifestError(f"{path}: written for model '{body.get('model')}', loaded as '{model.value}'")
    if body.get("schema") != step_schema(model):
        raise ManifestError(f"{path}: tensor schema differs from this code's; export again")
    for rel, expected in body["files"].items():
        file = version_dir / rel
        if not file.is_file() and remote_tables and expected.startswith("size:"):
            continue
        if not file.is_file():
            raise ManifestError(f"{version_dir}: missing artifact {rel}")
        if _record(file) != expected:
            raise ManifestError(f"{version_dir}: {'size' if expected.startswith('size:') else 'checksum'} mismatch for {rel}")
    current = library_versions()
    for name, version in body.get("libraries", {}).items():
        if name in current and current[name] != version:
            LOG.warning("%s was exported with %s %s, loading with %s", version_dir, name, version, current[name])
    return body
