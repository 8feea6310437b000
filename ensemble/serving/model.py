"""The python-backend ``model.py`` of every python model (export copies this file): a composing
step of the ``ensemble`` and ``gpu`` layouts, or the whole ranker in the ``fused`` layout.

One dynamic batch = one call of the step; a request that fails validation gets its own error
response and the rest of the batch is still scored. With a ``call_budget_us`` parameter (the
fused ranker) the call first applies the overload policy (:mod:`ensemble.serving.admission`):
requests beyond the call's budget are answered UNAVAILABLE at once.
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
        if params.get("call_budget_us"):
            prior = admission.calibrate(self._score_missing)
            self.admission = admission.Admission(int(params["call_budget_us"]) * 1e-6, admission.CostModel(prior))

    def _score_missing(self, rows):
        self.runner.run({schema.DENSE.name: np.full((rows, schema.N_DENSE), np.nan, np.float32),
                         schema.CATEGORICAL.name: np.full((rows, schema.N_CATEGORICAL), b"", dtype=object)})

    def execute(self, requests):
        started = time.perf_counter()
        responses, batch, sizes, members = [None] * len(requests), [], [], []
        taken = self._admit(requests, responses) if self.admission else range(len(requests))
        for i in taken:
            request = requests[i]
            try:
                inputs = {t.name: _as_numpy(request, t.name) for t in self.runner.step.inputs}
                sizes.append(self.runner.validate(inputs))
                batch.append(inputs)
                members.append(i)
            except runtime.BadInput as exc:
                responses[i] = _error(exc, pb_utils.TritonError.INVALID_ARG)
        if members:
            try:
                merged = {n: np.concatenate([b[n] for b in batch]) for n in batch[0]}
                outputs = self.runner.run(merged)
                bounds = np.cumsum([0, *sizes])
                for k, i in enumerate(members):
                    responses[i] = _response({n: o[bounds[k]:bounds[k + 1]] for n, o in outputs.items()},
                                             requests[i])
            except Exception:  # noqa: BLE001 - isolate the failing request(s)
                for k, i in enumerate(members):
                    responses[i] = self._score_alone(batch[k], requests[i])
        if self.admission and members:
            self.admission.observe(sum(sizes), len(members), time.perf_counter() - started)
        return responses

    def _admit(self, requests, responses):
        """Indices of the requests this call scores; the others get UNAVAILABLE now. A request
        whose rows cannot be read is kept: validation answers it."""
        rows = [_rows(request) for request in requests]
        decision = self.admission.admit(rows)
        for i, ok in enumerate(decision):
            if not ok:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    schema.OVERLOAD_REFUSAL, pb_utils.TritonError.UNAVAILABLE))
        return [i for i, ok in enumerate(decision) if ok]

    def _score_alone(self, inputs, request):
        try:
            return _response(self.runner.run(inputs), request)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the others
            return _error(exc, pb_utils.TritonError.INTERNAL)


def _rows(request):
    """Rows of a request, from its dense tensor's shape (no copy); 1 when it has none."""
    tensor = pb_utils.get_input_tensor_by_name(request, schema.DENSE.name)
    shape = tensor.shape() if tensor is not None else ()
    return int(shape[0]) if len(shape) else 1


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
