"""Which inference engine scores each DLRM step: chosen by measurement at export, recorded in the
release, stated at load.

Engines a CPU server can run from C (no Python call per request):

- ``c``: the project's forward pass (``ensemble/native/_dlrm.c``), weights read from the exported model;
- ``openvino``: OpenVINO's CPU runtime (``ensemble/native/_openvino.c``) on the step's OpenVINO IR
  (``openvino/model.xml``, converted at export from the TorchScript or TFLite model), in ``f32``, or in
  ``bf16`` where the CPU has bfloat16 instructions and the scores hold (:data:`BF16_TOLERANCE`).

At export (:func:`choose`) each engine scores random rows of the step's own tables at 1, 16, 100 and
1,000 rows, alternating, best of a few repetitions; the rule (:func:`pick`) keeps the engine whose
slowest point, against the fastest engine at that point, is the least slow. The choice, the machine
(CPU model and flags), every measurement and the parity against the framework's fp32 go into the
version folder's ``engine.json``. ``ensemble engines`` re-chooses for the machine it runs on.

At load (:func:`load`) a step builds its recorded engine; when it cannot (OpenVINO not built, the CPU
lacks bf16, the engine fails its parity check) it logs an error naming the step, the recorded and the
substitute engine, and counts it in :data:`SUBSTITUTED`; with ``ENSEMBLE_REQUIRE_ENGINE=1``
(``ensemble serve --require-engine``) it raises instead, so the model does not load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ensemble.models.openvino import (OPENVINO_DIR, OPENVINO_INT8, OPENVINO_MODEL, OpenVinoDLRM,  # noqa: F401 - the engines' names
                                      _int8_ignored, _runtime, cpu, has_bf16, openvino_module, write_int8,
                                      write_openvino)

LOG = logging.getLogger(__name__)

ENGINE_FILE = "engine.json"
ROWS = (1, 16, 100, 1000)
# The largest difference from the framework's fp32 probability a bf16 engine may show on the parity rows.
BF16_TOLERANCE = 1e-3
# The same for the fp32 engines (float32 sums in another order).
F32_TOLERANCE = 1e-5
# A reduced precision (bf16, int8) is eligible only when its held-out AUC is within this of the framework's
# fp32 (when the export has held-out rows; without them bf16 is judged by BF16_TOLERANCE, int8 not at all).
AUC_TOLERANCE = 1e-3
# At load an int8 engine only has to score random rows near the framework (its accuracy was judged on the
# held-out rows at export).
INT8_LOAD_TOLERANCE = 0.05
HELD_OUT_DIR = "held_out"  # in a training run's work folder: valid.npz and test.npz (ensemble.runs.training)
HELD_OUT_ROWS = 20000  # test rows an export scores to judge a reduced precision
CALIBRATION_ROWS = 3000  # validation rows the int8 quantization calibrates its activation ranges on
REQUIRE_ENV = "ENSEMBLE_REQUIRE_ENGINE"
REQUIRE_ENV_FORMER = "ENSEMBLE_REQUIRE_DECLARED"  # its former name, still honoured for one release
BUDGET_ENV = "ENSEMBLE_ENGINE_BUDGET"  # seconds of calls per engine and point at export (default 0.02)
# Steps that loaded an engine other than the one their release records in this process: step -> reason.
SUBSTITUTED: dict[str, str] = {}


class EngineUnavailable(RuntimeError):
    """The recorded engine cannot score here and the server was told to require it."""


def finish(staging: Path, step: str, load_scorer: Callable, budget: float | None = None) -> None:
    """At export: the OpenVINO IR beside the step's model, then the measured choice (``engine.json``).
    A model OpenVINO cannot convert keeps the other engines (logged). ``load_scorer()``: the step's scorer
    (loaded without the line a server logs: nothing is served here)."""
    from ensemble.models import dlrm_kernel

    global _QUIET
    _QUIET = True
    try:
        scorer = load_scorer()
    finally:
        _QUIET = False

    ir = Path(staging) / OPENVINO_DIR / OPENVINO_MODEL
    try:
        if not ir.is_file():
            write_openvino(staging, step)
    except Exception as exc:  # noqa: BLE001 - any converter failure: the release still exports
        LOG.warning("%s: no OpenVINO model (%s); the other engines are measured", step, exc)
    weights = scorer.weights
    if weights is None:
        LOG.warning("%s: the model's tables could not be read; the framework scores", step)
        (Path(staging) / ENGINE_FILE).write_text(json.dumps({"step": step, "engine": "framework", "precision": "f32",
                                                             "machine": cpu()}, indent=1))
        return
    limits, n_dense = dlrm_kernel.cardinalities(weights), weights.bottom[0][0].shape[0]
    calibration = _held_out_rows("valid", CALIBRATION_ROWS, n_dense, len(limits)) if ir.is_file() else None
    if calibration is not None:
        try:
            write_int8(staging, calibration[:2])
        except Exception as exc:  # noqa: BLE001 - any quantizer failure: the other engines are measured
            LOG.warning("%s: no int8 model (%s)", step, exc)
    choose(staging, step, scorer.kernel_c, scorer.framework, limits, n_dense, budget)


STEPS = ("dlrm_torch", "dlrm_tf")


def describe(folders: dict) -> list[str]:
    """One line per DLRM step of a release (``Model`` -> version folder): its recorded engine and why."""
    lines = []
    for model, folder in folders.items():
        if getattr(model, "value", model) not in STEPS:
            continue
        recorded = Recorded.read(folder)
        if recorded is None:
            lines.append(f"{model.value}: no engine recorded (a release exported before engines were recorded): "
                         "the C pass where it agrees with the framework, else the framework")
            continue
        record = recorded.record
        worst = record.get("worst_ratio", {})
        parity = record.get("parity", {}).get("max_abs_diff_vs_framework_fp32", {}).get(recorded.name)
        how = "chosen by hand" if "by hand" in record.get("rule", "") else "chosen"
        lines.append(f"{model.value}: {recorded.name}, {how} on {record.get('machine', {}).get('model', '?')} "
                     f"(measured: {', '.join(f'{e} x{r}' for e, r in worst.items())} of the fastest at its slowest point of "
                     f"{', '.join(map(str, ROWS))} rows"
                     + (f"; differs from the framework's fp32 by at most {parity:.1g}" if parity is not None else "")
                     + ")")
    return lines


_HELD_OUT: Path | None = None  # the training run's shard folder while an export runs (held_out)


@contextlib.contextmanager
def held_out(folder: Path | None):
    """While an export runs: the training run's held-out rows (``<workdir>/held_out``: ``valid.npz``
    calibrates int8, ``test.npz`` judges the reduced precisions' AUC)."""
    global _HELD_OUT
    previous, _HELD_OUT = _HELD_OUT, Path(folder) if folder is not None else None
    try:
        yield
    finally:
        _HELD_OUT = previous


