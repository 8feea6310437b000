"""Write the Triton model repository from trained artifacts.

Layout: ``<repository>/<model>/config.pbtxt`` (CPU), ``<repository>/<model>/configs/gpu.pbtxt``
(GPU) and ``<repository>/<model>/<version>/`` holding the native artifacts under the file names
both configurations' backends expect (``xgboost.json`` + ``checkpoint.tl`` for FIL, ``model.pt``
for libtorch, ``model.savedmodel/`` for TensorFlow), the shared ``model.py`` and ``manifest.json``. A new version is written
into a hidden staging folder and renamed into place, so a running server never sees half a
version.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ensemble import configs, manifest
from ensemble.models import blend, dlrm_tf, dlrm_torch, xgb
from ensemble.schema import Model

MODEL_PY = Path(__file__).with_name("triton_model.py")


@dataclass(frozen=True)
class TrainedArtifacts:
    """Where training left each artifact (see :func:`ensemble.train.train_all`)."""

    workflow_dir: Path
    models_dir: Path

    def sources(self) -> dict[Model, list[Path]]:
        m = self.models_dir
        return {
            Model.FEATURES: [self.workflow_dir],
            Model.XGB: [m / "xgb" / xgb.MODEL_FILE],
            Model.DLRM_TORCH: [m / "dlrm_torch" / dlrm_torch.MODEL_FILE],
            Model.DLRM_TF: [m / "dlrm_tf" / dlrm_tf.MODEL_DIR],
            Model.BLEND: [m / "blend" / blend.MODEL_FILE],
        }


def _next_version(model_dir: Path) -> int:
    existing = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()] \
        if model_dir.is_dir() else []
    return max(existing, default=0) + 1


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


def _prune(model_dir: Path, keep: int) -> None:
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                      key=lambda p: int(p.name))
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def export_repository(artifacts: TrainedArtifacts, repository: str | Path, keep: int = 2,
                      spec: configs.RepositorySpec = configs.RepositorySpec()) -> dict[Model, Path]:
    """Write configs and a new version of every model; keep the newest ``keep`` versions.

    Returns:
        model -> the version folder written.
    """
    repository = Path(repository)
    configs.write_configs(repository, spec)
    written: dict[Model, Path] = {}
    for model, sources in artifacts.sources().items():
        model_dir = repository / model.value

        def fill(staging: Path, model=model, sources=sources) -> None:
            for src in sources:
                if not src.exists():
                    raise FileNotFoundError(f"{model.value}: training artifact {src} not found; train first")
                target = staging / ("workflow" if model is Model.FEATURES else src.name)
                if src.is_dir():
                    shutil.copytree(src, target)
                else:
                    shutil.copy2(src, target)
            if model is Model.XGB:  # the file the GPU configuration's FIL backend loads
                xgb.write_fil_checkpoint(staging)
            shutil.copy2(MODEL_PY, staging / "model.py")
            manifest.write(staging, model)

        written[model] = _publish(model_dir, _next_version(model_dir), fill)
        _prune(model_dir, keep)
    ranker_dir = repository / Model.RANKER.value
    if _next_version(ranker_dir) == 1:  # an ensemble needs one (empty) version folder
        (ranker_dir / "1").mkdir(parents=True, exist_ok=True)
    written[Model.RANKER] = ranker_dir / "1"
    return written
