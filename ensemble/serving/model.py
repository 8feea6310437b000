"""The python-backend ``model.py`` of every python model (export copies this file): a composing
step of the ``ensemble`` and ``gpu`` layouts, or the whole ranker in the ``fused`` layout.

One dynamic batch = one call of the step (:class:`ensemble.serving.calls.Ranker`: a request that
fails validation gets its own error response and the rest of the batch is still scored). With a
``latency_objective_ms`` parameter (the fused ranker) the call first applies the admission policy
(:mod:`ensemble.serving.admission`): requests that would miss their deadline are answered
UNAVAILABLE, and bulk requests are scored after the interactive ones, whose answers go out first.
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from ensemble import schema
from ensemble.serving import admission, calls, runtime

class TritonPythonModel:
    def initialize(self, args):
        pb_utils.deserialize_bytes_tensor = runtime.deserialize_bytes  # the stub looks it up per call
        config = json.loads(args["model_config"])
        params = runtime.model_parameters(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        threads, layout = int(params.get("threads", "1")), params.get("layout", "ensemble")
        if layout == "fused":
            runner = runtime.load_fused(version_dir, threads)
        else:
            runner = runtime.load_step(config["name"], version_dir, threads, layout=layout,
                                       widths=schema.widths_of_config(config))
        objective = params.get("latency_objective_ms")
        self.ranker = calls.Ranker(runner, float(objective) if objective else None)

    def execute(self, requests):
        call = [_call_request(r, self.ranker.runner.step) for r in requests]
        responses, sent = [None] * len(requests), set()
        for item in self.ranker.call(call):
            if item is calls.FLUSH:  # the interactive answers go out before the bulk rows are scored
                for i, response in enumerate(responses):
                    if response is not None and i not in sent:
                        _send(requests[i], response)
                        sent.add(i)
                continue
            i, answer = item
            responses[i] = _response(answer)
        if not sent:
            return responses
        for i, response in enumerate(responses):
            if i not in sent:
                _send(requests[i], response)
        return None


def _call_request(request, step):
    """What a call needs of a request: its inputs (read when scored), and for admission its rows
    (from the dense tensor's shape, no copy; 1 when it has none: validation answers it), its
    client's timeout and whether it is marked bulk."""
    tensor = pb_utils.get_input_tensor_by_name(request, schema.DENSE.name)
    shape = tensor.shape() if tensor is not None else ()
    parameters = request.parameters()
    bulk = parameters not in ("", "{}") and json.loads(parameters).get(schema.BULK_PARAMETER) is True
    admitted = admission.Request(int(shape[0]) if len(shape) else 1, request.timeout() * 1e-6, bulk)
    return calls.CallRequest(lambda: {t.name: _as_numpy(request, t.name) for t in step.inputs}, admitted,
                             tuple(request.requested_output_names()))


def _send(request, response):
    """Answer ``request`` now through its response sender (the call then returns None)."""
    request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise runtime.BadInput(f"missing input '{name}'")
    return tensor.as_numpy()


def _response(answer):
    if not answer.ok:  # pb_utils.TritonError exists once the stub runs, not when this module is imported
        code = {calls.INTERNAL: pb_utils.TritonError.INTERNAL, calls.INVALID_ARG: pb_utils.TritonError.INVALID_ARG,
                calls.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE}[answer.code]
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(answer.message, code))
    return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in answer.outputs.items()])
