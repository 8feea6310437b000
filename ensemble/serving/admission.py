"""The fused ranker's overload policy: how much of one model call's work it takes.

Why it lives in the model and not in Triton's queue policy: in Triton 2.51 the dynamic batcher
waits for an idle model instance on a condition that only an *accepted* request wakes (the
instance going idle does not); a request refused by ``max_queue_size`` wakes nothing, so once the
queue is full the batcher sleeps its 500 ms default wait while the instance idles, and goodput
collapses (measured: 57 accepted/s of 2,800 offered). Any queue policy also turns off the
batcher's prefetching (``PriorityQueue::support_prefetching_``), which is what hands the instance
its next batch the moment a call returns; without it, two requests arriving together waited
~500 ms at p99 even at light load. So the ranker runs with no queue policy (prefetching on) and
bounds the work here instead.

The rule: Triton hands each call every request that arrived while the previous call ran. The
model predicts the call's cost from a cost model fitted online to its own calls, takes requests
in arrival order while the predicted cost stays within ``budget_s`` (the first two always, only
the first while the previous call refused some: see ``ALWAYS_TAKEN``), and
answers the rest at once with UNAVAILABLE (HTTP 503 / gRPC UNAVAILABLE: the clients retry with
backoff). Every call then lasts about ``budget_s``, so an accepted request waits for at most the
call running when it arrived plus its own. A *bulk* request, one whose own cost on the prior
(the machine measured at load) exceeds the budget (batch scoring's 4,096-row requests), is always
taken: its client bounds its own concurrency, refusing it would only buy a retry, and the small
requests sharing its call wait for it either way (a running call cannot be pre-empted). Bulk is
not judged on the live fit: that grows under overload, and once it put a 32-row request over
the budget every such request was waved through as bulk (latency without bound).

Cost model: seconds = fixed + per_row x rows + per_request x requests, by exponentially weighted
least squares over recent calls, pulled toward a prior measured at load time (a ridge term), so
it follows the machine (another job slowing it, a bigger release) without a setting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class CostPrior:
    """Seconds per call, per row and per request before any call has been observed."""

    fixed: float = 5e-4
    per_row: float = 1e-5
    per_request: float = 5e-5

    def vector(self) -> np.ndarray:
        return np.array([self.fixed, self.per_row, self.per_request])


class CostModel:
    """seconds ~ fixed + per_row x rows (+ the prior's per_request x requests, held fixed),
    refitted after every observed call.

    Only ``fixed`` and ``per_row`` are fitted: under 1-row traffic rows and requests are the same
    number, so a fit of both would split their cost arbitrarily and then misjudge the first
    32-row requests (measured: 8% refused at 40% of capacity after a 1-row run).

    Args:
        prior: the starting coefficients.
        decay: weight of the past per observation (0.98: about the last 50 calls count).
        prior_weight: how many calls' worth of evidence the prior is worth.
    """

    def __init__(self, prior: CostPrior = CostPrior(), decay: float = 0.98, prior_weight: float = 4.0) -> None:
        self.prior = prior
        self.decay = decay
        self._start = np.array([prior.fixed, prior.per_row])
        # Ridge toward the prior, scaled per feature so it counts as `prior_weight` typical calls.
        self._ridge = prior_weight * np.diag([1.0, 64.0**2])
        self._xx = np.zeros((2, 2))
        self._xy = np.zeros(2)
        self.theta = np.array([prior.fixed, prior.per_row, prior.per_request])

    def observe(self, rows: int, requests: int, seconds: float) -> None:
        x = np.array([1.0, rows])
        y = seconds - self.prior.per_request * requests
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * y
        fitted = np.linalg.solve(self._xx + self._ridge, self._xy + self._ridge @ self._start)
        self.theta[:2] = np.maximum(fitted, 0.0)  # a negative cost would admit without bound

    def predict(self, rows: int, requests: int) -> float:
        return float(self.theta[0] + self.theta[1] * rows + self.theta[2] * requests)


# How many of a call's first requests are taken whatever the budget says. Two while the ranker is
# not refusing: two clients at once are never refused, even with requests near the budget on their
# own (a 100-row request costs 2.5-5 ms here, so a budget alone would refuse the second of two).
# Once a call has refused (overload), one, until a call refuses nothing again: with two, every call
# of requests costing more than half the budget took two of them and lasted twice the budget, and
# an accepted request waits for the running call plus its own (measured, 96-row requests at 2x of
# capacity, two sets of three alternating runs: accepted p99 13.4-18.1 -> 9.7-14.7 ms, refusals
# 5.9-7.8 -> 4.4-6.5 ms at the median; goodput the same to 30% lower: fewer rows share each call's
# fixed cost).
ALWAYS_TAKEN = 2
ALWAYS_TAKEN_OVERLOADED = 1


class Admission:
    """Decides which requests of one call are scored (see the module docstring).

    Args:
        budget_s: predicted seconds one call may take on small requests.
        cost: the call-cost model (observed through :meth:`observe`).
    """

    def __init__(self, budget_s: float, cost: CostModel | None = None) -> None:
        if budget_s <= 0:
            raise ValueError(f"call budget must be > 0 s, got {budget_s}")
        self.budget_s = budget_s
        self.cost = cost or CostModel()
        self.refused = 0
        self._refusing = False  # the previous call refused a request: overload

    def admit(self, rows: Sequence[int]) -> list[bool]:
        """``rows[i]`` = rows of the call's i-th valid request, in arrival order -> taken or not."""
        theta, prior = self.cost.theta, self.cost.prior
        one = [float(theta[1] * r + theta[2]) for r in rows]  # each request's own marginal cost
        always = ALWAYS_TAKEN_OVERLOADED if self._refusing else ALWAYS_TAKEN
        taken: list[bool] = []
        spent, count = float(theta[0]), 0
        for r, cost in zip(rows, one):
            # Bulk is judged on the prior (the unloaded machine), not on the live fit: the fit
            # grows under overload, and judged by it every request became bulk and was waved
            # through (measured: 32-row requests at 2x, latency without bound).
            bulk = prior.fixed + prior.per_row * r + prior.per_request > self.budget_s
            ok = bulk or count < always or spent + cost <= self.budget_s
            if ok and not bulk:
                spent += cost
            count += ok
            taken.append(ok)
        refused = taken.count(False)
        self.refused += refused
        self._refusing = refused > 0
        return taken

    def observe(self, rows: int, requests: int, seconds: float) -> None:
        """Record a finished call: ``rows`` over ``requests`` scored in ``seconds``."""
        self.cost.observe(rows, requests, seconds)


def calibrate(score, rows: tuple[int, int] = (1, 256), repeats: int = 5) -> CostPrior:
    """The prior's per-call and per-row cost, timed on ``score(rows)`` (a callable scoring that
    many all-missing rows) at two batch sizes, medians of ``repeats``; per-request keeps its default
    (the stub's per-request handling is not visible from inside one call)."""
    def median_seconds(n: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            score(n)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    small, large = (median_seconds(n) for n in rows)
    per_row = max((large - small) / (rows[1] - rows[0]), 0.0)
    return CostPrior(fixed=max(small - per_row * rows[0], 0.0), per_row=per_row)
