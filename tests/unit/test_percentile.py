"""One percentile for every benchmark, demo and load test: the nearest rank (docs/load-testing.md)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from loadtest.statistics import percentile

ROOT = Path(__file__).resolve().parents[2]


def test_nearest_rank_is_an_actual_sample_at_rank_ceil_q_n():
    assert percentile([4, 1, 3, 2], 0.5) == 2 and percentile([4, 1, 3, 2], 0.75) == 3
    assert percentile([4, 1, 3, 2], 0.0) == 1 and percentile([4, 1, 3, 2], 1.0) == 4
    samples = np.random.default_rng(0).exponential(size=300)
    p99 = percentile(samples, 0.99)
    assert p99 == sorted(samples)[296] and p99 in samples  # rank ceil(297) of 300
    assert math.isnan(percentile([], 0.99))
    with pytest.raises(ValueError):
        percentile([1.0], 99)  # a percent where a fraction belongs


def test_no_other_percentile_rule_reports_a_figure():
    """The benchmarks, the demos and the load tests take their percentiles from loadtest.statistics
    (perf_analyzer's and wrk's own reports aside: those tools compute theirs)."""
    offenders = []
    for folder in ("benchmarks", "loadtest", "ensemble"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for pattern in (r"np\.percentile\(", r"np\.quantile\(", r"statistics\.quantiles\(", r"def _?percentile\("):
                if re.search(pattern, text) and path.relative_to(ROOT).as_posix() != "loadtest/statistics.py":
                    offenders.append(f"{path.relative_to(ROOT)}: {pattern}")
    assert offenders == []
