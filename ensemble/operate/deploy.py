"""Switch a running server to another release of the ranker: ``ensemble deploy`` / ``rollback``.

A release is a version of the ``ranker`` folder (``ranker/<r>/release.json`` names the step
versions exported together). In the fused layout the ranker is one Triton model whose version
is the release, so a switch is one model load: Triton loads the new version while the old one
keeps answering, then routes new requests to it and unloads the old one once its requests are
done. Every request is scored by one release's models and blender, never a mix, and none is
refused during the switch. The GPU layout, an ensemble of one model a step, cannot switch all steps
in one step, so deploy refuses it.

Before the switch a release must pass, in this process: its manifests (every file's checksum),
loading it, finite scores in [0, 1] on fresh rows, and held-out AUC not worse than the serving
release's by more than :data:`AUC_TOLERANCE` (measured on ``--holdout`` when given, else the
test AUC each release recorded at export). After the switch the served scores must equal the
in-process ones (<= 1e-5) or the previous release is put back. A release that serves is declared
(:mod:`ensemble.repository.declared`), so a server started later on the repository serves it too.

The switch goes through Triton's model-repository API (:mod:`ensemble.operate.control`, which says who
may call it), over gRPC when ``grpc_url`` is given (``ensemble deploy`` always gives it): a load over
Triton's HTTP API holds one of its HTTP threads for the whole load, and the clients whose keep-alive
connections that thread owns get no reply until it ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.data import criteo
from ensemble.features import transforms
from ensemble.features.fresh import fresh_rows
from ensemble.models import manifest
from ensemble.repository import declared
from ensemble.operate.control import Control, ControlError
from ensemble.models.registry import ORDER
from ensemble.models.manifest import MissingRelease
from ensemble.scoring.pipeline import RELEASE_FILE, Pipeline, release_versions
from ensemble.schema import Model

AUC_TOLERANCE = 0.005  # AUC points a new release may lose against the serving one (noise on ~30k rows)
PARITY_ATOL = 1e-5


class DeployError(ControlError):
    """The release was refused or the switch failed; the message says why and what serves."""


def available_releases(repository: str | Path) -> list[int]:
    folder = Path(repository) / Model.RANKER.value
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / RELEASE_FILE).is_file()) \
        if folder.is_dir() else []


def recorded_auc(repository: str | Path, release: int) -> float | None:
    try:
        info = json.loads((Path(repository) / Model.RANKER.value / str(release) / RELEASE_FILE).read_text())
    except FileNotFoundError:
        raise MissingRelease(repository, release) from None
    return info.get("test", {}).get("blend", {}).get("auc")


def _holdout_aucs(holdout: str | Path, *pipelines: Pipeline) -> list[float]:
    """Each pipeline's AUC on one labelled file (read and encoded once)."""
    from ensemble.models.metrics import auc

    frame = criteo.read_criteo([holdout])
    dense, cats, labels = transforms.dense_array(frame), transforms.encode_categorical(frame), frame[schema.LABEL].to_numpy()
    return [auc(labels, p.score(dense, cats)[schema.SCORE.name].ravel()) for p in pipelines]


def check_release(repository: str | Path, release: int, serving: int | None,
                  holdout: str | Path | None = None, log=print, compare_auc: bool = True) -> Pipeline:
    """Run the pre-switch checks; return the release's in-process pipeline, or raise DeployError.
    ``compare_auc=False`` (a rollback: the operator chose the older release) skips the AUC check."""
    repository = Path(repository)
    try:
        versions = release_versions(repository, release)
        manifest.verify(repository / Model.RANKER.value / str(release), Model.RANKER)
        for model in ORDER:
            manifest.verify(versions[model], model)
    except (FileNotFoundError, manifest.ManifestError, KeyError) as exc:
        raise DeployError(f"release {release} refused: {exc}") from exc
    log(f"release {release}: manifests OK")
    try:
        pipeline = Pipeline.from_repository(repository, threads=1, release=release)
    except Exception as exc:  # noqa: BLE001 - any load failure refuses the release
        raise DeployError(f"release {release} refused: it does not load: {type(exc).__name__}: {exc}") from exc
    scores = pipeline.score(*fresh_rows(widths=pipeline.widths))
    bad = [name for name, value in scores.items() if not (np.isfinite(value).all() and (0 <= value).all()
                                                          and (value <= 1).all())]
    if bad:
        raise DeployError(f"release {release} refused: scores outside [0, 1] or not finite in {bad}")
    log(f"release {release}: loads, scores fresh rows")
    if compare_auc and serving is not None and serving != release:
        if holdout is not None:
            new, old = _holdout_aucs(holdout, pipeline, Pipeline.from_repository(repository, threads=1, release=serving))
            source = f"on {holdout}"
        else:
            new, old = recorded_auc(repository, release), recorded_auc(repository, serving)
            source = "as recorded at export (each release's own test split)"
        if new is not None and old is not None:
            if new < old - AUC_TOLERANCE:
                raise DeployError(f"release {release} refused: held-out AUC {new:.4f} < serving release {serving}'s "
                                  f"{old:.4f} - {AUC_TOLERANCE} ({source})")
            log(f"release {release}: AUC {new:.4f} vs serving {old:.4f} ({source})")
        else:
            log(f"release {release}: no AUC to compare ({source}: not recorded); check skipped")
    return pipeline


