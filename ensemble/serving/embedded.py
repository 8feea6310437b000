"""The fused ranker inside Triton's own process: what the ``native`` backend (``ensemble/native/backend.c``,
built as ``libtriton_native.so``) calls in the interpreter it embeds.

A call is scored on one of two paths. The requests the backend finds plain (each input in its served
type and width, in one buffer; bulk ones included) it plans and scores in C with no Python call,
through the objects :attr:`RankerModel.plain` hands it: the chain in C (checked at load against the
step-by-step pipeline, to the bit) and the compiled admission policy. Every other request, and every
request of a release without the chain in C, goes to :meth:`Model.execute` as plain tuples (Triton's
buffers as read-only memoryviews, valid during the call); the backend sends each answer the generator
yields, in the order yielded, and the call itself is the python backend's
(:class:`ensemble.serving.calls.Ranker`: admission, validation, one batch, errors per request).

The same backend serves the ``rank`` model in the native layout (:class:`RankModel`): ranking
requests scored by the pipeline of a ranker version loaded in this process (the release a fleet's
gateway named in the request, else the one loaded last), so a ranking request costs what its rows
cost, with no second process or inference hop.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ensemble import online, schema
from ensemble.repository import configs
from ensemble.serving import admission, calls
from ensemble.scoring import pipeline, ranking
from ensemble.serving.lane import LIMITS

# Triton's data type codes (the backend API's TRITONSERVER_DataType order) of the types the schema uses.
_TRITON_TYPES = {schema.DType.FP32: 11, schema.DType.INT64: 9, schema.DType.STRING: 13}
_TRITON_TYPES[schema.DType.INT32] = 8
_NAMES = {code: dtype for dtype, code in _TRITON_TYPES.items()}

# The ranker versions loaded in this process, oldest first: the rank model scores with the last
# (Triton loads a release before it unloads the one it replaces, on deploy and on rollback alike).
_LOADED: list["RankerModel"] = []


def Model(config_json: str, repository: str, version: int):  # noqa: N802 - the name the backend calls
    """What the backend loads for a model version: the ranker, or the rank model."""
    if json.loads(config_json).get("name") == schema.RANK_MODEL:
        return RankModel(config_json)
    return RankerModel(config_json, repository, version)


def thread_nice(params: dict[str, str]) -> int:
    """The nice value the config asks for the model's instance threads (``model_thread_nice``,
    configs.py): 0 (leave them) when absent; a ValueError the load reports when not 0..19."""
    text = params.get(configs.THREAD_NICE_PARAMETER, "0")
    try:
        nice = int(text)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"model_thread_nice must be an integer 0..19, not {text!r}")
    return nice


class RankerModel:
    """One loaded version of the fused ranker; ``input_names``: what the backend reads per request
    (the served config's inputs, checked against the ranker's)."""

    def __init__(self, config_json: str, repository: str, version: int):
        self.version = int(version)
        config = json.loads(config_json)
        params = pipeline.model_parameters(config_json)
        runner = pipeline.load_fused(Path(repository) / str(version), int(params.get("threads", "1")))
        _check_config(config, runner.step)
        objective = params.get("latency_objective_ms")
        self.thread_nice = thread_nice(params)  # the backend lowers its instance threads to it
        self.lane_limits = LIMITS  # the backend's bulk lane reads its limits here (ensemble/serving/lane.py)
        # Categorical strings go from Triton's buffer to ids in C when the release allows it.
        self.pipeline: pipeline.Pipeline = runner.fn
        self._wire = pipeline.wire_runner(runner)
        self._transform = self.pipeline.reads_wire if self._wire is not None else None
        self.ranker = calls.Ranker(self._wire or runner, float(objective) if objective else None)
        self.step = runner.step
        self.input_names = tuple(t["name"] for t in config["input"])
        self.plain = self._plain_spec()
        _LOADED.append(self)

    @property
    def rows(self) -> int:
        """Rows scored by the last call (the backend's batch statistics)."""
        return self.ranker.rows

    @property
    def dataset(self) -> str:
        """The name of the dataset spec the release was trained on (the online store's key prefix)."""
        features = self.pipeline.steps.get(schema.Model.FEATURES)
        return getattr(getattr(features, "fn", None), "dataset", schema.CRITEO.name)

    @property
    def engines(self) -> tuple[tuple[str, str, str], ...]:
        """(step, the engine that scores it, the engine its release records) per DLRM step: the backend's
        ``ensemble_engine_*`` metrics (:mod:`ensemble.models.engines`)."""
        from ensemble.models.engines import Recorded

        found = []
        for model, step in self.pipeline.steps.items():
            scorer = step.fn
            if not hasattr(scorer, "engine"):
                continue
            folder = getattr(scorer, "folder", None)
            recorded = Recorded.read(folder) if folder is not None else None
            found.append((model.value, scorer.engine.split(" ", 1)[0], recorded.name if recorded else "none"))
        return tuple(found)

    @property
    def tables(self) -> tuple[tuple[str, object], ...]:
        """(step, its ``_tables.Store``) per DLRM step whose tables are a row store's: the backend's
        ``ensemble_table_*`` metrics (:mod:`ensemble.tables.serving`)."""
        return tuple((model.value, step.fn.store) for model, step in self.pipeline.steps.items()
                     if hasattr(step.fn, "store"))

    def close(self) -> None:
        """Called when Triton unloads this version: the process (Triton's) lives on."""
        if self in _LOADED:
            _LOADED.remove(self)
        self.pipeline.close()

    def execute(self, requests: Sequence[tuple], exec_start: float) -> Iterator[tuple[int, tuple]]:
        """Answers for ``requests`` (each ``(inputs, timeout_us, bulk, requested_outputs, release, shadow)``, inputs in
        ``input_names`` order as ``(datatype, shape, buffer)`` or None), as (index, answer) with an
        answer ``("ok", ((name, float32 array), ...))`` or ``("error", code, message)``."""
        call = [calls.CallRequest(lambda given=r[0]: self._inputs(given), _admitted(r), tuple(r[3])) for r in requests]
        for item in self.ranker.call(call):
            if item is calls.FLUSH:  # the backend sends each answer as it comes: nothing held back
                continue
            i, answer = item
            if answer.ok:
                yield i, ("ok", tuple((n, np.ascontiguousarray(a, dtype=np.float32)) for n, a in answer.outputs.items()))
            else:
                yield i, ("error", answer.code, answer.message)

    def _plain_spec(self) -> tuple | None:
        """What the backend needs to plan and score a *plain* call in C, or None when this release has no
        C path here (no chain in C, features that need Python per value, or an admission policy only
        Python runs): (((Triton type, width) per input in ``input_names`` order), (output names, in the
        order of the score array's rows), the chain in C, the admission policy in C or None, the rows
        from which the chain scores a call on two threads, as the pipeline splits a batch (0: never))."""
        if self._transform is None or self.pipeline.kernel_chain is None:
            return None
        outputs = tuple(t.name for t in schema.RANKER_OUTPUTS)
        if (tuple(t.name for t in self.step.outputs) != outputs or any(t.dims != (1,) for t in self.step.outputs)
                or self.input_names != tuple(t.name for t in self.step.inputs)
                or [t.dtype for t in self.step.inputs] != [schema.DType.FP32, schema.DType.STRING]
                or any(len(t.dims) != 1 for t in self.step.inputs)):
            return None
        policy = self.ranker.admission
        native_policy = policy.native if isinstance(policy, admission.NativeAdmission) else None
        chain = self.pipeline.c_chain
        if chain is None or (policy is not None and native_policy is None):
            return None
        return (tuple((_TRITON_TYPES[t.dtype], t.dims[0]) for t in self.step.inputs), outputs, chain, native_policy,
                self.pipeline.PARALLEL_MIN_ROWS if self.pipeline.parallel else 0)

    def _inputs(self, given: Sequence) -> dict[str, np.ndarray]:
        inputs = {}
        for tensor, value in zip(self.step.inputs, given):
            if value is None:
                raise pipeline.BadInput(f"missing input '{tensor.name}'")
            code, shape, buffer = value
            dtype = _NAMES.get(code)
            if dtype is not tensor.dtype:
                raise pipeline.BadInput(f"input '{tensor.name}' has Triton type {code}, expected {tensor.dtype.value}")
            if dtype is schema.DType.STRING and self._transform is not None:
                if len(shape) != 2 or shape[1] != tensor.dims[0]:  # the ids are laid out by the served width
                    raise pipeline.BadInput(f"input '{tensor.name}' has shape {list(shape)}, expected [batch, {tensor.dims[0]}]")
                inputs[tensor.name] = self._transform.ids_from_wire(buffer, shape[0])
                continue
            if dtype is schema.DType.STRING:
                array = pipeline.deserialize_bytes(buffer)
            else:
                array = np.frombuffer(buffer, dtype=dtype.numpy)
            inputs[tensor.name] = array.reshape(shape)
        return inputs


def _check_config(config: dict, step: schema.Step) -> None:
    """The served config's tensors (names, types, dims, in order) must be the ones this code scores:
    the backend reads the inputs the config names and the model reads them in step order."""
    def tensors(entries):
        return [(t["name"], t["data_type"], tuple(int(d) for d in t["dims"])) for t in entries]

    served = (tensors(config.get("input", [])), tensors(config.get("output", [])))
    expected = ([(t.name, t.dtype.value, t.dims) for t in step.inputs],
                [(t.name, t.dtype.value, t.dims) for t in step.outputs])
    if served != expected:
        raise ValueError(f"the model config's tensors {served} are not the ranker's {expected}: "
                         "regenerate the configs (ensemble export)")


def _admitted(request: tuple) -> admission.Request:
    first = request[0][0]
    rows = int(first[1][0]) if first is not None and len(first[1]) else 1
    return admission.Request(rows, request[1] * 1e-6, bool(request[2]))


def shadow_chain(version: int):
    """The chain in C of the loaded ranker version ``version`` (the backend scores a shadowed request
    with it: ``backend_shadow.c``), or None when that version is not loaded here with one."""
    found = next((m for m in reversed(_LOADED) if m.version == version), None)
    return found.plain[2] if found is not None and found.plain is not None else None


def _ranker_of(release: str | None) -> "RankerModel | None":
    """The loaded ranker version ``release`` names (None: the one loaded last)."""
    if release is None:
        return _LOADED[-1] if _LOADED else None
    return next((m for m in reversed(_LOADED) if str(m.version) == release.strip()), None)


class RankModel:
    """The ``rank`` model in Triton's process: one context and N candidates per request, scored by
    the pipeline of the ranker version the request's ``ensemble-release`` parameter names (a fleet's
    gateway sets it), else of the one loaded last (:data:`_LOADED`).

    Bounded as the ranker is: at most ``max_candidates`` candidates (400 / INVALID_ARGUMENT naming
    the limit, before any is read); scored :data:`ranking.CHUNK_ROWS` rows at a time (no more than
    the ranker's batches); under the ranker's deadline rule (the sooner of the request's timeout and
    the server's latency objective, counted from the call's start): a request whose remaining chunks
    would end past it, at the rate this model has measured, is refused with UNAVAILABLE as the
    ranker refuses, before the work or between chunks; and on threads below the ranker's priority
    (``configs.RANK_THREAD_NICE``), so that the ranker's requests take the core from them at once."""

    def __init__(self, config_json: str):
        config = json.loads(config_json)
        params = pipeline.model_parameters(config_json)
        self.input_names = tuple(t["name"] for t in config["input"])
        self._types = {t["name"]: t["data_type"] for t in config["input"]}
        ranker_rows = int(params.get("ranker_max_batch_size", schema.MAX_BATCH_SIZE))
        self.max_candidates = ranking.max_candidates(params, ranker_rows)
        self.chunk_rows = min(ranking.CHUNK_ROWS, ranker_rows)
        self.thread_nice = thread_nice(params)  # the backend lowers its instance threads to it
        self.lane_limits = LIMITS  # the backend's bulk lane reads its limits here (ensemble/serving/lane.py)
        self.rows = 0
        self.seconds_per_row: float | None = None  # measured on this model's own chunks (decayed)
        # Ranking by ids: the online store tritonserver's environment names (ensemble serve --store).
        self.store = online.StoreSettings.from_environment(os.environ)
        self._lookups: dict[str, online.FeatureLookup] = {}
        self._reported: dict[str, dict[str, float]] = {}  # what metric_updates last reported, per dataset
        self._shadowed: list[tuple[int, int, float]] = []  # what shadow_updates reports next

    def close(self) -> None:
        for lookup in self._lookups.values():
            lookup.close()

    def metric_updates(self) -> tuple[tuple[int, str, float], ...]:
        """What the store lookups counted since the last call, as the backend's counters take it:
        (family, outcome label, increment), families in the backend's order (``backend.c``:
        entities by outcome, failures, round trips, round-trip seconds). Empty when nothing changed."""
        out = []
        for lookup in self._lookups.values():
            now = lookup.counters()
            last = self._reported.get(lookup.dataset, {})
            for name, value in now.items():
                delta = value - last.get(name, 0)
                if delta > 0:
                    family, label = _STORE_FAMILIES[name]
                    out.append((family, label, float(delta)))
            self._reported[lookup.dataset] = now
        return tuple(out)

    def shadow_updates(self) -> tuple[tuple[int, int, float], ...]:
        """What shadow scoring observed since the last call, as the backend's shadow series take it
        (``backend_shadow.c``): (candidate release, kind, value), kind 0 a row's score difference, 1
        a request's top-k overlap, 2-4 a shadowed request scored, missing or failed."""
        out, self._shadowed = tuple(self._shadowed), []
        return out

    def _shadow(self, shadow: str | None, serving: "RankerModel", dense: np.ndarray, categorical: np.ndarray,
                scores: np.ndarray, k: int | None) -> None:
        """Score a ranking request's rows with each candidate its ``ensemble-shadow`` parameter names
        (loaded here as other ranker versions) after the answer is computed: each row's score
        difference and the overlap of the two top-k lists (k: the request's top_k, else 10)."""
        for text in (shadow or "").split(",")[:_SHADOW_CANDIDATES]:
            if not text.isdigit():
                break
            if int(text) == serving.version:
                continue
            candidate = _ranker_of(text)
            if candidate is None:
                self._shadowed.append((int(text), _SHADOW_MISSING, 1.0))
                continue
            try:
                theirs = np.concatenate([candidate.pipeline.score(dense[s:s + self.chunk_rows],
                                                                  categorical[s:s + self.chunk_rows])[
                    schema.SCORE.name].reshape(-1) for s in range(0, len(dense), self.chunk_rows)])
            except Exception:  # noqa: BLE001 - a candidate's failure never touches the answer
                self._shadowed.append((int(text), _SHADOW_FAILED, 1.0))
                continue
            self._shadowed.extend((int(text), _SHADOW_DIFFERENCE, float(d)) for d in np.abs(theirs - scores))
            top = min(k or _SHADOW_TOP_K, len(scores))
            if top:
                kept = len(set(ranking.top(scores, top).tolist()) & set(ranking.top(theirs, top).tolist()))
                self._shadowed.append((int(text), _SHADOW_OVERLAP, kept / top))
            self._shadowed.append((int(text), _SHADOW_SCORED, 1.0))

    def lookup(self, ranker: "RankerModel") -> online.FeatureLookup:
        """The store's lookup of the dataset the ranker version was trained on."""
        if self.store is None:
            raise ranking.RankError("ranking by ids needs the online store: this server was started without "
                                    "one (ensemble serve --store URL)")
        dataset = ranker.dataset
        found = self._lookups.get(dataset)
        if found is None:
            found = self._lookups[dataset] = self.store.lookup(dataset)
        return found

    def execute(self, requests: Sequence[tuple], exec_start: float) -> Iterator[tuple[int, tuple]]:
        """Answers as :meth:`RankerModel.execute`: ``("ok", (("scores", float32), ("order", int32)))``."""
        self.rows = 0
        for i, request in enumerate(requests):
            shadow = None  # a shadowed request: its candidates score it once its answer has gone
            try:
                given = dict(zip(self.input_names, request[0]))
                by_ids = given.get(schema.ITEM_IDS.name) is not None or given.get(schema.USER_ID.name) is not None
                candidates = given.get(schema.ITEM_IDS.name if by_ids else schema.CANDIDATE_DENSE.name)
                if candidates is not None and len(candidates[1]):
                    ranking.check_count(int(candidates[1][0]), self.max_candidates)
                arrays = {name: self._array(name, value) for name, value in given.items() if value is not None}
                ranker = _ranker_of(ranking.release_named(request[4] if len(request) > 4 else None))
                if ranker is None:
                    yield i, ("error", calls.UNAVAILABLE, "the ranker is not loaded: nothing to rank with"
                              if not _LOADED else f"release {request[4]} of the ranker is not loaded here")
                    continue
                k = arrays.get(schema.TOP_K.name)
                k = int(k.reshape(-1)[0]) if k is not None and k.size else None
                if k is not None and k < 0:
                    raise ranking.RankError(f"top_k must be >= 0 (0: every candidate), not {k}")
                widths = ranker.pipeline.widths
                deadline = _deadline(request[1], ranker)
                kept = dropped = None
                if by_ids:
                    arrays, kept, dropped = self._by_ids(ranker, arrays, exec_start, deadline)
                if kept is not None and not len(kept):  # every item unknown, and unknown items are dropped
                    scores = np.empty(0, np.float32)
                else:
                    dense, categorical = ranking.broadcast(
                        arrays.get(schema.CONTEXT_DENSE.name), arrays.get(schema.CONTEXT_CATEGORICAL.name),
                        arrays.get(schema.CANDIDATE_DENSE.name), arrays.get(schema.CANDIDATE_CATEGORICAL.name),
                        (widths.context_dense, widths.context_categorical))
                    scores = self._score(ranker, dense, categorical, exec_start, deadline)
                    if len(request) > 5 and request[5] is not None:  # copies: the inputs may be views of
                        # Triton's memory, which its front end may reuse once the answer has gone
                        shadow = (request[5], ranker, np.array(dense), np.array(categorical), scores, k)
                self.rows += len(scores)
                order = ranking.top(scores, k)
                if dropped is not None and len(dropped):  # back to the request's item indices; dropped: NaN
                    order = kept[order]
                    every = np.full(len(kept) + len(dropped), np.nan, np.float32)
                    every[kept] = scores
                    scores = every
                yield i, ("ok", ((schema.CANDIDATE_SCORES.name, np.ascontiguousarray(scores, np.float32)),
                                 (schema.ORDER.name, np.ascontiguousarray(order, np.int32)),
                                 (schema.DROPPED.name, np.ascontiguousarray(
                                     dropped if dropped is not None else np.empty(0, np.int32), np.int32))))
            except _Late as exc:
                yield i, ("error", calls.UNAVAILABLE, str(exc))
            except (online.StoreError, online.Unservable) as exc:  # the store's state, not the request's fault
                yield i, ("error", calls.UNAVAILABLE, f"refused: {exc}")
            except (ranking.RankError, pipeline.BadInput) as exc:
                yield i, ("error", calls.INVALID_ARG, str(exc))
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own answer
                yield i, ("error", calls.INTERNAL, f"{type(exc).__name__}: {exc}")
            if shadow is not None:
                self._shadow(*shadow)

    def _by_ids(self, ranker: "RankerModel", arrays: dict, start: float, deadline: tuple[float, str]):
        """The request's tensors with the features of its ids read from the store: (arrays, the kept
        item indices, the dropped ones)."""
        if arrays.get(schema.CANDIDATE_DENSE.name) is not None or arrays.get(schema.CANDIDATE_CATEGORICAL.name) is not None:
            raise ranking.RankError("a ranking request sends candidate features or item_ids, not both")
        items = arrays.get(schema.ITEM_IDS.name)
        if items is None or not items.size:
            raise ranking.RankError("empty item_ids: nothing to rank (send at least one item id)")
        user = arrays.get(schema.USER_ID.name)
        if user is not None and user.size != 1:
            raise ranking.RankError(f"user_id holds {user.size} values; a ranking request names one user")
        context_dense, context_cats = arrays.get(schema.CONTEXT_DENSE.name), arrays.get(schema.CONTEXT_CATEGORICAL.name)
        if (context_dense is None) != (context_cats is None) and ranker.pipeline.widths.context_dense \
                and ranker.pipeline.widths.context_categorical:
            raise ranking.RankError("request-time context features need both context_dense and context_categorical")
        lookup = self.lookup(ranker)
        rows = lookup.rows(None if user is None else bytes(user.reshape(-1)[0]), items.reshape(-1).tolist(),
                           deadline[0] - (time.monotonic() - start), context_dense, context_cats)
        out = {schema.CONTEXT_DENSE.name: rows.context_dense, schema.CONTEXT_CATEGORICAL.name: rows.context_categorical,
               schema.CANDIDATE_DENSE.name: rows.candidate_dense,
               schema.CANDIDATE_CATEGORICAL.name: rows.candidate_categorical}
        return out, rows.kept, rows.dropped

    def _score(self, ranker: "RankerModel", dense: np.ndarray, categorical: np.ndarray, start: float,
               deadline: tuple[float, str]) -> np.ndarray:
        """Every row's score, :attr:`chunk_rows` at a time; raises :class:`_Late` as soon as the rows
        left would end past the deadline at the measured rate."""
        limit, which = deadline
        parts, n = [], len(dense)
        for first in range(0, n, self.chunk_rows):
            now = time.monotonic()
            if self.seconds_per_row is not None and now - start + (n - first) * self.seconds_per_row > limit:
                raise _Late(admission.refusal(now - start + (n - first) * self.seconds_per_row, limit, which))
            rows = slice(first, first + self.chunk_rows)
            parts.append(ranker.pipeline.score(dense[rows], categorical[rows])[schema.SCORE.name].reshape(-1))
            rate = (time.monotonic() - now) / len(parts[-1])
            self.seconds_per_row = rate if self.seconds_per_row is None else 0.8 * self.seconds_per_row + 0.2 * rate
        return np.concatenate(parts)

    def _array(self, name: str, value: tuple) -> np.ndarray:
        code, shape, buffer = value
        dtype = _NAMES.get(code)
        expected = self._types.get(name)
        if dtype is None or dtype.value != expected:
            raise pipeline.BadInput(f"input '{name}' has Triton type {code}, expected {expected}")
        if any(d < 0 for d in shape):
            raise pipeline.BadInput(f"input '{name}' has a negative dimension in shape {list(shape)}")
        count = math.prod(int(d) for d in shape)  # Python's integers: a shape whose byte size wraps stays large
        if dtype is schema.DType.STRING:
            try:
                array = pipeline.deserialize_bytes(buffer)
            except ValueError as exc:
                raise pipeline.BadInput(f"input '{name}': {exc}") from None
        else:
            size = count * np.dtype(dtype.numpy).itemsize
            if size != len(buffer):
                raise pipeline.BadInput(f"input '{name}' of shape {list(shape)} needs {size} bytes, got {len(buffer)}")
            array = np.frombuffer(buffer, dtype.numpy)
        if array.size != count:
            raise pipeline.BadInput(f"input '{name}' of shape {list(shape)} holds {array.size} values")
        return array.reshape(shape)


# FeatureLookup.counters() names -> (the backend's metric family, its outcome label).
_STORE_FAMILIES = {**{reason: (0, reason) for reason in online.REASONS if reason != "store_unavailable"},
                   "store_unavailable": (1, ""), "round_trips": (2, ""), "round_trip_seconds": (3, "")}


# Shadow scoring (backend_shadow.c): the kinds of what shadow_updates reports, at most this many
# candidates per request, and the top k compared when the request names none.
_SHADOW_DIFFERENCE, _SHADOW_OVERLAP, _SHADOW_SCORED, _SHADOW_MISSING, _SHADOW_FAILED = range(5)
_SHADOW_CANDIDATES = 4
_SHADOW_TOP_K = 10


class _Late(Exception):
    """A ranking request that would end past its deadline: refused (UNAVAILABLE) as the ranker refuses."""


def _deadline(timeout_us: int, ranker: "RankerModel") -> tuple[float, str]:
    """(seconds, what sets them): the sooner of the request's timeout and the server's objective."""
    timeout = timeout_us * 1e-6 if timeout_us > 0 else math.inf
    policy = ranker.ranker.admission
    objective = policy.objective_s if policy is not None else math.inf
    return (timeout, admission.TIMEOUT) if timeout <= objective else (objective, admission.OBJECTIVE)