def write_held_out(folder: Path, split: str, batches, rows: int) -> Path:
    """The first ``rows`` rows of a split's (dense, ids, labels) batches as ``<folder>/<split>.npz``."""
    parts, have = [], 0
    for batch in batches:
        parts.append(batch)
        have += len(batch[2])
        if have >= rows:
            break
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{split}.npz"
    arrays = [np.concatenate([p[k] for p in parts])[:rows] if parts else np.zeros(0) for k in range(3)]
    np.savez(path, dense=arrays[0], ids=arrays[1], labels=arrays[2])
    return path


def _held_out_rows(split: str, rows: int, n_dense: int, n_ids: int):
    """Up to ``rows`` rows of a held-out split as (dense, ids, labels), or None (none at hand, of other
    widths than the model's, or of one class only)."""
    path = _HELD_OUT / f"{split}.npz" if _HELD_OUT is not None else None
    if path is None or not path.is_file():
        return None
    with np.load(path) as archive:
        dense, ids, labels = archive["dense"][:rows], archive["ids"][:rows], archive["labels"][:rows]
    if dense.ndim != 2 or dense.shape[1] != n_dense or ids.shape[1] != n_ids or len(np.unique(labels)) < 2:
        LOG.warning("held-out rows in %s do not fit this model; reduced precisions are judged without them", path)
        return None
    return np.ascontiguousarray(dense, np.float32), np.ascontiguousarray(ids, np.int64), labels


