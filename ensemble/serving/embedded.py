"""The fused ranker inside Triton's own process: what the ``fused`` backend (``fused_backend.c``,
built as ``libtriton_fused.so``) calls in the interpreter it embeds.

The backend hands :meth:`Model.execute` one call's requests as plain tuples (Triton's buffers as
read-only memoryviews, valid during the call) and sends each answer the generator yields, in the
order yielded: refusals, then the interactive answers, then the bulk ones (the same policy as the
python backend's ``model.py``: :mod:`ensemble.serving.admission`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ensemble import schema
from ensemble.serving import admission, runtime

# Triton's data type codes (the backend API's TRITONSERVER_DataType order) of the types the schema uses.
_TRITON_TYPES = {schema.DType.FP32: 11, schema.DType.INT64: 9, schema.DType.STRING: 13}
_NAMES = {code: dtype for dtype, code in _TRITON_TYPES.items()}

# Triton's error codes (TRITONSERVER_Error_Code order).
INTERNAL, INVALID_ARG, UNAVAILABLE = 1, 3, 4

Answer = tuple  # ("ok", ((name, array), ...)) or ("error", code, message)


class Model:
    """One loaded version of the fused ranker; ``input_names``: what the backend reads per request."""

    def __init__(self, config_json: str, repository: str, version: int):
        config = json.loads(config_json)
        params = runtime.model_parameters(config_json)
        self.name = config.get("name", schema.Model.RANKER.value)
        self.runner = runtime.load_fused(Path(repository) / str(version), int(params.get("threads", "1")))
        self.step = self.runner.step
        _check_config(config, self.step)
        self.input_names = tuple(t["name"] for t in config["input"])
        self.admission = None
        if params.get("latency_objective_ms"):
            prior = admission.calibrate(self._score_missing)
            self.admission = admission.Admission(float(params["latency_objective_ms"]) / 1e3,
                                                 admission.CostModel(prior))
        self.rows = 0  # rows scored by the last call

    def _score_missing(self, rows: int) -> None:
        self.runner.run({schema.DENSE.name: np.full((rows, schema.N_DENSE), np.nan, np.float32),
                         schema.CATEGORICAL.name: np.full((rows, schema.N_CATEGORICAL), b"", dtype=object)})

    def close(self) -> None:
        """Called when Triton unloads this version: the process (Triton's) lives on."""
        self.runner.fn.close()

    def execute(self, requests: Sequence[tuple], exec_start: float) -> Iterator[tuple[int, Answer]]:
        """Answers for ``requests`` (each ``(inputs, timeout_us, bulk, requested_outputs)``, inputs
        in ``input_names`` order as ``(datatype, shape, buffer)`` or None), as (index, answer)."""
        started = time.perf_counter()
        self.rows = 0
        if self.admission is None:
            self.rows = yield from self._score(requests, range(len(requests)))
            return
        plan = self.admission.plan([_admission_request(r) for r in requests], started)
        for i, message in plan.refused.items():
            yield i, ("error", UNAVAILABLE, message)
        if plan.first and plan.bulk:  # the interactive answers go out before the bulk rows are scored
            rows = yield from self._score(requests, plan.first)
            rows += yield from self._score(requests, plan.bulk)
        else:
            rows = yield from self._score(requests, plan.taken)
        self.rows = rows
        self.admission.finished(started, time.perf_counter(), len(requests), rows, len(plan.taken))

    def _score(self, requests: Sequence[tuple], indices) -> Iterator[tuple[int, Answer]]:
        """Score ``requests[i]`` for ``i`` in ``indices`` as one batch; returns the rows scored."""
        batch, sizes, members = [], [], []
        for i in indices:
            try:
                inputs = self._inputs(requests[i][0])
                sizes.append(self.runner.validate(inputs))
                batch.append(inputs)
                members.append(i)
            except (runtime.BadInput, ValueError) as exc:
                yield i, ("error", INVALID_ARG, f"{type(exc).__name__}: {exc}")
        if not members:
            return 0
        try:
            merged = {n: np.concatenate([b[n] for b in batch]) for n in batch[0]}
            outputs = self.runner.run(merged)
            bounds = np.cumsum([0, *sizes])
            answers = [(i, _answer({n: o[bounds[k]:bounds[k + 1]] for n, o in outputs.items()}, requests[i][3]))
                       for k, i in enumerate(members)]
        except Exception:  # noqa: BLE001 - isolate the failing request(s)
            answers = [(i, self._score_alone(batch[k], requests[i][3])) for k, i in enumerate(members)]
        yield from answers
        return int(sum(sizes))

    def _score_alone(self, inputs, wanted) -> Answer:
        try:
            return _answer(self.runner.run(inputs), wanted)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the others
            return ("error", INTERNAL, f"{type(exc).__name__}: {exc}")

    def _inputs(self, given: Sequence) -> dict[str, np.ndarray]:
        inputs = {}
        for tensor, value in zip(self.step.inputs, given):
            if value is None:
                raise runtime.BadInput(f"missing input '{tensor.name}'")
            code, shape, buffer = value
            dtype = _NAMES.get(code)
            if dtype is not tensor.dtype:
                raise runtime.BadInput(f"input '{tensor.name}' has Triton type {code}, expected {tensor.dtype.value}")
            if dtype is schema.DType.STRING:
                array = runtime.deserialize_bytes(buffer)
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


def _admission_request(request: tuple) -> admission.Request:
    first = request[0][0]
    rows = int(first[1][0]) if first is not None and len(first[1]) else 1
    return admission.Request(rows, request[1] * 1e-6, bool(request[2]))


def _answer(outputs: dict[str, np.ndarray], wanted: Sequence[str]) -> Answer:
    names = set(wanted) or set(outputs)
    return ("ok", tuple((n, np.ascontiguousarray(a, dtype=np.float32)) for n, a in outputs.items() if n in names))
