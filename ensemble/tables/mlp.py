"""A row store DLRM's MLPs: the bottom MLP, the pairwise interaction and the top MLP over rows already
gathered, as their engines run them.

Training leaves ``mlp.npz`` beside the framework's model (the weights in the C pass's layout, read from
the framework's own layers); the engines take ``(dense [B x n_dense], pooled [B x F*dim])``:

- ``c``: the C forward pass (``ensemble/native/_dlrm.c``, its ``forward_pooled``): the same kernels as for
  a DLRM with its tables, the tables' gather replaced by the gathered rows;
- ``openvino-f32`` / ``openvino-int8``: OpenVINO's CPU runtime on the framework model's IR with the
  gathered rows as its second input (``ensemble/native/_openvino.c``; int8 quantized by nncf, the
  interaction and the layer reading it kept as they are, as :mod:`ensemble.models.engines` does).

:func:`choose` measures them at export (1, 16, 100 and 1,000 rows, alternating) and writes the choice
to ``engine.json`` with the rule of :func:`ensemble.models.engines.pick`; a reduced precision is
eligible only when its held-out AUC is within :data:`ensemble.models.engines.AUC_TOLERANCE` of fp32.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ensemble.models.artifacts import MLP_WEIGHTS as MLP_FILE

LOG = logging.getLogger(__name__)
POOLED_INPUT = "pooled"  # the framework models' name for the gathered rows' input


@dataclass(frozen=True)
class MlpWeights:
    """The MLPs in the C pass's layout: per layer (weights [in x out], bias [out]) float32, and the
    interaction's pairs (vector 0: the bottom MLP's output, c + 1: table c's row)."""

    bottom: tuple[tuple[np.ndarray, np.ndarray], ...]
    top: tuple[tuple[np.ndarray, np.ndarray], ...]
    pair_i: np.ndarray
    pair_j: np.ndarray
    n_tables: int
    dim: int

    @property
    def n_dense(self) -> int:
        return int(self.bottom[0][0].shape[0])

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MLP_FILE
        arrays = {"pair_i": self.pair_i, "pair_j": self.pair_j, "shape": np.array([self.n_tables, self.dim])}
        for k, (w, b) in enumerate(self.bottom):
            arrays[f"bottom{k}_w"], arrays[f"bottom{k}_b"] = w, b
        for k, (w, b) in enumerate(self.top):
            arrays[f"top{k}_w"], arrays[f"top{k}_b"] = w, b
        np.savez(path, **arrays)
        return path

    @classmethod
    def load(cls, folder: Path) -> "MlpWeights":
        with np.load(Path(folder) / MLP_FILE) as data:
            layers = lambda part: tuple((np.ascontiguousarray(data[f"{part}{k}_w"], np.float32),  # noqa: E731
                                         np.ascontiguousarray(data[f"{part}{k}_b"], np.float32))
                                        for k in range(sum(1 for n in data.files if n.startswith(part) and n.endswith("_w"))))
            n_tables, dim = (int(v) for v in data["shape"])
            return cls(layers("bottom"), layers("top"), np.ascontiguousarray(data["pair_i"], np.int32),
                       np.ascontiguousarray(data["pair_j"], np.int32), n_tables, dim)

    @classmethod
    def lower_triangle(cls, bottom, top, n_tables: int, dim: int) -> "MlpWeights":
        """DLRM's pairs: every (i, j) with j < i among the 1 + n_tables vectors, row by row."""
        rows, cols = np.tril_indices(n_tables + 1, k=-1)
        return cls(tuple(bottom), tuple(top), rows.astype(np.int32), cols.astype(np.int32), n_tables, dim)

    def c_engine(self):
        """The C pass over these weights (a ``_dlrm.Weights`` whose table is never read: the rows come
        gathered)."""
        from ensemble.native import _dlrm

        table = np.zeros((self.n_tables, self.dim), np.float32)
        offsets = np.arange(self.n_tables, dtype=np.int64)
        weights = _dlrm.Weights(self.bottom, table, offsets, self.pair_i, self.pair_j, self.top)
        return _Held(weights, (self.bottom, table, offsets, self.pair_i, self.pair_j, self.top))

    def score(self, dense: np.ndarray, pooled: np.ndarray) -> np.ndarray:
        """Probabilities [B] of rows already gathered (pooled [B x F*dim] or [B x F x dim]), in numpy:
        the reference the engines are checked against."""
        x = np.asarray(dense, np.float64)
        for w, b in self.bottom:
            x = np.maximum(x @ w + b, 0)
        vectors = np.concatenate([x[:, None, :], np.asarray(pooled, np.float64).reshape(len(x), self.n_tables, self.dim)],
                                 axis=1)
        products = np.einsum("bid,bjd->bij", vectors, vectors)
        x = np.concatenate([x, products[:, self.pair_i, self.pair_j]], axis=1)
        for k, (w, b) in enumerate(self.top):
            x = x @ w + b
            if k < len(self.top) - 1:
                x = np.maximum(x, 0)
        return (1 / (1 + np.exp(-x))).reshape(-1).astype(np.float32)


class _Held:
    """A ``_dlrm.Weights`` with the arrays it points into kept alive beside it."""

    def __init__(self, native, arrays):
        self.native, self._arrays = native, arrays

    def __call__(self, dense: np.ndarray, pooled: np.ndarray) -> np.ndarray:
        out = np.empty(len(dense), np.float32)
        self.native.pooled(np.ascontiguousarray(dense, np.float32), np.ascontiguousarray(pooled, np.float32), out)
        return out


