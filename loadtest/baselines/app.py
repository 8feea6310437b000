"""One FastAPI/uvicorn app per baseline, with the ranker's HTTP JSON request contract.

``POST /v2/models/ranker/infer`` takes the same body Triton takes (inputs ``dense`` FP32
[B, 13] and ``categorical`` BYTES [B, 26]) and answers with the same outputs; malformed
requests get a 400 with ``{"error": ...}``. Kinds:

- ``naive``: :class:`loadtest.baselines.naive.NaiveScorer` (NVTabular + pandas per request).
- ``inproc``: the ranker's own pipeline (lean transform, same models) in-process, per request.
"""

# No `from __future__ import annotations`: FastAPI resolves the handler annotations at runtime.

import enum
import json
from pathlib import Path

import numpy as np

from ensemble import schema


class Kind(str, enum.Enum):
    NAIVE = "naive"
    INPROC = "inproc"


class BadRequest(ValueError):
    pass


def parse_request(body: bytes) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Triton's v2 JSON body -> (dense [B x 13] f32, categorical [B x 26] bytes, requested outputs)."""
    try:
        payload = json.loads(body)
        inputs = {item["name"]: item for item in payload["inputs"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise BadRequest(f"body is not a v2 inference request: {exc}") from exc
    arrays = {}
    for tensor in schema.RANKER_INPUTS:
        item = inputs.get(tensor.name)
        if item is None:
            raise BadRequest(f"missing input '{tensor.name}'")
        if item.get("datatype") != tensor.dtype.wire:
            raise BadRequest(f"input '{tensor.name}' data-type is '{item.get('datatype')}', expected '{tensor.dtype.wire}'")
        shape = item.get("shape", [])
        if len(shape) != 2 or shape[1] != tensor.dims[0]:
            raise BadRequest(f"input '{tensor.name}' has shape {shape}, expected [batch, {tensor.dims[0]}]")
        if shape[0] > schema.MAX_BATCH_SIZE:
            raise BadRequest(f"batch size {shape[0]} exceeds the maximum {schema.MAX_BATCH_SIZE}")
        values = item.get("data", [])
        if len(values) != shape[0] * shape[1]:
            raise BadRequest(f"input '{tensor.name}': {len(values)} values for shape {shape}")
        if tensor.dtype is schema.DType.STRING:
            arrays[tensor.name] = np.array([v.encode() for v in values], dtype=object).reshape(shape)
        else:
            arrays[tensor.name] = np.asarray(values, dtype=np.float32).reshape(shape)
    extra = set(inputs) - {t.name for t in schema.RANKER_INPUTS}
    if extra:
        raise BadRequest(f"unexpected input(s) {sorted(extra)}")
    if arrays[schema.DENSE.name].shape[0] != arrays[schema.CATEGORICAL.name].shape[0]:
        raise BadRequest("inputs have different batch sizes")
    requested = [o["name"] for o in payload.get("outputs", [])] or [t.name for t in schema.RANKER_OUTPUTS]
    return arrays[schema.DENSE.name], arrays[schema.CATEGORICAL.name], requested


def build_scorer(kind: Kind, repository: str | Path, threads: int = 1):
    """``(dense, categorical) -> {output name: [B x 1] array}`` for the kind."""
    if Kind(kind) is Kind.NAIVE:
        from loadtest.baselines.naive import NaiveScorer

        return NaiveScorer(repository, threads)
    from ensemble.scoring.pipeline import Pipeline

    return Pipeline.from_repository(repository, threads=threads).score


def create_app(kind: Kind, repository: str | Path, threads: int = 1):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    scorer = build_scorer(kind, repository, threads)
    app = FastAPI(title=f"ranker baseline: {Kind(kind).value}")

    @app.get("/v2/health/ready")
    def ready():
        return Response(status_code=200)

    @app.post(schema.RANKER_INFER_PATH)
    async def infer(request: Request):
        try:
            dense, categorical, requested = parse_request(await request.body())
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        # A plain (blocking) call per request: no batching across requests, by design.
        outputs = scorer(dense, categorical)
        body = {"model_name": schema.Model.RANKER.value, "outputs": [
            {"name": name, "datatype": "FP32", "shape": [len(dense), 1],
             "data": np.asarray(outputs[name], np.float32).ravel().tolist()} for name in requested if name in outputs]}
        return JSONResponse(body)

    return app


def serve(kind: Kind, repository: str | Path, host: str = "127.0.0.1", port: int = 8010, threads: int = 1) -> None:
    """Run the baseline with uvicorn (one process, one worker) until interrupted."""
    import uvicorn

    uvicorn.run(create_app(kind, repository, threads), host=host, port=port, log_level="warning",
                access_log=False, workers=1)