@dataclass(frozen=True)
class Recorded:
    """What ``engine.json`` says: the engine and precision, and the record behind the choice."""

    engine: str
    precision: str
    record: dict

    @property
    def name(self) -> str:
        return self.engine if self.engine == "c" else f"{self.engine}-{self.precision}"

    @classmethod
    def read(cls, model_dir: Path) -> "Recorded | None":
        path = Path(model_dir) / ENGINE_FILE
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        return cls(record["engine"], record.get("precision", "f32"), record)


def attach(model_dir: Path, step: str, weights, framework: Callable):
    """A DLRM scorer's engines at load: (the C pass when it reproduces the framework, else None; the engine
    that scores; the text the server logs, announced). ``weights``: the model's weights as the C pass reads
    them (None: it declined the model's graph)."""
    from ensemble.models import dlrm_kernel

    if not dlrm_kernel.available():
        LOG.warning("%s: the C forward pass is not built, or this CPU lacks AVX2+FMA", step)
    kernel = dlrm_kernel.checked(weights, framework, step) if dlrm_kernel.available() else None
    limits = dlrm_kernel.cardinalities(weights) if weights is not None else None
    n_dense = weights.bottom[0][0].shape[0] if weights is not None else 0
    engine, text = load(Path(model_dir), step, kernel, framework, limits, n_dense)
    announce(step, text)
    return kernel, engine, text


def per_row_us(engines: dict[str, Callable], dense: np.ndarray, ids: np.ndarray, repeats: int,
               budget: float) -> dict[str, float]:
    """Microseconds per row of each engine on these rows: calls for ``budget`` seconds, engines alternating,
    best of ``repeats``."""
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(repeats):
        for name, f in engines.items():
            f(dense, ids)
            calls, start = 0, time.perf_counter()
            while True:
                f(dense, ids)
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= budget:
                    break
            best[name] = min(best[name], elapsed / calls / len(dense) * 1e6)
    return best


def _inputs(limits: np.ndarray, n_dense: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, max(int(limit), 1), rows) for limit in limits], axis=1).astype(np.int64)
    return rng.normal(size=(rows, n_dense)).astype(np.float32), ids


def candidates(model_dir: Path, kernel, limits: np.ndarray, n_dense: int, machine: dict) -> dict[str, Callable]:
    """name -> f(dense, ids) for every engine that runs here on this step."""
    found: dict[str, Callable] = {}
    if kernel is not None:
        found["c"] = kernel
    if _runtime() is not None and (Path(model_dir) / OPENVINO_DIR / OPENVINO_MODEL).is_file():
        for precision in ("f32", "bf16") if has_bf16(machine) else ("f32",):
            try:
                found[f"openvino-{precision}"] = OpenVinoDLRM(model_dir, precision, limits, n_dense, threads=1)
            except RuntimeError as exc:
                LOG.warning("openvino %s does not compile this model here (%s)", precision, exc)
        if (Path(model_dir) / OPENVINO_DIR / OPENVINO_INT8).is_file():
            try:
                found["openvino-int8"] = OpenVinoDLRM(model_dir, "int8", limits, n_dense, threads=1)
            except RuntimeError as exc:
                LOG.warning("openvino int8 does not compile this model here (%s)", exc)
    return found


def measure(engines: dict[str, Callable], limits: np.ndarray, n_dense: int, budget: float,
            repeats: int = 3) -> dict[str, dict[int, float]]:
    """Microseconds per row of each engine at each of :data:`ROWS`, best of ``repeats``, alternating."""
    times = {name: {} for name in engines}
    for rows in ROWS:
        dense, ids = _inputs(limits, n_dense, rows, rows)
        for name, us in per_row_us(engines, dense, ids, repeats, budget).items():
            times[name][rows] = round(us, 3)
    return times