def _served_parity(url: str, pipeline: Pipeline) -> float:
    dense, cats = fresh_rows(seed=7, widths=pipeline.widths)
    served = Control.of(url).infer(dense, cats)
    local = pipeline.score(dense, cats)
    return max(float(np.max(np.abs(served[k] - local[k].ravel()))) for k in served)


def switch_to(url: str, repository: str | Path, release: int, holdout: str | Path | None = None, log=print,
              compare_auc: bool = True, grpc_url: str | None = None) -> int:
    """Check ``release``, switch the server at ``url`` to it (loaded through ``grpc_url``, the
    server's gRPC address, when given), verify; return the serving release."""
    control = Control.of(url, grpc=grpc_url)
    config = control.config()
    layout = config.get("parameters", {}).get("layout", {}).get("string_value")
    if config.get("platform") == "ensemble" or layout != "fused":
        raise DeployError("the server does not run the fused layout: only there is a release one model that "
                          "switches at once (restart the server on the new export instead)")
    serving = control.serving_release()
    if serving == release:
        _declare(repository, release, "deploy" if compare_auc else "rollback", log)
        log(f"release {release} already serves")
        return release
    pipeline = check_release(repository, release, serving, holdout, log, compare_auc)
    log(f"switching {control.url} from release {serving} to {release}")
    control.load_release(release)
    now = control.serving_release()
    if now != release:
        raise DeployError(f"the server reports release {now} after loading {release}")
    diff = _served_parity(url, pipeline)
    if diff > PARITY_ATOL:
        if serving is not None:
            control.load_release(serving)
        raise DeployError(f"release {release}: served scores differ from in-process by {diff:.2e}; "
                          f"release {serving} put back")
    log(f"release {release} serves (served == in-process within {diff:.1e})")
    _declare(repository, release, "deploy" if compare_auc else "rollback", log)
    return release


def _declare(repository: str | Path, release: int, by: str, log) -> None:
    """Record the serving release for later server starts; a repository this process may not write
    (mounted read-only) is reported, and the switch stands."""
    try:
        where = declared.write(repository, release, by)
    except OSError as exc:
        log(f"release {release} serves but is not declared ({exc}): a server started later on this "
            "repository serves its newest release")
        return
    log(f"release {release} declared in {where}: every later start of a server on this repository loads it")


def deploy(url: str, repository: str | Path, release: int | None = None, holdout: str | Path | None = None,
           log=print, grpc_url: str | None = None) -> int:
    """Publish the newest exported release (or ``release``) to the running server."""
    releases = available_releases(repository)
    if not releases:
        raise DeployError(f"no release in {Path(repository) / Model.RANKER.value}: run `ensemble export` first")
    return switch_to(url, repository, releases[-1] if release is None else release, holdout, log, grpc_url=grpc_url)


def rollback(url: str, repository: str | Path, holdout: str | Path | None = None, log=print,
             grpc_url: str | None = None) -> int:
    """Switch back to the newest release older than the serving one (all checks but the AUC one)."""
    serving = Control.of(url).serving_release()
    older = [r for r in available_releases(repository) if serving is None or r < serving]
    if not older:
        raise DeployError(f"no release older than {serving} in {Path(repository) / Model.RANKER.value} "
                          "(export keeps the newest --keep versions)")
    return switch_to(url, repository, older[-1], holdout, log, compare_auc=False, grpc_url=grpc_url)
