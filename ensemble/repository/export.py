"""Write the Triton model repository from trained artifacts.

Layout: each layout's config file per model (see :mod:`ensemble.repository.configs`), and
``<repository>/<model>/<version>/`` holding the native artifacts under the file names
both configurations' backends expect (``xgboost.json`` + ``checkpoint.tl`` for FIL, ``model.pt``
for libtorch, ``model.savedmodel/`` for TensorFlow), the shared ``model.py`` and ``manifest.json``. A new version is written
into a hidden staging folder and renamed into place, so a running server never sees half a
version; ``ranker/<release>/`` names the step versions written together.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ensemble.repository import configs, declared
from ensemble.models import manifest
from ensemble.models.manifest import RELEASE_FILE
from ensemble.models import engines
from ensemble.models.registry import COMPONENTS, Component
from ensemble.native import backend
from ensemble import schema
from ensemble.schema import Model

_LOG = logging.getLogger(__name__)
# The one model.py of every python-backend model (it only delegates to ensemble.scoring.pipeline).
MODEL_PY = Path(__file__).resolve().parents[1] / "serving" / "model.py"
# The ``rank`` model's (ranking requests over whichever ranker is served; one version, no artifacts).
RANK_MODEL_PY = Path(__file__).resolve().parents[1] / "serving" / "rank_model.py"


@dataclass(frozen=True)
class TrainedArtifacts:
    """Where training left each artifact (see :func:`ensemble.runs.training.train_all`)."""

    workflow_dir: Path
    models_dir: Path
    report: Path | None = None  # train_report.json: its held-out metrics go into the release
    # the training run's held-out rows (``valid.npz``, ``test.npz``): the DLRMs' int8 engines calibrate on
    # the validation rows and reduced precisions are judged on the test rows (ensemble.models.engines)
    held_out: Path | None = None

    @classmethod
    def under(cls, workdir: str | Path) -> "TrainedArtifacts":
        """The layout :func:`ensemble.runs.training.train_all` writes under its work folder."""
        return cls(Path(workdir) / "workflow", Path(workdir) / "models", Path(workdir) / "train_report.json",
                   Path(workdir) / engines.HELD_OUT_DIR)

    def source(self, component: Component, name: str) -> Path:
        if component.model is Model.FEATURES:
            return self.workflow_dir
        return self.models_dir / component.model.value / name

    def sources(self) -> dict[Model, list[Path]]:
        return {c.model: [self.source(c, name) for name in c.artifacts] for c in COMPONENTS}


def _next_version(model_dir: Path) -> int:
    return max(_versions(model_dir), default=0) + 1


def _publish(model_dir: Path, version: int, fill) -> Path:
    """Build a version in ``.staging-<v>`` and rename it to ``<v>`` in one step."""
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = model_dir / f".staging-{version}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    fill(staging)
    final = model_dir / str(version)
    staging.rename(final)
    return final


def _versions(model_dir: Path) -> list[int]:
    """The version folders' numbers, ascending ([] before the model's first export)."""
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()) \
        if model_dir.is_dir() else []


def _prune(model_dir: Path, keep: int, kept: dict[int, str], log: Callable[[str], None]) -> None:
    """Remove all but the newest ``keep`` versions, except those in ``kept`` (version -> why), which
    are named in one line each."""
    versions = [model_dir / str(v) for v in _versions(model_dir)]
    for old in versions[:-keep] if keep > 0 else []:
        why = kept.get(int(old.name))
        if why is not None:
            log(f"kept {model_dir.name} {old.name}: {why}")
            continue
        shutil.rmtree(old)


def export_repository(artifacts: TrainedArtifacts, repository: str | Path, keep: int = 2,
                      loaded: dict[str, dict[int, str]] | None = None,
                      log: Callable[[str], None] = _LOG.info) -> dict[Model, Path]:
    """Write every layout's configs, a new version of every model, and a new release of the
    ranker naming them; keep the newest ``keep`` versions, and every version that is declared or
    loaded.

    The release (``ranker/<r>/release.json``) is what the fused layout serves and the in-process
    pipeline loads: the step versions written together here. It is published last, so a server
    that picks up new versions never sees a release whose steps are incomplete.

    Args:
        keep: versions to keep per model, newest first, beside those kept for a reason.
        loaded: model name -> {version: why} of versions running servers report loaded (the
            command line asks the servers started on this repository); always kept, as are the
            declared release, the versions its declaration lists, an experiment's candidates and
            those releases' steps (:func:`ensemble.repository.declared.kept`).
        log: where each kept version beyond ``keep`` is named.

    Returns:
        model -> the version folder written (the ranker: the release folder).
    """
    from ensemble.features.transforms import workflow_widths

    repository = Path(repository)
    configs.write_configs(repository, widths=workflow_widths(artifacts.workflow_dir))
    retired = sorted(p.parent.name for p in repository.glob(f"*/{configs.RETIRED_CONFIG_FILE}"))
    if retired:  # an earlier export's, or an operator's: not ours to delete
        log(f"left in place: {configs.RETIRED_CONFIG_FILE} of {', '.join(retired)} (the retired per-step CPU "
            "ensemble layout's; no `ensemble serve` layout reads it)")
    written: dict[Model, Path] = {}
    with engines.held_out(artifacts.held_out):
        for component in COMPONENTS:
            _export_component(artifacts, repository, component, written)
    ranker_dir = repository / Model.RANKER.value
    versions = {m.value: int(folder.name) for m, folder in written.items()}

    release_info: dict = {"versions": versions}
    if artifacts.report is not None and artifacts.report.is_file():
        # held-out metrics of these models (`ensemble deploy` compares the blend's AUC)
        release_info["test"] = json.loads(artifacts.report.read_text()).get("test", {})

    def fill_release(staging: Path) -> None:
        (staging / RELEASE_FILE).write_text(json.dumps(release_info, indent=1, sort_keys=True))
        shutil.copy2(MODEL_PY, staging / "model.py")
        try:  # the native layout's backend, found by Triton in the version folder it serves
            shutil.copy2(backend.library(), staging / backend.FILE_NAME)
        except backend.NotBuilt:
            pass  # the python-backend layouts still serve; `ensemble serve --layout native` says why not
        manifest.write(staging, Model.RANKER)

    written[Model.RANKER] = _publish(ranker_dir, _next_version(ranker_dir), fill_release)
    rank_version = repository / schema.RANK_MODEL / "1"
    rank_version.mkdir(parents=True, exist_ok=True)
    staged = rank_version / ".model.py.tmp"
    shutil.copy2(RANK_MODEL_PY, staged)
    staged.replace(rank_version / "model.py")
    try:  # the native layout serves rank with the project's backend too
        staged = rank_version / f".{backend.FILE_NAME}.tmp"
        shutil.copy2(backend.library(), staged)
        staged.replace(rank_version / backend.FILE_NAME)
    except backend.NotBuilt:
        pass
    kept = declared.kept(repository)
    for model_name, versions in (loaded or {}).items():
        for version, why in versions.items():
            kept.setdefault(model_name, {}).setdefault(version, why)
    for release in sorted(kept.get(Model.RANKER.value, {})):  # a loaded release's steps are loaded too
        for model_name, version in declared.release_steps(repository, release).items():
            kept.setdefault(model_name, {}).setdefault(version, f"a step of release {release}")
    # the releases the count keeps (one to roll back to) keep their steps: a step model may hold more versions
    # than the ranker (an export that stopped part way left some), so the newest of each are not enough
    for release in _versions(ranker_dir)[-keep:] if keep > 0 else []:
        for model_name, version in declared.release_steps(repository, release).items():
            kept.setdefault(model_name, {}).setdefault(version, f"a step of release {release}, kept to roll back to")
    for model in written:
        _prune(repository / model.value, keep, kept.get(model.value, {}), log)
    return written


def _export_component(artifacts: TrainedArtifacts, repository: Path, component: Component,
                      written: dict[Model, Path]) -> None:
    """A new version of one model (its artifacts, finished, with model.py and the manifest)."""
    model = component.model
    model_dir = repository / model.value

    def fill(staging: Path, component=component) -> None:
        for name in component.artifacts:
            src = artifacts.source(component, name)
            if not src.exists():
                raise FileNotFoundError(f"{component.model.value}: training artifact {src} not found; train first")
            if src.is_dir():
                shutil.copytree(src, staging / name)
            else:
                shutil.copy2(src, staging / name)
        for name in component.optional:
            src = artifacts.source(component, name)
            if src.is_dir():
                shutil.copytree(src, staging / name)
            elif src.is_file():
                shutil.copy2(src, staging / name)
        if component.finish is not None:
            component.finish(staging)
        shutil.copy2(MODEL_PY, staging / "model.py")
        manifest.write(staging, component.model)

    written[model] = _publish(model_dir, _next_version(model_dir), fill)
