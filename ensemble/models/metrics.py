"""AUC, log loss and ranking metrics (NDCG@k, MRR) in numpy (no scikit-learn dependency)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve, ties counted as half (Mann-Whitney U)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average rank within groups of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [scores.size]])
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probabilities, dtype=np.float64).ravel(), eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def ranking_order(scores: np.ndarray) -> np.ndarray:
    """Candidates best first: descending score, ties kept in the order the candidates came in."""
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")


@dataclass(frozen=True)
class RankingQuality:
    """Mean NDCG@k and MRR over the groups that have a positive and a negative candidate."""

    ndcg: float
    mrr: float
    k: int
    groups: int  # groups evaluated
    skipped: int  # groups with only positives or only negatives (every order scores the same)


def ranking_quality(groups: np.ndarray, labels: np.ndarray, scores: np.ndarray, k: int = 10) -> RankingQuality:
    """NDCG@k (binary gains, log2 discount) and mean reciprocal rank of the first positive.

    Args:
        groups: [N] one id per candidate; a group is one context's candidate list, in the order
            the candidates would be sent (ties in ``scores`` keep it).
        labels: [N] 0/1 relevance.
        scores: [N] the ranker's scores (higher first).
    """
    groups, labels, scores = np.asarray(groups).ravel(), np.asarray(labels).astype(bool).ravel(), np.asarray(scores).ravel()
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    ndcgs, rrs, skipped = [], [], 0
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    for g in np.argsort(first):  # groups in order of first appearance
        member = np.flatnonzero(inverse == g)
        relevant = labels[member]
        n_pos = int(relevant.sum())
        if n_pos == 0 or n_pos == member.size:
            skipped += 1
            continue
        ranked = relevant[ranking_order(scores[member])]
        top = ranked[:k]
        ndcgs.append(float(discount[:top.size][top].sum() / discount[:min(n_pos, k)].sum()))
        rrs.append(1.0 / (int(np.argmax(ranked)) + 1))
    if not ndcgs:
        return RankingQuality(float("nan"), float("nan"), k, 0, skipped)
    return RankingQuality(float(np.mean(ndcgs)), float(np.mean(rrs)), k, len(ndcgs), skipped)
