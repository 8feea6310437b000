import itertools

import numpy as np

from ensemble.models import metrics


def test_auc_matches_pair_counting():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    s = np.round(rng.random(200), 1)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos, neg)]
    assert metrics.auc(y, s) == np.mean(pairs)


def test_auc_extremes_and_log_loss():
    y = np.array([0, 0, 1, 1])
    assert metrics.auc(y, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert metrics.auc(y, np.array([0.9, 0.8, 0.2, 0.1])) == 0.0
    assert np.isnan(metrics.auc(np.ones(3), np.ones(3)))
    assert metrics.log_loss(y, np.full(4, 0.5)) == np.log(2)
