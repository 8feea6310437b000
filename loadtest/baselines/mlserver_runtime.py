"""The ``mlserver`` baseline: the same in-process pipeline served by MLServer, the Python serving
framework a team would deploy instead of Triton (it speaks the same v2 protocol, so locust, wrk and
perf_analyzer drive it unchanged).

MLServer runs in a virtual environment of its own (its pins clash with this project's: fastapi,
starlette, prometheus-client), which sees the project's packages through a ``.pth`` file
(:func:`loadtest.baselines.mlserver.install`). This module is its custom runtime: MLServer imports
it by the ``implementation`` name in ``model-settings.json``.
"""

from __future__ import annotations

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

from ensemble import schema


class BadInput(MLServerError):
    def __init__(self, message: str):
        super().__init__(message, status_code=400)


class RankerRuntime(MLModel):
    """``dense`` FP32 [B, 13] + ``categorical`` BYTES [B, 26] -> the ranker's four scores."""

    async def load(self) -> bool:
        from ensemble.scoring.pipeline import Pipeline

        repository = self.settings.parameters.uri
        threads = int((self.settings.parameters.extra or {}).get("threads", 1))
        self._pipeline = Pipeline.from_repository(repository, threads=threads)
        self._pipeline.warm_up()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        arrays = {}
        for item in payload.inputs:
            if item.name == schema.DENSE.name:
                arrays[item.name] = np.asarray(NumpyCodec.decode_input(item), dtype=np.float32)
            elif item.name == schema.CATEGORICAL.name:
                values = [v if isinstance(v, bytes) else str(v).encode() for v in _flat(item.data.root)]
                arrays[item.name] = np.array(values, dtype=object).reshape(item.shape)
        for tensor in schema.RANKER_INPUTS:
            if tensor.name not in arrays:
                raise BadInput(f"missing input '{tensor.name}'")
            shape = arrays[tensor.name].shape
            if len(shape) != 2 or shape[1] != tensor.dims[0]:
                raise BadInput(f"input '{tensor.name}' has shape {list(shape)}, expected [batch, {tensor.dims[0]}]")
        scores = self._pipeline.score(arrays[schema.DENSE.name], arrays[schema.CATEGORICAL.name])
        wanted = [o.name for o in payload.outputs or []] or [t.name for t in schema.RANKER_OUTPUTS]
        outputs = [ResponseOutput(name=name, datatype="FP32", shape=list(scores[name].shape),
                                  data=scores[name].ravel().tolist()) for name in wanted if name in scores]
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=outputs)


def _flat(data):
    for value in data:
        if isinstance(value, list):
            yield from _flat(value)
        else:
            yield value