class OpenVinoMlp:
    """OpenVINO on a pooled DLRM's IR: ``native`` is the ``_openvino.Engine`` a row store's DLRM calls."""

    def __init__(self, path: Path, precision: str, n_tables: int, dim: int, n_dense: int, threads: int = 2):
        from ensemble.models import engines

        ov = engines.openvino_module()
        inputs = ov.Core().read_model(str(path)).inputs
        dense_index = next(k for k, port in enumerate(inputs) if POOLED_INPUT not in port.get_any_name())
        hint = ("bf16" if engines.has_bf16() else "f32") if precision == "int8" else precision
        self.precision = precision
        limits = np.full(n_tables, 1, np.int64)  # the model takes gathered rows, not ids: no table to check
        self.native = engines._runtime().Engine(str(path), hint, limits, n_dense, dense_index, threads, n_tables * dim)
        self._dim, self._tables = dim, n_tables

    def __call__(self, dense: np.ndarray, pooled: np.ndarray) -> np.ndarray:
        out = np.empty(len(dense), np.float32)
        self.native.pooled(np.ascontiguousarray(dense, np.float32),
                           np.ascontiguousarray(pooled, np.float32).reshape(len(dense), self._tables * self._dim), out)
        return out


def write_openvino(framework_path: Path, out: Path, kind: str, n_dense: int, width: int) -> Path:
    """The pooled model's OpenVINO IR: from TorchScript (``kind`` torch) or TFLite (``kind`` tf), inputs
    (dense [B x n_dense], pooled [B x width]) with any batch."""
    from ensemble.models import engines

    ov = engines.openvino_module()
    if kind == "torch":
        import torch

        module = torch.jit.load(str(framework_path)).eval()
        model = ov.convert_model(module, example_input=(torch.zeros(2, n_dense), torch.zeros(2, width)))
    else:
        model = ov.convert_model(str(framework_path))
    ports = list(model.inputs)
    named = [k for k, port in enumerate(ports) if any(POOLED_INPUT in n for n in port.get_names())]
    pooled = named[0] if named else 1  # TorchScript's inputs come in forward()'s order: (dense, pooled)
    model.reshape({ports[k]: [-1, width if k == pooled else n_dense] for k in range(len(ports))})
    ports[pooled].get_tensor().set_names({POOLED_INPUT})  # as OpenVinoMlp finds it
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out), compress_to_fp16=False)
    return out


def write_int8(ir: Path, out: Path, calibration: tuple[np.ndarray, np.ndarray]) -> Path:
    """The pooled IR quantized to int8 by nncf, calibrated on (dense, pooled) rows, the operators
    :func:`ensemble.models.engines._int8_ignored` names (the interaction, the layer reading it) as they are."""
    import re

    import nncf

    from ensemble.base.console import framework_info_quieted
    from ensemble.models import engines

    ov = engines.openvino_module()
    model = ov.Core().read_model(str(ir))
    names = [port.get_any_name() for port in model.inputs]
    pooled_index = next(k for k, name in enumerate(names) if POOLED_INPUT in name)
    dense, pooled = calibration

    def feed(start: int) -> dict:
        rows = slice(start, start + 100)
        return {names[1 - pooled_index]: dense[rows], names[pooled_index]: pooled[rows]}

    nncf.set_log_level(logging.WARNING)
    with framework_info_quieted(re.compile(r"━|^\s*\d+ \S+\s*$")):
        quantized = nncf.quantize(model, nncf.Dataset(list(range(0, len(dense), 100)), feed),
                                  subset_size=-(-len(dense) // 100),
                                  ignored_scope=nncf.IgnoredScope(names=engines._int8_ignored(model)))
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    return out


def measure(engines: dict[str, Callable], n_dense: int, width: int, rows=(1, 16, 100, 1000),
            budget: float = 0.02, seed: int = 0) -> dict[str, dict[int, float]]:
    """Microseconds a row of each engine at each row count (best of its repeats within ``budget``
    seconds), alternating engines at each point."""
    rng = np.random.default_rng(seed)
    times: dict[str, dict[int, float]] = {name: {} for name in engines}
    for n in rows:
        dense = rng.normal(size=(n, n_dense)).astype(np.float32)
        pooled = rng.uniform(-0.05, 0.05, size=(n, width)).astype(np.float32)
        best = {name: float("inf") for name in engines}
        deadline = time.perf_counter() + budget * len(engines)
        while True:
            for name, f in engines.items():
                start = time.perf_counter()
                f(dense, pooled)
                best[name] = min(best[name], (time.perf_counter() - start) / n * 1e6)
            if time.perf_counter() > deadline:
                break
        for name in engines:
            times[name][n] = best[name]
    return times


def choose(folder: Path, step: str, weights: MlpWeights, candidates: dict[str, Callable],
            aucs: dict[str, float], budget: float = 0.02) -> dict:
    """Measure the eligible engines and write ``engine.json``; returns its record."""
    from ensemble.models import engines

    reference = aucs.get("c")
    eligible = [name for name in candidates
                if not name.endswith("int8") or (reference is not None and name in aucs
                                                 and abs(aucs[name] - reference) <= engines.AUC_TOLERANCE)]
    times = measure({n: candidates[n] for n in eligible}, weights.n_dense, weights.n_tables * weights.dim,
                    budget=budget)
    chosen, worst = engines.pick(times, eligible)
    name, _, precision = chosen.partition("-")
    record = {"step": step, "engine": name, "precision": precision or "f32", "pooled": True,
              "machine": engines.cpu(), "rows": list(times[chosen]), "us_per_row": times, "worst_ratio": worst,
              "held_out_auc": aucs, "rule": "the engine whose slowest point is the least slow against the fastest there"}
    (Path(folder) / engines.ENGINE_FILE).write_text(json.dumps(record, indent=1, default=str))
    return record
