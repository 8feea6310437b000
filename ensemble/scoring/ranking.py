"""Ranking requests: one context, N candidates, scores and the candidates' order.

The context's values are broadcast onto every candidate to make the N rows the ranker scores (the
dataset's tensors put the context's columns first: :mod:`ensemble.dataset`); the answer is every
candidate's score in the order sent and the candidates' indices best first, the first ``k`` when
asked. Ties keep the order the candidates were sent in. The ``rank`` model (``rank_model.py``) and
the in-process pipeline use these functions.
"""

from __future__ import annotations

import numpy as np

from ensemble.schema import MAX_CANDIDATES_PARAMETER


class RankError(ValueError):
    """A ranking request that cannot be answered (no candidates, too many, wrong widths, a negative k)."""


# The rank model scores at most this many rows at a time, checking its deadline between them (the
# native layout), or sends them to the ranker in requests of this size (the python-backend layouts).
CHUNK_ROWS = 1024


def max_candidates(params: dict[str, str], ranker_max_batch_size: int) -> int:
    """The limit a rank model's ``parameters`` set (:data:`MAX_CANDIDATES_PARAMETER`, else the ranker's
    max batch size); a ValueError the load reports when it is not a positive integer."""
    text = params.get(MAX_CANDIDATES_PARAMETER, str(ranker_max_batch_size))
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(f"{MAX_CANDIDATES_PARAMETER} must be a positive integer, not {text!r}")
    return limit


def release_named(value) -> str | None:
    """The release a request's ``ensemble-release`` parameter names (a fleet's gateway sets it), as
    its digits; None without one. Anything but a version number (text, bytes that were not UTF-8 and
    reach here replaced) is the client's error: no release would ever match it."""
    if value is None:
        return None
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()):
        raise RankError(f"ensemble-release must name a release (a version number), not {text[:40]!r}")
    return text


def check_count(candidates: int, limit: int) -> None:
    """Refuse a request of more than ``limit`` candidates, naming the limit."""
    if candidates > limit:
        raise RankError(f"{candidates} candidates: a ranking request takes at most {limit} on this server "
                        f"({MAX_CANDIDATES_PARAMETER}); send them in several requests")


def broadcast(context_dense: np.ndarray | None, context_categorical: np.ndarray | None,
              candidate_dense: np.ndarray, candidate_categorical: np.ndarray,
              context_widths: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray]:
    """The N rows to score: the context's values, then each candidate's, per tensor.

    Args:
        context_dense, context_categorical: 1-D (or [1 x w]) context values; None when the dataset
            has no context columns of that kind.
        candidate_dense, candidate_categorical: [N x w] candidate values.
        context_widths: how many continuous and categorical columns the context has.
    """
    if candidate_dense is None or candidate_categorical is None:
        raise RankError("a ranking request needs candidate_dense and candidate_categorical, or item_ids "
                        "(ranking by ids)")
    candidate_dense = np.asarray(candidate_dense, np.float32)
    candidate_categorical = np.asarray(candidate_categorical, object)
    if candidate_dense.ndim != 2 or candidate_categorical.ndim != 2:
        raise RankError("candidates must be [N x columns] tensors")
    n = candidate_dense.shape[0]
    if n == 0:
        raise RankError("empty candidate list: nothing to rank (send at least one candidate)")
    if candidate_categorical.shape[0] != n:
        raise RankError(f"candidate_dense has {n} candidates, candidate_categorical {candidate_categorical.shape[0]}")
    parts = []
    for name, context, candidates, width, dtype in (
            ("context_dense", context_dense, candidate_dense, context_widths[0], np.float32),
            ("context_categorical", context_categorical, candidate_categorical, context_widths[1], object)):
        values = np.zeros(0, dtype) if context is None else np.asarray(context, dtype).reshape(-1)
        if values.size != width:
            raise RankError(f"{name} has {values.size} values; this dataset's context has {width}")
        parts.append(np.concatenate([np.broadcast_to(values, (n, width)), candidates], axis=1) if width else candidates)
    return parts[0], parts[1]


def top(scores: np.ndarray, k: int | None = None) -> np.ndarray:
    """Candidate indices best first (descending score, ties in the order sent), the first ``k``
    (None or 0: all)."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    if k is not None and k < 0:
        raise RankError(f"top_k must be >= 0 (0: every candidate), not {k}")
    order = np.argsort(-scores, kind="stable").astype(np.int32)
    return order[:k] if k else order
