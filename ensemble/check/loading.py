"""Artifact checks behind ``ensemble check --target gpu``: can each GPU backend of the pinned
container read what export wrote? Each function returns problems as strings (empty: passed).

- Trees: loaded in a child process with the Treelite version that release's FIL backend links
  (installed once with ``pip install --no-deps --target`` into a cache folder, offline after),
  then GTIL's predictions compared with XGBoost's on the same rows.
- TorchScript: a TorchScript archive (not a pickled eager module), file format version within
  what the release's libtorch reads, only ``aten``/``prim`` ops (no custom-op library needed),
  forward() arguments in the order the ``<name>__<index>`` config names say, and a forward pass
  returning the configured dtype and shape.
- SavedModel: the ``serving_default`` signature has the configured input and output names,
  dtypes and shapes (the TensorFlow backend binds config names to signature keys); then, in a
  child process, TensorFlow's session-based loader (the one Triton's TensorFlow backend uses)
  loads it and runs the signature once, and its outputs must equal TensorFlow 2's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROBE = Path(__file__).with_name("treelite_probe.py")
SAVEDMODEL_PROBE = Path(__file__).with_name("savedmodel_probe.py")
# TYPE_* (model config) <-> numpy / TensorFlow dtype names.
NUMPY_DTYPES = {"TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_FP64": "float64",
                "TYPE_INT64": "int64", "TYPE_INT32": "int32", "TYPE_BOOL": "bool", "TYPE_STRING": "string"}


@dataclass(frozen=True)
class IO:
    """A config input or output: name, TYPE_* dtype, dims without the batch dimension."""

    name: str
    dtype: str
    dims: tuple[int, ...]


def cache_root() -> Path:
    return Path(os.environ.get("ENSEMBLE_CACHE_DIR", Path.home() / ".cache" / "ensemble"))


def ensure_treelite(version: str, target: Path | None = None) -> Path:
    """A folder holding ``treelite==version`` (installed on first use; no network needed after).

    ``--no-deps``: Treelite needs numpy, scipy and packaging, which this environment has.

    Raises:
        RuntimeError: pip could not install it (e.g. offline on first use).
    """
    target = Path(target) if target else cache_root() / f"treelite-{version}"
    marker = target / ".installed"
    if marker.is_file() and marker.read_text().strip() == version:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Staged next to the target so the final rename stays on one file system.
    staging = Path(tempfile.mkdtemp(prefix=f".treelite-{version}-", dir=target.parent))
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
               "--quiet", "--target", str(staging), f"treelite=={version}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"could not install treelite=={version} into {target} ({tail}); run the check once "
                           f"with access to the package index, or pass --treelite-dir")
    (staging / ".installed").write_text(version)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _python_error(stderr: str) -> str:
    """The exception line of a child's traceback and the line after it (Treelite's context)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    at = max((i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception): ", line)), default=None)
    if at is None:
        return lines[-1] if lines else "no output"
    context = lines[at + 1] if at + 1 < len(lines) and not set(lines[at + 1]) <= set("~^ ") else ""
    return f"{lines[at]} {f'(near: {context[:90]})' if context else ''}".strip()


def tree_problems(model_file: Path, model_type: str, allow_unknown: bool, xgboost_json: Path,
                  treelite_dir: Path, treelite_version: str, n_features: int, tolerance: float = 1e-5,
                  notes: list[str] | None = None) -> list[str]:
    """Load ``model_file`` with the release's Treelite and compare predictions with XGBoost's.

    ``notes`` receives the warnings Treelite printed while loading (e.g. a newer checkpoint).
    """
    if not model_file.is_file():
        return [f"{model_file.name} not found in {model_file.parent} (model_type {model_type} loads that file)"]
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.normal(0, 1.5, (256, 13)), rng.integers(1, 60, (256, n_features - 13))],
                          axis=1).astype(np.float32) if n_features > 13 else rng.normal(size=(256, n_features))
    with tempfile.TemporaryDirectory(prefix="ensemble-check-") as scratch:
        rows_file, out_file = Path(scratch) / "rows.npy", Path(scratch) / "out.npy"
        np.save(rows_file, rows.astype(np.float32))
        done = subprocess.run([sys.executable, "-I", str(PROBE), str(treelite_dir), str(model_file), model_type,
                               "true" if allow_unknown else "false", str(rows_file), str(out_file)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return [f"{model_file.name} cannot be read by Treelite {treelite_version} (what this release's FIL "
                    f"backend links), so Triton would fail to load the model: {_python_error(done.stderr)}"]
        info = json.loads(done.stdout.strip().splitlines()[-1])
        predicted = np.load(out_file)
    problems = []
    if notes is not None:
        notes.extend(info["warnings"])
    if info["treelite"] != treelite_version:
        problems.append(f"probe ran Treelite {info['treelite']} ({info['treelite_file']}), not {treelite_version}")
    if info["num_feature"] != n_features:
        problems.append(f"{model_file.name} has {info['num_feature']} features; the config's input__0 has {n_features}")
    import xgboost

    expected = xgboost.Booster(model_file=str(xgboost_json)).inplace_predict(rows)
    if predicted.shape[1] != 1:
        problems.append(f"Treelite predicts {predicted.shape[1]} values per row; the config's output is [1]")
    elif not np.allclose(predicted[:, 0], expected, atol=tolerance):
        worst = float(np.max(np.abs(predicted[:, 0] - expected)))
        problems.append(f"Treelite {treelite_version} predictions differ from XGBoost's by up to {worst:.2e}")
    return problems


def torchscript_problems(model_file: Path, inputs: list[IO], outputs: list[IO], max_file_format: int) -> list[str]:
    """Check ``model.pt`` the way the pytorch backend will use it (see module docstring)."""
    if not model_file.is_file():
        return [f"{model_file.name} not found in {model_file.parent}"]
    if not zipfile.is_zipfile(model_file):
        return [f"{model_file.name} is not a TorchScript (zip) archive"]
    with zipfile.ZipFile(model_file) as archive:
        names = archive.namelist()
        version_entry = next((n for n in names if n.endswith("/version") or n == "version"), None)
        if version_entry is None or not any("/code/" in n for n in names):
            return [f"{model_file.name} is a torch.save() pickle, not torch.jit.save() TorchScript"]
        file_format = int(archive.read(version_entry).decode().strip())
    problems = []
    if file_format > max_file_format:
        problems.append(f"TorchScript file format {file_format} is newer than libtorch reads ({max_file_format})")
    import torch

    module = torch.jit.load(str(model_file), map_location="cpu").eval()
    namespaces = {node.kind().split("::")[0] for node in module.inlined_graph.nodes()}
    if namespaces - {"aten", "prim"}:
        problems.append(f"uses ops outside aten/prim ({sorted(namespaces - {'aten', 'prim'})}): libtorch would "
                        f"need their extension library")
    arguments = [a.name for a in module.forward.schema.arguments[1:]]
    if len(arguments) != len(inputs):
        return problems + [f"forward() takes {len(arguments)} tensors ({arguments}); the config has {len(inputs)} inputs"]
    order = _argument_order(inputs, arguments)
    if isinstance(order, str):
        return problems + [order]
    batch = 4
    tensors = [None] * len(inputs)
    for io, position in zip(inputs, order):
        dtype = getattr(torch, NUMPY_DTYPES[io.dtype])
        # 1 is a valid id in every embedding table (the missing-value id); dense zeros.
        tensors[position] = torch.ones((batch, *io.dims), dtype=dtype) if dtype == torch.int64 \
            else torch.zeros((batch, *io.dims), dtype=dtype)
    with torch.inference_mode():
        result = module(*tensors)
    results = result if isinstance(result, (tuple, list)) else (result,)
    if len(results) != len(outputs):
        return problems + [f"forward() returns {len(results)} tensors; the config has {len(outputs)} outputs"]
    for io, value in zip(outputs, results):
        if str(value.dtype).replace("torch.", "") != NUMPY_DTYPES[io.dtype] or \
                tuple(value.shape) != (batch, *io.dims):
            problems.append(f"output {io.name}: forward() returns {value.dtype} {list(value.shape)[1:]}, "
                            f"config says {io.dtype} {list(io.dims)}")
    return problems


def _argument_order(inputs: list[IO], arguments: list[str]) -> list[int] | str:
    """Positions of the config inputs among forward()'s arguments, by the backend's rules."""
    if all(io.name in arguments for io in inputs):
        return [arguments.index(io.name) for io in inputs]
    positions = []
    for io in inputs:
        _, sep, index = io.name.rpartition("__")
        if not sep or not index.isdigit():
            return (f"input '{io.name}' is neither a forward() argument ({arguments}) nor <name>__<index>; "
                    f"libtorch would bind inputs by config order")
        positions.append(int(index))
    if sorted(positions) != list(range(len(inputs))):
        return f"input indices {sorted(positions)} are not 0..{len(inputs) - 1}"
    return positions


def savedmodel_problems(model_dir: Path, inputs: list[IO], outputs: list[IO], signature: str = "serving_default",
                        tensorflow_python: str | None = None, notes: list[str] | None = None) -> list[str]:
    """The SavedModel signature has the config's names, dtypes and shapes, and the session-based
    loader runs it to TensorFlow 2's outputs (:func:`session_problems`, with ``tensorflow_python``)."""
    if not (model_dir / "saved_model.pb").is_file():
        return [f"{model_dir} is not a SavedModel (no saved_model.pb)"]
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dir))
    if signature not in loaded.signatures:
        return [f"no '{signature}' signature (has {sorted(loaded.signatures)})"]
    function = loaded.signatures[signature]
    specs = {"input": function.structured_input_signature[1], "output": function.structured_outputs}
    problems = []
    for kind, ios in (("input", inputs), ("output", outputs)):
        for io in ios:
            spec = specs[kind].get(io.name)
            if spec is None:
                problems.append(f"{kind} '{io.name}' is not in the signature ({sorted(specs[kind])})")
                continue
            shape = tuple(spec.shape.as_list())
            if spec.dtype.name != NUMPY_DTYPES[io.dtype] or shape[1:] != io.dims:
                problems.append(f"{kind} '{io.name}': signature has {spec.dtype.name} {list(shape)}, "
                                f"config says {io.dtype} [-1, {', '.join(map(str, io.dims))}]")
    if problems:
        return problems
    feeds = _probe_inputs(inputs)
    expected = function(**{name: tf.constant(value) for name, value in feeds.items()})
    return session_problems(model_dir, feeds, {io.name: np.asarray(expected[io.name]) for io in outputs},
                            signature, tensorflow_python, notes=notes)