def pick(times: dict[str, dict[int, float]], eligible: list[str]) -> tuple[str, dict[str, float]]:
    """The eligible engine whose worst ratio to the fastest eligible engine, over the measured batch
    sizes, is the smallest (ties: the order of ``eligible``); and every engine's worst ratio."""
    fastest = {rows: min(times[e][rows] for e in eligible) for rows in ROWS}
    worst = {e: round(max(times[e][rows] / fastest[rows] for rows in ROWS), 3) for e in eligible}
    return min(eligible, key=lambda e: (worst[e], eligible.index(e))), worst


def choose(model_dir: Path, step: str, kernel, framework: Callable, limits: np.ndarray, n_dense: int,
            budget: float | None = None) -> dict:
    """Measure the engines that run here on this step, pick one, write ``engine.json``; return the record."""
    model_dir = Path(model_dir)
    machine = cpu()
    budget = float(os.environ.get(BUDGET_ENV, "0.02")) if budget is None else budget
    engines = candidates(model_dir, kernel, limits, n_dense, machine)
    dense, ids = _inputs(limits, n_dense, 512, 7)
    reference = np.asarray(framework(dense, ids), np.float32).reshape(-1)
    test = _held_out_rows("test", HELD_OUT_ROWS, n_dense, len(limits))
    held = {}
    if test is not None:
        from ensemble.models import metrics

        t_dense, t_ids, labels = test
        fp32 = _scores(framework, t_dense, t_ids)
        held = {"rows": len(labels), "auc_framework_fp32": metrics.auc(labels, fp32)}
    parity, eligible = {}, []
    for name, f in engines.items():
        gap = float(np.abs(np.asarray(f(dense, ids)).reshape(-1) - reference).max())
        parity[name] = gap
        reduced = name.endswith(("bf16", "int8"))
        if test is not None:
            scores = _scores(f, t_dense, t_ids)
            held[name] = {"auc": metrics.auc(labels, scores), "max_abs_diff": float(np.abs(scores - fp32).max())}
        if not reduced:
            ok = gap <= F32_TOLERANCE
        elif test is not None:
            ok = abs(held[name]["auc"] - held["auc_framework_fp32"]) <= AUC_TOLERANCE
        else:  # no held-out rows: bf16 by its score bound on random rows, int8 not at all
            ok = name.endswith("bf16") and gap <= BF16_TOLERANCE
        if ok:
            eligible.append(name)
    times = measure({n: engines[n] for n in eligible}, limits, n_dense, budget) if eligible else {}
    chosen, worst = pick(times, eligible) if eligible else ("framework", {})
    engine, _, precision = chosen.partition("-")
    record = {"step": step, "engine": engine, "precision": precision or "f32", "machine": machine,
              "rule": "the engine whose slowest point against the fastest engine at that point is the least slow",
              "us_per_row": times, "worst_ratio": worst,
              "parity": {"rows": len(reference), "max_abs_diff_vs_framework_fp32": parity,
                         "bounds": {"f32": F32_TOLERANCE, "bf16": BF16_TOLERANCE, "auc": AUC_TOLERANCE},
                         "held_out": held or "none at hand (bf16 judged on random rows; int8 not eligible)"},
              "openvino": _runtime().version() if _runtime() is not None else None}
    (model_dir / ENGINE_FILE).write_text(json.dumps(record, indent=1))
    LOG.info("%s: recorded engine %s (%s)", step, chosen, ", ".join(f"{e} worst x{r}" for e, r in worst.items()))
    return record


def _scores(f: Callable, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(f(dense[s:s + 4096], ids[s:s + 4096]), np.float32).reshape(-1)
                           for s in range(0, len(dense), 4096)])


_QUIET = False  # set while an export loads a step to measure it


def announce(step: str, text: str) -> None:
    """The line a server's log shows for each DLRM step it loads (stderr: Triton's log)."""
    if _QUIET:
        return
    print(f"ensemble: {step} scores with {text}", file=sys.stderr, flush=True)


