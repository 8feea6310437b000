"""One call of the ranker over the requests Triton hands it, whichever backend runs it: the python
backend's ``model.py`` and the project's own backend (:mod:`ensemble.serving.embedded`) both turn
their requests into :class:`CallRequest` and send the :class:`Answer` s this yields, in order.

The order is the policy: refusals first (:mod:`ensemble.serving.admission`), then the interactive
requests' answers, then :data:`FLUSH` when bulk requests follow (a backend sends what it has so far
at that point, so the interactive answers do not wait for the bulk rows), then the bulk answers.
Requests that fail validation get their own error and the rest of the batch is scored; a batch that
fails as a whole is scored request by request, so one bad request cannot fail the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ensemble.serving import admission
from ensemble.scoring import pipeline

# Triton's error codes (TRITONSERVER_Error_Code order), which both backends map to their own.
INTERNAL, INVALID_ARG, UNAVAILABLE = 1, 3, 4

FLUSH = None  # yielded between the interactive answers and the bulk ones


@dataclass(frozen=True)
class CallRequest:
    """What a call needs of one request.

    Attributes:
        inputs: its tensors by name (raises :class:`ensemble.scoring.pipeline.BadInput` or
            ValueError for a malformed request; called once, when the request is scored).
        admitted: rows, timeout and bulk marking for admission.
        wanted: the output names it asked for (empty: all).
    """

    inputs: Callable[[], Mapping[str, np.ndarray]]
    admitted: admission.Request
    wanted: Sequence[str] = ()


@dataclass(frozen=True)
class Answer:
    """Either ``outputs`` (name -> array in its tensor's dtype, only those asked for) or an error."""

    outputs: Mapping[str, np.ndarray] | None = None
    code: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.outputs is not None


def failed(code: int, exc_or_message) -> Answer:
    text = exc_or_message if isinstance(exc_or_message, str) else f"{type(exc_or_message).__name__}: {exc_or_message}"
    return Answer(code=code, message=text)


class Ranker:
    """A loaded step (the fused ranker, or one composing step) and its admission policy (None: none)."""

    def __init__(self, runner: pipeline.StepRunner, objective_ms: float | None = None):
        self.runner = runner
        self.admission = None
        if objective_ms:
            prior = admission.calibrate(self._score_missing)
            self.admission = admission.serving_policy(objective_ms / 1e3, admission.CostModel(prior))
        self.rows = 0  # rows scored by the last call

    def _score_missing(self, rows: int) -> None:
        missing = {"float32": np.nan, "object": b"", "int64": 0}  # int64: ids (0, a reserved one): a cost sample
        self.runner.run({t.name: np.full((rows, *t.dims), missing[t.dtype.numpy], t.dtype.numpy)
                         for t in self.runner.step.inputs})

    def call(self, requests: Sequence[CallRequest]) -> Iterator[tuple[int, Answer] | None]:
        """(index, answer) for every request, and :data:`FLUSH` before bulk answers that follow
        interactive ones."""
        started = time.perf_counter()
        self.rows = 0
        if self.admission is None:
            self.rows = yield from self._score(requests, range(len(requests)))
            return
        plan = self.admission.plan([r.admitted for r in requests], started)
        for i, message in plan.refused.items():
            yield i, failed(UNAVAILABLE, message)
        if plan.first and plan.bulk:
            rows = yield from self._score(requests, plan.first)
            yield FLUSH
            rows += yield from self._score(requests, plan.bulk)
        else:
            rows = yield from self._score(requests, plan.taken)
        self.rows = rows
        self.admission.finished(started, time.perf_counter(), len(requests), rows, len(plan.taken))

    def _score(self, requests: Sequence[CallRequest], indices) -> Iterator[tuple[int, Answer]]:
        """Score ``requests[i]`` for ``i`` in ``indices`` as one batch; returns the rows scored."""
        batch, sizes, members = [], [], []
        for i in indices:
            try:
                inputs = requests[i].inputs()
                sizes.append(self.runner.validate(inputs))
                batch.append(inputs)
                members.append(i)
            except (pipeline.BadInput, ValueError) as exc:
                yield i, failed(INVALID_ARG, exc)
        if not members:
            return 0
        try:
            if len(members) == 1:  # one request (every call at light load): no merging or slicing
                answers = [(members[0], _answer(self.runner.run(batch[0]), requests[members[0]].wanted))]
            else:
                merged = {n: np.concatenate([b[n] for b in batch]) for n in batch[0]}
                outputs = self.runner.run(merged)
                bounds = np.cumsum([0, *sizes])
                answers = [(i, _answer({n: o[bounds[k]:bounds[k + 1]] for n, o in outputs.items()}, requests[i].wanted))
                           for k, i in enumerate(members)]
        except Exception:  # noqa: BLE001 - isolate the failing request(s)
            answers = [(i, self._score_alone(batch[k], requests[i].wanted)) for k, i in enumerate(members)]
        yield from answers
        return int(sum(sizes))

    def _score_alone(self, inputs, wanted) -> Answer:
        return score_alone(self.runner, inputs, wanted)


def score_alone(runner: pipeline.StepRunner, inputs: Mapping[str, np.ndarray], wanted: Sequence[str],
                validate: bool = False) -> Answer:
    """One request scored by itself: its answer, or its own error (INVALID_ARG when ``validate`` finds
    it malformed, INTERNAL when scoring fails)."""
    if validate:
        try:
            runner.validate(inputs)
        except (pipeline.BadInput, ValueError) as exc:
            return failed(INVALID_ARG, exc)
    try:
        return _answer(runner.run(inputs), wanted)
    except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the others
        return failed(UNAVAILABLE if unavailable(exc) else INTERNAL, exc)


def unavailable(exc: BaseException) -> bool:
    """Whether a scoring failure is the server's state, not the request's (a row store's table that could
    not be read by the request's deadline, or whose block failed its checksum): answered UNAVAILABLE,
    which clients retry."""
    return isinstance(exc, ConnectionError) or type(exc).__name__ == "TableError"


def _answer(outputs: Mapping[str, np.ndarray], wanted: Sequence[str]) -> Answer:
    names = set(wanted) or set(outputs)  # only what was asked for: each output is copied out
    return Answer({n: np.ascontiguousarray(a) for n, a in outputs.items() if n in names})
