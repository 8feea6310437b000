"""The python-backend ``model.py`` of every python model (export copies this file): a composing
step of the ``ensemble`` and ``gpu`` layouts, or the whole ranker in the ``fused`` layout.

One dynamic batch = one call of the step; a request that fails validation gets its own error
response and the rest of the batch is still scored. With a ``latency_objective_ms`` parameter (the
fused ranker) the call first applies the admission policy (:mod:`ensemble.serving.admission`):
requests that would miss their deadline are answered UNAVAILABLE, and bulk requests are scored
after the interactive ones, whose answers go out first.
"""

import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble import schema
from ensemble.serving import admission, runtime


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.deserialize_bytes_tensor = runtime.deserialize_bytes  # the stub looks it up per call
        config = json.loads(args["model_config"])
        params = runtime.model_parameters(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        threads, layout = int(params.get("threads", "1")), params.get("layout", "ensemble")
        if layout == "fused":
            self.runner = runtime.load_fused(version_dir, threads)
        else:
            self.runner = runtime.load_step(config["name"], version_dir, threads, layout=layout)
        self.admission = None
        if params.get("latency_objective_ms"):
            prior = admission.calibrate(self._score_missing)
            self.admission = admission.Admission(float(params["latency_objective_ms"]) / 1e3,
                                                 admission.CostModel(prior))

    def _score_missing(self, rows):
        self.runner.run({schema.DENSE.name: np.full((rows, schema.N_DENSE), np.nan, np.float32),
                         schema.CATEGORICAL.name: np.full((rows, schema.N_CATEGORICAL), b"", dtype=object)})

    def execute(self, requests):
        started = time.perf_counter()
        responses = [None] * len(requests)
        if self.admission is None:
            self._score(requests, range(len(requests)), responses)
            return responses
        plan = self.admission.plan([_admission_request(r) for r in requests], started)
        for i, message in plan.refused.items():
            responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE))
        if plan.first and plan.bulk:  # the interactive answers go out before the bulk rows are scored
            rows = self._score(requests, plan.first, responses)
            bulk = set(plan.bulk)
            _send(requests, responses, [i for i in range(len(requests)) if i not in bulk])
            rows += self._score(requests, plan.bulk, responses)
            _send(requests, responses, plan.bulk)
            responses = None
        else:
            rows = self._score(requests, plan.taken, responses)
        self.admission.finished(started, time.perf_counter(), len(requests), rows, len(plan.taken))
        return responses

    def _score(self, requests, indices, responses):
        """Score ``requests[i]`` for ``i`` in ``indices`` as one batch into ``responses``; the rows scored."""
        batch, sizes, members = [], [], []
        for i in indices:
            try:
                inputs = {t.name: _as_numpy(requests[i], t.name) for t in self.runner.step.inputs}
                sizes.append(self.runner.validate(inputs))
                batch.append(inputs)
                members.append(i)
            except runtime.BadInput as exc:
                responses[i] = _error(exc, pb_utils.TritonError.INVALID_ARG)
        if not members:
            return 0
        try:
            merged = {n: np.concatenate([b[n] for b in batch]) for n in batch[0]}
            outputs = self.runner.run(merged)
            bounds = np.cumsum([0, *sizes])
            for k, i in enumerate(members):
                responses[i] = _response({n: o[bounds[k]:bounds[k + 1]] for n, o in outputs.items()}, requests[i])
        except Exception:  # noqa: BLE001 - isolate the failing request(s)
            for k, i in enumerate(members):
                responses[i] = self._score_alone(batch[k], requests[i])
        return int(sum(sizes))

    def _score_alone(self, inputs, request):
        try:
            return _response(self.runner.run(inputs), request)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the others
            return _error(exc, pb_utils.TritonError.INTERNAL)


def _admission_request(request):
    """What admission needs of a request: its rows (from the dense tensor's shape, no copy; 1 when
    it has none: validation answers it), its client's timeout and whether it is marked bulk."""
    tensor = pb_utils.get_input_tensor_by_name(request, schema.DENSE.name)
    shape = tensor.shape() if tensor is not None else ()
    parameters = request.parameters()
    bulk = parameters not in ("", "{}") and json.loads(parameters).get(schema.BULK_PARAMETER) is True
    return admission.Request(int(shape[0]) if len(shape) else 1, request.timeout() * 1e-6, bulk)


def _send(requests, responses, indices):
    """Answer ``requests[i]`` now through its response sender (the call then returns None)."""
    for i in indices:
        requests[i].get_response_sender().send(responses[i], flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise runtime.BadInput(f"missing input '{name}'")
    return tensor.as_numpy()


def _response(outputs, request):
    wanted = set(request.requested_output_names()) or outputs  # only what was asked for: each costs IPC
    return pb_utils.InferenceResponse([pb_utils.Tensor(n, np.ascontiguousarray(a))
                                       for n, a in outputs.items() if n in wanted])


def _error(exc, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}", code))