def load(model_dir: Path, step: str, kernel, framework: Callable, limits: np.ndarray | None, n_dense: int,
         threads: int = 2):
    """The engine that scores ``step`` here: its recorded one when it runs and agrees with the framework,
    else the C kernel (when checked) or None (the framework), said loudly. Returns (engine or None, text)."""
    recorded = Recorded.read(model_dir)
    if recorded is None:
        return kernel, "c (no engine recorded: the release predates engine.json)" if kernel is not None else \
            "framework (no engine recorded, no C kernel)"
    reason = None
    if recorded.engine == "c":
        if kernel is not None:
            return kernel, "c (recorded)"
        reason = "the C forward pass is not built for this CPU or declined the model"
    elif recorded.engine == "openvino":
        if _runtime() is None:
            reason = "OpenVINO's C runtime is not built into this install"
        elif recorded.precision not in ("f32", "bf16", "int8"):
            reason = f"this install does not know the precision {recorded.precision!r}"
        elif recorded.precision == "bf16" and not has_bf16():
            reason = "this CPU has no bfloat16 instructions"
        elif limits is None:
            reason = "the model's tables could not be read"
        else:
            try:
                engine = OpenVinoDLRM(model_dir, recorded.precision, limits, n_dense, threads)
                dense, ids = _inputs(limits, n_dense, 64, 11)
                gap = float(np.abs(engine(dense, ids).reshape(-1) - np.asarray(framework(dense, ids)).reshape(-1)).max())
                bound = {"bf16": BF16_TOLERANCE, "int8": INT8_LOAD_TOLERANCE}.get(recorded.precision, F32_TOLERANCE)
                if gap <= bound:
                    return engine, f"{recorded.name} (recorded; measured on {recorded.record['machine']['model']})"
                reason = f"it differs from the framework by {gap:.2g} (bound {bound:g})"
            except (RuntimeError, ValueError, OSError) as exc:
                reason = f"it did not load ({exc})"
    elif recorded.engine == "framework":
        return None, "framework (recorded: no C-callable engine reads this model)"
    else:
        reason = f"unknown engine {recorded.engine!r}"
    substitute = "c" if kernel is not None else "framework"
    message = f"{step}: the recorded engine {recorded.name} cannot score here: {reason}; {substitute} scores instead"
    if os.environ.get(REQUIRE_ENV) == "1" or os.environ.get(REQUIRE_ENV_FORMER) == "1":
        raise EngineUnavailable(message + f" ({REQUIRE_ENV}=1: refusing to load)")
    LOG.error(message)
    SUBSTITUTED[step] = reason
    return kernel, f"{substitute} (SUBSTITUTED: {reason})"


def set_engine(folders: dict, step: str, name: str) -> dict:
    """Choose ``name`` (``c``, ``openvino-f32``, ``openvino-bf16`` or ``framework``) for ``step`` by hand,
    keeping the record of the last measurement (``ensemble engines --choose STEP=ENGINE``): for an operator
    who wants, say, fp32 where bf16 measured faster. The step's manifest is written again."""
    from ensemble.models import manifest
    from ensemble.schema import Model

    if step not in STEPS:
        raise ValueError(f"{step}: engines are recorded for {', '.join(STEPS)}")
    engine, _, precision = name.partition("-")
    if engine not in ("c", "openvino", "framework") or (engine == "openvino") != bool(precision) or \
            precision not in ("", "f32", "bf16", "int8"):
        raise ValueError(f"{name}: one of c, openvino-f32, openvino-bf16, openvino-int8, framework")
    folder = folders[Model(step)]
    manifest.verify(folder, Model(step))
    record = (Recorded.read(folder).record if Recorded.read(folder) else {"step": step, "machine": cpu()})
    record.update(engine=engine, precision=precision or "f32", rule="chosen by hand (ensemble engines --choose)")
    (Path(folder) / ENGINE_FILE).write_text(json.dumps(record, indent=1))
    manifest.write(folder, Model(step))
    return record

