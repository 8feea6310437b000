"""Serving-time objects: one step per Triton model, and the whole chain in-process.

The Triton ``model.py`` (see :mod:`ensemble.serving.model`) and the in-process
:class:`Pipeline` load steps through :func:`load_step`, so the served ensemble and the
reference pipeline run the same code on the same artifacts.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ensemble import native, schema
from ensemble.base.device import Device
from ensemble.models import artifacts, manifest
from ensemble.models.manifest import RELEASE_FILE, MissingRelease  # noqa: F401 - RELEASE_FILE: where a release lists its steps' versions
from ensemble.models.registry import BY_MODEL, ORDER, Layout
from ensemble.schema import Model

LOG = logging.getLogger(__name__)


class BadInput(ValueError):
    """A request whose tensors do not match the step's contract."""


@dataclass(frozen=True)
class StepRunner:
    """A composing model: named numpy inputs -> named numpy outputs for one batch."""

    step: schema.Step
    fn: Callable[..., object]

    def validate(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Check names, ranks, widths and dtypes; return the batch size."""
        sizes = set()
        for tensor, dtype in self._expected:
            if tensor.name not in inputs:
                raise BadInput(f"missing input '{tensor.name}'")
            array = inputs[tensor.name]
            if array.ndim != 1 + len(tensor.dims) or array.shape[1:] != tensor.dims:
                raise BadInput(f"input '{tensor.name}' has shape {list(array.shape)}, "
                               f"expected [batch, {', '.join(map(str, tensor.dims))}]")
            if array.dtype != dtype:
                if dtype.kind == "O":
                    raise BadInput(f"input '{tensor.name}' must be strings (BYTES)")
                raise BadInput(f"input '{tensor.name}' has dtype {array.dtype}, "
                               f"expected {tensor.dtype.numpy}")
            sizes.add(array.shape[0])
        if len(sizes) > 1:
            raise BadInput(f"inputs have different batch sizes: {sorted(sizes)}")
        return sizes.pop()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        input_names, outputs_typed = self._plan
        result = self.fn(*(inputs[name] for name in input_names))
        outputs = result if isinstance(result, tuple) else (result,)
        return {name: np.asarray(o, dtype=dtype) for (name, dtype), o in zip(outputs_typed, outputs)}

    @functools.cached_property
    def _expected(self) -> tuple[tuple[schema.Tensor, np.dtype], ...]:
        """Each input and the numpy dtype it must have (object for strings), looked up once."""
        return tuple((t, np.dtype(object if t.dtype is schema.DType.STRING else t.dtype.numpy)) for t in self.step.inputs)

    @functools.cached_property
    def _plan(self) -> tuple[tuple[str, ...], tuple[tuple[str, np.dtype], ...]]:
        """Input names and (output name, numpy dtype) pairs, looked up once: this runs per request."""
        return (tuple(t.name for t in self.step.inputs),
                tuple((t.name, np.dtype(t.dtype.numpy)) for t in self.step.outputs))


def workflow_widths(features_version_dir: str | Path) -> schema.Widths:
    """The input widths of the dataset a features version was fitted on."""
    from ensemble.features import transforms

    return transforms.workflow_widths(Path(features_version_dir) / artifacts.WORKFLOW)


def load_step(model: Model | str, version_dir: str | Path, threads: int = 1,
              layout: Layout | str = Layout.NATIVE, device: Device | str = Device.CPU,
              widths: schema.Widths | None = None) -> StepRunner:
    """Verify a version folder against its manifest and load its step.

    Args:
        layout: which tensors the step reads and writes (``Layout.GPU``: ``schema.GPU_STEPS``;
            set by the ``layout`` parameter of the model's config).
        device: where the step computes (see :mod:`ensemble.base.device`).
        widths: the dataset's input widths (None: the features step's own workflow, else Criteo's).
    """
    from ensemble.tables.serving import cold_is_remote

    component = BY_MODEL[Model(model)]
    layout, version_dir = Layout(layout), Path(version_dir)
    manifest.verify(version_dir, component.model, remote_tables=cold_is_remote())
    if widths is None:
        widths = workflow_widths(version_dir) if component.model is Model.FEATURES else schema.CRITEO_WIDTHS
    fn = component.load(version_dir, threads, Device(device))
    return StepRunner(schema.sized(component.step(layout), widths), component.adapt(fn, layout, widths.dense))


def latest_version(model_dir: Path) -> Path:
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    if not versions:
        raise FileNotFoundError(f"no version folder in {model_dir}")
    return max(versions, key=lambda p: int(p.name))


def release_versions(repository: str | Path, release: int | None = None) -> dict[Model, Path]:
    """The version folder of every step in a release (default: the newest).

    A release is a version of the ``ranker`` folder whose ``release.json`` names the step
    versions exported together (the blender was fitted on exactly those models' scores).
    Repositories written before releases existed fall back to each step's newest version.
    """
    repository = Path(repository)
    ranker = repository / Model.RANKER.value
    folder = ranker / str(release) if release is not None else None
    if folder is None:
        try:
            folder = latest_version(ranker)
        except FileNotFoundError:
            folder = None
    if folder is not None and (folder / RELEASE_FILE).is_file():
        versions = json.loads((folder / RELEASE_FILE).read_text())["versions"]
        return {m: repository / m.value / str(versions[m.value]) for m in ORDER}
    if release is not None:
        raise MissingRelease(repository, release)
    return {m: latest_version(repository / m.value) for m in ORDER}


class Pipeline:
    """The ranker's chain in one process: features -> three models -> blend.

    The reference for parity tests, the ``--local`` path, and what the fused layout's single
    python-backend model runs. It loads one release of the repository Triton serves.
    """

    # Batches of at least this many rows split one level's work (the three models) over two
    # threads. On the CPU by rows: every model scores the first half of the rows on the calling
    # thread and the second half on a worker thread (the trees' 3.4 us a row against both DLRMs'
    # 6 us made a split by model uneven: 8,192-row batches ran at 6.4-7.9 us a row that way and
    # 4.8-5.0 split by rows, two cores, build VM). On a GPU by model: the trees on one thread, the
    # DLRMs on the other, each with the whole batch. The C kernels, torch and TFLite release the
    # GIL while they compute. Below this size the ~50 us hand-off to a thread costs more than it
    # saves (1 row: 0.02-0.2 ms per model).
    PARALLEL_MIN_ROWS = 32

    def __init__(self, steps: Mapping[Model, StepRunner], parallel: bool | None = None,
                 widths: schema.Widths | None = None, device: Device = Device.CPU, chain: bool = True):
        """``parallel``: None (default) = when this process may run on more than one core;
        ``widths``: the dataset's (with its context's), else read from the features step;
        ``device``: where the steps compute (decides how a level is split over the threads);
        ``chain``: whether batches may go through :attr:`kernel_chain` (False: always step by step,
        what the chain is checked against)."""
        self.steps = dict(steps)
        self._use_chain = chain
        self._widths = widths
        self._row_split = device is Device.CPU
        self._levels = _levels([self.steps[m] for m in ORDER])
        self._pool = None
        if parallel is None:  # the cores this process may run on (Linux), else the machine's
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            parallel = cores > 1
        self._parallel = parallel and any(len(level) > 1 for level in self._levels)

    @classmethod
    def from_repository(cls, repository: str | Path, threads: int = 2,
                        device: Device | str = Device.CPU, release: int | None = None) -> "Pipeline":
        """Load every step of a release (default: the newest); ``device="gpu"`` runs the trees
        (FIL or XGBoost CUDA) and the torch DLRM on the GPU (``ensemble.base.device.resolve_device``
        maps ``auto``)."""
        folders = release_versions(repository, release)
        widths = workflow_widths(folders[Model.FEATURES])
        device = Device(device)
        return cls({m: load_step(m, folder, threads, device=device, widths=widths) for m, folder in folders.items()},
                   widths=widths, device=device)

    @property
    def parallel(self) -> bool:
        """Whether batches of :attr:`PARALLEL_MIN_ROWS` rows or more are split over two threads."""
        return self._parallel

    @property
    def widths(self) -> schema.Widths:
        """The dataset's input widths (the features step's inputs) and its context's."""
        if self._widths is not None:
            return self._widths
        features = self.steps[Model.FEATURES].step
        dense, categorical = features.inputs
        ids = next((t.dims[0] for t in features.outputs if t.name == schema.CATEGORY_IDS.name), 0)
        return schema.Widths(dense.dims[0], categorical.dims[0], category_ids=ids)

    def rank(self, context_dense, context_categorical, candidate_dense, candidate_categorical,
             k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """What the ``rank`` model answers, in process: (order best first, every candidate's score)."""
        from ensemble.scoring import ranking

        widths = self.widths
        dense, categorical = ranking.broadcast(context_dense, context_categorical, candidate_dense,
                                               candidate_categorical, (widths.context_dense, widths.context_categorical))
        scores = self.score(dense, categorical)[schema.SCORE.name].reshape(-1)
        return ranking.top(scores, k), scores

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 100, 1024)) -> None:
        """Score all-missing rows once per batch size: the first calls of TorchScript, TFLite and
        the trees cost milliseconds (graph optimization, allocation), which a model should pay
        at load rather than on its first requests. 1,024 rows also takes the trees' XGBoost path."""
        for rows in batch_sizes:
            self.score(np.full((rows, self.widths.dense), np.nan, np.float32),
                       np.full((rows, self.widths.categorical), b"", dtype=object))

    def close(self) -> None:
        """End the worker thread (a pipeline unloaded from a long-lived process, e.g. Triton's)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __call__(self, dense: np.ndarray, categorical: np.ndarray) -> tuple[np.ndarray, ...]:
        """The ranker's outputs in ``schema.RANKER_OUTPUTS`` order (the fused model's step)."""
        scores = self.score(dense, categorical)
        return tuple(scores[t.name] for t in schema.RANKER_OUTPUTS)

    def score(self, dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
        """Score a batch.

        Args:
            dense: [B x 13] float32 raw integer features (NaN = missing).
            categorical: [B x 26] object array of bytes (b"" = missing).

        Returns:
            ``score`` and the per-model scores, each [B x 1] float32, keyed by tensor name.
        """
        tensors: dict[str, np.ndarray] = {schema.DENSE.name: np.asarray(dense, np.float32),
                                          schema.CATEGORICAL.name: np.asarray(categorical, object)}
        return self._run(tensors, self._levels)

    @functools.cached_property
    def reads_wire(self):
        """The features step's transform when it can take a request's categorical strings as Triton's
        BYTES wire buffer (:meth:`ensemble.features.transforms.LeanTransform.ids_from_wire`) and
        the chain after it reads only its two outputs, else None."""
        features = self.steps.get(Model.FEATURES)
        transform = getattr(features, "fn", None)
        if (not getattr(transform, "reads_wire", False) or len(self._levels[0]) != 1 or self._levels[0][0] is not features
                or [t.name for t in features.step.outputs] != [schema.DENSE_FEATURES.name, schema.CATEGORY_IDS.name]):
            return None
        return transform

    def score_ids(self, dense: np.ndarray, category_ids: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`score` for rows whose categorical values were already looked up (:attr:`reads_wire`'s
        ``ids_from_wire``): the same outputs for the same rows."""
        transform = self.reads_wire
        tensors = {schema.DENSE_FEATURES.name: transform.transform_dense(dense), schema.CATEGORY_IDS.name: category_ids}
        return self._run(tensors, self._levels[1:])

    def score_wire(self, dense: np.ndarray, wire: bytes, rows: int) -> dict[str, np.ndarray]:
        """:meth:`score` for rows whose categorical values come as Triton's BYTES wire buffer (row-major),
        scored as the native backend scores a call: by the chain in C when it is built here, else by
        looking the strings up from the buffer, else from the strings. Each output flat, [rows] float32."""
        dense = np.ascontiguousarray(dense, np.float32)
        chain = self.c_chain
        if chain is not None:
            out = np.empty((len(schema.RANKER_OUTPUTS), rows), np.float32)
            split = self._parallel and rows >= self.PARALLEL_MIN_ROWS
            chain.score(((dense, wire, rows),), out, 2 if split else 1)
            return {t.name: out[k] for k, t in enumerate(schema.RANKER_OUTPUTS)}
        transform = self.reads_wire
        if transform is not None:
            scores = self.score_ids(dense, transform.ids_from_wire(wire, rows))
        else:
            strings = np.empty(rows * self.widths.categorical, dtype=object)
            strings[:] = native.split_wire(wire)
            scores = self.score(dense, strings.reshape(rows, -1))
        return {name: value.reshape(-1) for name, value in scores.items()}

    @functools.cached_property
    def kernel_chain(self):
        """The models and the blend as direct kernel calls (:class:`ensemble.scoring.chain.KernelChain`),
        which score every batch (each half on its own thread when a batch is split), when every model
        has its C kernel here and the chain gives the steps' own scores on a sample batch, bit for
        bit; else None (the steps run). Built on first use."""
        from ensemble.features.transforms import FIRST_ID  # ids below it (reserved) are in every table
        from ensemble.scoring.chain import KernelChain

        if (not self._use_chain or not self._row_split or len(self._levels) != 3
                or [s.step.model for s in self._levels[0]] != [Model.FEATURES]):
            return None
        chain = KernelChain.of(self.steps, self.widths.dense)
        if chain is None:
            return None
        rng = np.random.default_rng(0)
        sample = {schema.DENSE_FEATURES.name: rng.normal(size=(37, self.widths.dense)).astype(np.float32),
                  schema.CATEGORY_IDS.name: rng.integers(0, FIRST_ID, (37, self.widths.ids)).astype(np.int64)}
        expected = self._run(dict(sample), self._levels[1:], chain=False)
        try:
            got = chain(sample[schema.DENSE_FEATURES.name], sample[schema.CATEGORY_IDS.name])
        except (ValueError, TypeError) as exc:
            LOG.warning("the kernel chain could not run (%s); the steps score", exc)
            return None
        if any(not np.array_equal(got[name], value) for name, value in expected.items()):
            LOG.warning("the kernel chain's scores differ from the steps'; the steps score")
            return None
        return chain

    @functools.cached_property
    def c_chain(self):
        """The whole chain in C from raw dense values and Triton's BYTES wire buffers
        (:meth:`ensemble.scoring.chain.KernelChain.native`), which the native backend scores plain calls
        with, when it builds here and gives :meth:`chain_scores`' outputs bit for bit on a sample of
        random, edge-case and in-vocabulary rows, whole on one thread and in parts on two; else None.
        Built on first use."""
        transform, chain = self.reads_wire, self.kernel_chain
        compiled = chain.native(transform) if transform is not None and chain is not None else None
        if compiled is None:
            return None
        dense, wire, rows = _check_rows(transform, self.widths)
        expected = self.chain_scores(dense, transform.ids_from_wire(wire, rows))
        whole, halves = np.empty_like(expected), np.empty_like(expected)
        dense_bytes = dense.tobytes()
        half, values = rows // 2, [bytes(v) for v in native.split_wire(wire)]
        columns = len(values) // rows
        try:
            compiled.score(((dense_bytes, wire, rows),), whole)
            compiled.score(((dense[:half].tobytes(), native.join_wire(values[:half * columns]), half),
                            (dense[half:].tobytes(), native.join_wire(values[half * columns:]), rows - half)), halves,
                           2)
        except ValueError as exc:
            LOG.warning("the chain in C could not run (%s); calls are scored through Python", exc)
            return None
        if not (np.array_equal(whole, expected) and np.array_equal(halves, expected)):
            LOG.warning("the chain in C does not give the Python chain's scores; calls are scored through Python")
            return None
        return compiled

    def _run(self, tensors: dict[str, np.ndarray], levels: list[list[StepRunner]], chain: bool = True) -> dict[str, np.ndarray]:
        parallel = self._parallel and len(next(iter(tensors.values()))) >= self.PARALLEL_MIN_ROWS
        for level in levels:
            if chain and level is self._levels[1] and self.kernel_chain is not None:  # the blend's level too
                tensors.update((self._split_rows(self._chained, tensors) if parallel else self._chained(tensors))[0])
                break
            if parallel and len(level) > 1:
                if self._row_split:
                    outputs = self._split_rows(lambda part, level=level: [step.run(part) for step in level], tensors)
                else:
                    pending = [self._worker().submit(step.run, tensors) for step in level[1:]]
                    outputs = [level[0].run(tensors), *(f.result() for f in pending)]
            else:
                outputs = [step.run(tensors) for step in level]
            for out in outputs:
                tensors.update(out)
        return {t.name: tensors[t.name] for t in schema.RANKER_OUTPUTS}

    def chain_scores(self, dense: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        """:meth:`score_ids` through :attr:`kernel_chain` (which must exist), as one [outputs x B]
        float32 array in ``schema.RANKER_OUTPUTS`` order; a batch :meth:`score_ids` would split over
        two threads is split the same way."""
        x = self.reads_wire.transform_dense(dense)
        chain = self.kernel_chain
        if not (self._parallel and len(x) >= self.PARALLEL_MIN_ROWS):
            return chain.scores(x, category_ids)
        half = _half(len(x))
        later = self._worker().submit(chain.scores, x[half:], category_ids[half:])
        early = chain.scores(x[:half], category_ids[:half])
        return np.concatenate((early, later.result()), axis=1)

    def _chained(self, tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [self.kernel_chain(tensors[schema.DENSE_FEATURES.name], tensors[schema.CATEGORY_IDS.name])]

    def _worker(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, "pipeline-step")
        return self._pool

    def _split_rows(self, run: Callable[[dict], list[dict[str, np.ndarray]]],
                    tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """``run`` on the first half of the rows here and on the second half on the worker thread,
        outputs joined in row order (each row's score does not depend on its batch)."""
        half = _half(len(next(iter(tensors.values()))))
        first = {k: v[:half] for k, v in tensors.items()}
        second = {k: v[half:] for k, v in tensors.items()}
        later = self._worker().submit(run, second)
        early = run(first)
        return [{k: np.concatenate((a[k], b[k])) for k in a} for a, b in zip(early, later.result())]


def _check_rows(transform, widths: schema.Widths, rows: int = 61) -> tuple[np.ndarray, bytes, int]:
    """Rows to check a chain on: raw dense values from ordinary counts to every kind of odd float (NaN,
    infinities, negatives, huge, tiny, subnormal, negative zero), and categorical values from each
    column's vocabulary, unseen or empty. ([rows x dense] float32, their BYTES wire buffer, rows)."""
    rng = np.random.default_rng(11)
    odd = np.array([np.nan, np.inf, -np.inf, -1.0, -0.0, 0.0, 0.5, 1e-45, 1e-38, 3.0e38, 1e30, -1e9, 2.0**24 + 1],
                   np.float32)
    dense = np.where(rng.random((rows, widths.dense)) < 0.3, rng.choice(odd, (rows, widths.dense)),
                     np.expm1(rng.uniform(0, 12, (rows, widths.dense))).round()).astype(np.float32)
    dense[1::7] = rng.uniform(-3, 3, (len(dense[1::7]), widths.dense)).astype(np.float32)  # fractional values
    columns = len(transform.lookups)
    from ensemble.features.transforms import lookup_examples

    known = [lookup_examples(lookup) for lookup in transform.lookups]
    values = []
    for i in range(rows * columns):
        pick = rng.random()
        seen = known[i % columns]
        values.append(seen[int(rng.integers(len(seen)))] if pick < 0.6 and seen
                      else b"" if pick < 0.7 else b"%08x" % int(rng.integers(2**32)))
    return dense, native.join_wire(values), rows


def _half(rows: int) -> int:
    """Where a batch split over two threads is cut: about half, in whole groups of the trees' 16 lanes."""
    return (rows // 2 + 15) // 16 * 16


def _levels(steps: list[StepRunner]) -> list[list[StepRunner]]:
    """Group steps (in a valid order) into levels: a step's level is one past the deepest step
    whose outputs it reads, so the steps of one level are independent of each other."""
    level_of: dict[str, int] = {}
    levels: list[list[StepRunner]] = []
    for step in steps:
        level = max((level_of[t.name] + 1 for t in step.step.inputs if t.name in level_of), default=0)
        if level == len(levels):
            levels.append([])
        levels[level].append(step)
        level_of.update({t.name: level for t in step.step.outputs})
    return levels


def refuse_row_stores(version_dir: str | Path, model: str, layout: str) -> None:
    """Raise when a python-backend layout is asked to serve a DLRM whose tables are a row store's
    (:mod:`ensemble.tables`): only the native layout reads them (from C, without the interpreter's lock)."""
    from ensemble.tables.files import has_tables

    version_dir = Path(version_dir)
    if model == Model.RANKER.value:
        folders = release_versions(version_dir.parent.parent, int(version_dir.name))
    else:
        folders = {Model(model): version_dir} if model in {m.value for m in Model} else {}
    stored = [m.value for m, folder in folders.items() if m in (Model.DLRM_TORCH, Model.DLRM_TF) and has_tables(folder)]
    if stored:
        raise RuntimeError(f"{version_dir}: {' and '.join(stored)} keep their embedding tables in a row store (tables "
                           f"larger than memory), which the {layout} layout cannot serve; serve this release with the "
                           "native layout: ensemble serve --layout native")


def load_fused(version_dir: str | Path, threads: int = 1) -> StepRunner:
    """The fused layout's ranker: the whole chain as one step, for the release in ``version_dir``
    (``<repository>/ranker/<release>``)."""
    version_dir = Path(version_dir)
    pipeline = Pipeline.from_repository(version_dir.parent.parent, threads, release=int(version_dir.name))
    pipeline.warm_up()
    return StepRunner(schema.sized(schema.FUSED_STEP, pipeline.widths), pipeline)


def wire_runner(fused: StepRunner) -> StepRunner | None:
    """The fused ranker taking its categorical input as int64 ids, looked up in place from Triton's
    BYTES wire buffer (``fused.fn.reads_wire.ids_from_wire``), for a backend that has the buffer;
    None when this release's features need Python per value (hashed or multi-hot columns). Same
    outputs for the same rows as ``fused``, without a bytes object per value."""
    pipeline = fused.fn
    if not isinstance(pipeline, Pipeline) or pipeline.reads_wire is None:
        return None
    dense, categorical = fused.step.inputs
    ids = schema.Tensor(categorical.name, schema.DType.INT64, categorical.dims)
    def scores(dense_rows: np.ndarray, category_ids: np.ndarray) -> tuple[np.ndarray, ...]:
        outputs = pipeline.score_ids(dense_rows, category_ids)
        return tuple(outputs[t.name] for t in schema.RANKER_OUTPUTS)

    return StepRunner(schema.Step(fused.step.model, (dense, ids), fused.step.outputs), scores)


def deserialize_bytes(buffer) -> np.ndarray:
    """Triton's BYTES wire format -> 1-D object array of ``bytes``.

    The python backend turns every BYTES input into numpy through
    ``triton_python_backend_utils.deserialize_bytes_tensor``, a loop that formats a struct
    string per element: 1.2 ms for the 2,600 strings of a 100-row request here, the largest
    single cost of such a request in the fused model. :func:`ensemble.native.split_wire` does
    the same in C (or a leaner Python loop); ``model.py`` installs this in place of the original.
    """
    values = native.split_wire(buffer)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def model_parameters(model_config_json: str) -> dict[str, str]:
    """``parameters`` of a Triton model config (as the python backend passes it) -> dict."""
    config = json.loads(model_config_json)
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
