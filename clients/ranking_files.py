"""Rank a file of groups: each group is one context and its candidate rows (``ensemble rank``).

The input is a table with the dataset spec's columns (CSV/TSV with a header, or Parquet) and a group
column (a user, a query, a session). Each group becomes one ranking request: the context's values
from the group's rows (they must agree), the rows as its candidates, in file order. The output has
one row per candidate: the group, the candidate's row number in the input, its score and its rank
(1 = best), or only the best ``k`` of each group. With a label column, NDCG@k and MRR are reported
per the groups that have a positive and a negative candidate.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from ensemble.dataset import DatasetSpec


class GroupError(ValueError):
    """A group whose rows disagree on a context value (no single context to send)."""


@dataclass(frozen=True)
class RankSummary:
    groups: int
    candidates: int
    seconds: float
    quality: object | None  # ensemble.models.metrics.RankingQuality when the input has labels


def _contexts(frame: pd.DataFrame, spec: DatasetSpec, group: str) -> pd.DataFrame:
    """The context row of every group, refusing a group whose rows disagree on a context column."""
    if not spec.context:
        return pd.DataFrame(index=pd.Index(frame[group].unique(), name=group))
    columns = list(spec.context)
    distinct = frame.groupby(group, sort=False)[columns].nunique(dropna=False)
    bad = distinct[(distinct > 1).any(axis=1)]
    if len(bad):
        key = bad.index[0]
        column = next(c for c in columns if bad.loc[key, c] > 1)
        raise GroupError(f"group {key!r}: context column {column!r} differs between its rows; a group is one "
                         f"context (group by a column that identifies it)")
    return frame.groupby(group, sort=False)[columns].first()


def rank_frame(frame: pd.DataFrame, spec: DatasetSpec, group: str, rank: Callable, k: int | None = None,
               concurrency: int = 4) -> pd.DataFrame:
    """Rank every group of ``frame``; ``rank(context, candidates, k)`` answers one request (a
    :meth:`clients.triton.RankerClient.rank` or the in-process equivalent).

    Returns:
        ``group``, ``row`` (0-based row of the input), ``score``, ``rank`` (1 = best), best first per
        group, groups in order of first appearance.
    """
    if group not in frame.columns:
        raise ValueError(f"no group column {group!r} in the input (it has {', '.join(map(str, frame.columns[:20]))})")
    contexts = _contexts(frame, spec, group)
    rows = frame.groupby(group, sort=False).indices

    def one(key):
        members = rows[key]
        context = contexts.loc[key].to_dict() if spec.context else None
        answer = rank(context, frame.iloc[members], k)
        order = np.asarray(answer.order)
        return pd.DataFrame({group: key, "row": members[order], "score": np.asarray(answer.scores)[order],
                             "rank": np.arange(1, len(order) + 1)})

    with cf.ThreadPoolExecutor(max(1, concurrency)) as pool:
        parts = list(pool.map(one, contexts.index))
    if not parts:
        return pd.DataFrame({group: [], "row": [], "score": [], "rank": []})
    return pd.concat(parts, ignore_index=True)


def quality(frame: pd.DataFrame, spec: DatasetSpec, group: str, ranked: pd.DataFrame, k: int = 10):
    """NDCG@k and MRR of the ranking (every candidate ranked) against the input's labels."""
    from ensemble.models.metrics import ranking_quality

    ordered = ranked.sort_values([group, "rank"], kind="stable")
    return ranking_quality(ordered[group].to_numpy(), frame[spec.label].to_numpy()[ordered["row"].to_numpy()],
                           -ordered["rank"].to_numpy(np.float64), k)


def rank_files(paths: Sequence[str | Path], output: str | Path, spec: DatasetSpec, group: str, rank: Callable,
               k: int | None = None, concurrency: int = 4, metric_k: int = 10) -> RankSummary:
    """Read the files (:func:`ensemble.data.tables.read_table`), rank every group, write ``output``
    (Parquet, or CSV by suffix)."""
    import time

    from ensemble.data import tables

    start = time.perf_counter()
    frame = tables.read_table(paths, spec, with_label=False)
    labelled = spec.label in frame.columns and frame[spec.label].notna().all()
    ranked = rank_frame(frame, spec, group, rank, k, concurrency)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix.lower() == ".csv":
        ranked.to_csv(output, index=False)
    else:
        ranked.to_parquet(output, index=False)
    measured = None
    if labelled and k is None:
        measured = quality(frame, spec, group, ranked, metric_k)
    return RankSummary(int(ranked[group].nunique()) if len(ranked) else 0, len(frame), time.perf_counter() - start,
                       measured)