def _probe_inputs(inputs: list[IO], batch: int = 8) -> dict[str, np.ndarray]:
    """Seeded rows for a signature: floats, and ids 0/1 (inside every embedding table)."""
    rng = np.random.default_rng(0)
    return {io.name: (rng.integers(0, 2, (batch, *io.dims)) if NUMPY_DTYPES[io.dtype].startswith("int")
                      else rng.normal(0, 1, (batch, *io.dims))).astype(NUMPY_DTYPES[io.dtype]) for io in inputs}


def session_problems(model_dir: Path, feeds: dict[str, np.ndarray], expected: dict[str, np.ndarray],
                     signature: str = "serving_default", tensorflow_python: str | None = None,
                     tolerance: float = 1e-5, notes: list[str] | None = None) -> list[str]:
    """Load ``model_dir`` with TensorFlow's session-based loader in a child process and run it.

    Args:
        feeds: signature input name -> array.
        expected: signature output name -> what TensorFlow 2's loader returned for ``feeds``.
        tensorflow_python: interpreter to run the probe with (default: this one); point it at an
            environment with the serving container's TensorFlow to test that version's loader.
        notes: receives the TensorFlow version the probe ran.
    """
    with tempfile.TemporaryDirectory(prefix="ensemble-check-") as scratch:
        spec = {"signature": signature, "outputs": sorted(expected), "inputs": {}}
        for name, value in feeds.items():
            spec["inputs"][name] = str(Path(scratch) / f"in-{name}.npy")
            np.save(spec["inputs"][name], value)
        (Path(scratch) / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run([tensorflow_python or sys.executable, "-I", str(SAVEDMODEL_PROBE), str(model_dir),
                               str(Path(scratch) / "spec.json"), scratch],
                              capture_output=True, text=True, timeout=300, env=env)
        if done.returncode != 0:
            return [f"TensorFlow's session-based loader (Triton's TensorFlow backend uses it) cannot run "
                    f"{model_dir.name}; Triton would load it and fail every request: {_python_error(done.stderr)}"]
        version = json.loads(done.stdout.strip().splitlines()[-1])["tensorflow"]
        if notes is not None:
            notes.append(version)
        got = {name: np.load(Path(scratch) / f"{name}.npy") for name in expected}
    problems = []
    for name, want in expected.items():
        if got[name].shape != want.shape or not np.allclose(got[name], want, atol=tolerance):
            problems.append(f"output '{name}' from the session loader (TensorFlow {version}) differs from "
                            f"TensorFlow 2's loader")
    return problems
