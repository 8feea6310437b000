"""The python-backend ``model.py`` of the ``rank`` model (export copies this file to ``rank/1``).

A ranking request carries the context once and N candidates, at most ``max_candidates`` (by default
the ranker's max_batch_size; more is refused with INVALID_ARGUMENT naming the limit). This model
broadcasts the context onto the candidates (:mod:`ensemble.scoring.ranking`), has the served
``ranker`` score the N rows in requests of at most :data:`ranking.CHUNK_ROWS` rows, one after the
other (so the ranker's other requests are batched between them), through Triton's in-process
inference calls, and answers ``scores`` (every candidate's, in the order sent) and ``order`` (indices best first, the
first ``top_k`` when given). The ranker scores them under its own admission policy with this
request's timeout, so a ranking request is refused exactly when its rows would be. A request that
names a release in its ``ensemble-release`` parameter (a fleet's gateway sets it) is scored by that
version of the ranker. The model imports numpy only: the frameworks live in the ranker.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble import schema
from ensemble.scoring import ranking


RANK_NICE = 19  # configs.RANK_THREAD_NICE (this file imports numpy and the schema only)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        ranker_rows = int(params.get("ranker_max_batch_size", schema.MAX_BATCH_SIZE))
        self.max_candidates = ranking.max_candidates(params, ranker_rows)
        self.max_rows = min(ranking.CHUNK_ROWS, ranker_rows)
        self.context_widths = (int(params.get("context_dense", 0)), int(params.get("context_categorical", 0)))
        try:  # this thread runs execute too: below the ranker, as the native rank model's threads
            os.setpriority(os.PRIO_PROCESS, 0, RANK_NICE)
        except OSError:
            pass

    def execute(self, requests):
        return [self._rank(request) for request in requests]

    def _rank(self, request):
        try:
            try:  # Triton checked shapes and types; the BYTES contents are read here
                given = {name: _optional(request, name) for name in (
                    schema.CONTEXT_DENSE.name, schema.CONTEXT_CATEGORICAL.name, schema.CANDIDATE_DENSE.name,
                    schema.CANDIDATE_CATEGORICAL.name)}
            except (ValueError, TypeError, RuntimeError) as exc:
                raise ranking.RankError(f"malformed input: {exc}") from None
            if any(_optional(request, t.name) is not None for t in (schema.USER_ID, schema.ITEM_IDS)):
                raise ranking.RankError("ranking by ids (user_id, item_ids) is served by the native layout "
                                        "(ensemble serve --layout native --store URL); send features here")
            candidates = given[schema.CANDIDATE_DENSE.name]
            if candidates is not None and candidates.ndim:
                ranking.check_count(candidates.shape[0], self.max_candidates)
            dense, categorical = ranking.broadcast(
                given[schema.CONTEXT_DENSE.name], given[schema.CONTEXT_CATEGORICAL.name],
                given[schema.CANDIDATE_DENSE.name], given[schema.CANDIDATE_CATEGORICAL.name], self.context_widths)
            k = _optional(request, schema.TOP_K.name)
            k = int(k.reshape(-1)[0]) if k is not None and k.size else None
            if k is not None and k < 0:
                raise ranking.RankError(f"top_k must be >= 0 (0: every candidate), not {k}")
            scores = np.concatenate([self._score(request, dense[s:s + self.max_rows], categorical[s:s + self.max_rows])
                                     for s in range(0, len(dense), self.max_rows)])
            order = ranking.top(scores, k)
        except ranking.RankError as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
        except _RankerError as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message, exc.code))
        return pb_utils.InferenceResponse([pb_utils.Tensor(schema.CANDIDATE_SCORES.name, scores.astype(np.float32)),
                                           pb_utils.Tensor(schema.ORDER.name, order),
                                           pb_utils.Tensor(schema.DROPPED.name, np.empty(0, np.int32))])

    def _score(self, request, dense, categorical):
        call = pb_utils.InferenceRequest(
            model_name=schema.Model.RANKER.value, model_version=_release(request), requested_output_names=[schema.SCORE.name],
            inputs=[pb_utils.Tensor(schema.DENSE.name, np.ascontiguousarray(dense, np.float32)),
                    pb_utils.Tensor(schema.CATEGORICAL.name, np.ascontiguousarray(categorical, object))],
            timeout=request.timeout())
        response = call.exec()
        if response.has_error():
            error = response.error()
            code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL
            raise _RankerError(f"ranker: {error.message()}", code)
        return pb_utils.get_output_tensor_by_name(response, schema.SCORE.name).as_numpy().reshape(-1)


class _RankerError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.message, self.code = message, code


def _release(request) -> int:
    """The ranker version the request's ``ensemble-release`` parameter names; -1 (Triton's choice) without
    one; a :class:`ranking.RankError` when it names none (or the parameters cannot be read)."""
    try:
        value = json.loads(request.parameters() or "{}").get("ensemble-release")
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
        raise ranking.RankError("the request's parameters cannot be read") from None
    named = ranking.release_named(value)
    return int(named) if named is not None else -1


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
