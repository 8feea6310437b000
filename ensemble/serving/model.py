"""The python-backend ``model.py`` of every python model (export copies this file): a composing
step of the ``ensemble`` and ``gpu`` layouts, or the whole ranker in the ``fused`` layout.

One dynamic batch = one call of the step; a request that fails validation gets its own error
response and the rest of the batch is still scored.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble.serving import runtime


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

    def execute(self, requests):
        responses, batch, sizes, members = [None] * len(requests), [], [], []
        for i, request in enumerate(requests):
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
        return responses

    def _score_alone(self, inputs, request):
        try:
            return _response(self.runner.run(inputs), request)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the others
            return _error(exc, pb_utils.TritonError.INTERNAL)


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
