"""The fused ranker's admission: a request is refused only when it would miss its deadline.

**Deadline.** A request's deadline, counted from its arrival, is the sooner of its client's timeout
(Triton's ``timeout`` request parameter; the project's clients always send theirs) and the server's
latency objective (``ensemble serve --latency-objective-ms``; the default and why it is what it is:
:data:`ensemble.repository.configs.DEFAULT_OBJECTIVE_MS`).
A *bulk* request is one its client marks so (the ``schema.BULK_PARAMETER`` request parameter,
which batch scoring sends), or one that could not meet the objective even alone on an idle server.
It is never held to the objective: it waits its turn behind the work ahead of it, for as long as its
client's timeout allows, *while no interactive request is being served*. Bulk yields to interactive
traffic: once a call has held an interactive request, and for :data:`YIELD_S` (or the objective,
if longer) after, a bulk request's
deadline is at most its own scoring plus half the objective (:data:`BULK_WAIT`), whatever its
parameters. Triton's queue is first come, first served, so bulk requests queued ahead of an
interactive one are what it waits for; holding them to that bound refuses (503, retryable) the ones
that have waited longer, and an interactive request arriving behind a bulk flood waits about half
its objective for the bulk ahead of it, not the flood's length. Batch scoring on a server with no
interactive traffic keeps the whole model; beside interactive traffic it gets what is left within
the bound, and its client retries what is refused. The served rankers go further: beside
interactive traffic they hand the bulk requests a call holds to a bulk lane (a thread at nice 19:
``backend.c`` in the native layout, ``model.py`` in the fused one) instead of planning them
here, so none waits in Triton's queue ahead of an interactive one.

**Prediction.** The model sees requests only when Triton hands it a call: every request that
arrived while the previous call ran, in arrival order (dynamic batching with prefetching). A
request of this call waited at most since the previous call started (when the instance ran back to
back; after an idle instance, only the hand-off). It completes when this call's scoring ends plus
the response hand-off of every request in the call and the front end's share (:data:`DOOR_S`).
Scoring is priced by :class:`CostModel` (fitted online to the model's own calls, at the 90th
percentile of how far calls run past the fit), the hand-off by :class:`HandOff` (fitted online to
the gaps between back-to-back calls). Requests are taken in arrival order while every taken request's
predicted completion stays within its deadline; the others are answered at once with UNAVAILABLE
(HTTP 503 / gRPC UNAVAILABLE, retryable) and a message that says by how much they would miss.

**Refusals are answered promptly.** A refused request is answered when its call returns. So once a
call must refuse for capacity, it also keeps itself short enough that its refusals come back
within half of their deadline (half the time the client had, left for it to retry elsewhere):
predicted wait (half the window, on average) + the call <= deadline / 2; its first request that
meets its own deadline is still taken (progress). Under ordinary load nothing is refused and no
such bound applies: a closed loop of clients is queued and batched, whatever its concurrency, as
long as each request still completes within its deadline.

**Bulk requests in a call with interactive ones** are scored after them; the interactive
responses are sent first (through Triton's response sender), so a batch-scoring request does not
make the interactive requests beside it wait for its rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ensemble import schema

try:
    from ensemble.native import _admission
except ImportError:  # built without a C compiler: the Python policy serves
    _admission = None


@dataclass(frozen=True)
class CostPrior:
    """Seconds per call, per row and per request before any call has been observed."""

    fixed: float = 5e-4
    per_row: float = 1e-5
    per_request: float = 5e-5

    def alone(self, rows: int) -> float:
        """One request of ``rows`` rows in a call of its own."""
        return self.fixed + self.per_row * rows + self.per_request


# The cost model also tracks how far calls run past its prediction: admission plans with the 90th
# percentile of that ratio, so an accepted request's deadline holds for slow calls too (measured on
# the build VM under 2x overload: 1.25x at the 90th percentile, 1.5x at the 99th).
TAIL_QUANTILE = 0.9
TAIL_STEP = 0.02


# What a request's latency holds that the model cannot see: the front end reading it before it is
# queued and writing its answer after the call (on the server's one core, between the model's
# work). Measured on the build VM under open-loop overload with a 10 ms objective: accepted
# requests' p99 came out 1.5-2 ms above what the model planned, refusals' median ~1 ms above.
DOOR_S = 1.5e-3


class CostModel:
    """Scoring seconds of one call ~ fixed + per_row x rows (+ the prior's per_request x requests,
    held fixed), refitted after every observed call; ``tail``: the 90th percentile of observed /
    predicted.

    Only ``fixed`` and ``per_row`` are fitted: under 1-row traffic rows and requests are the same
    number, so a fit of both would split their cost arbitrarily and then misjudge the first
    32-row requests.

    Args:
        prior: the starting coefficients.
        decay: weight of the past per observation (0.98: about the last 50 calls count).
        prior_weight: how many calls' worth of evidence the prior is worth.
    """

    def __init__(self, prior: CostPrior = CostPrior(), decay: float = 0.98, prior_weight: float = 4.0) -> None:
        self.prior = prior
        self.decay = decay
        # Ridge toward the prior, scaled per feature so it counts as `prior_weight` typical calls
        # (of 64 rows); in floats, not numpy: it runs once per call, on the serving path.
        self._ridge = (prior_weight, prior_weight * 64.0**2)
        self._xx = [0.0, 0.0, 0.0]  # sum of weights, of weighted rows, of weighted rows^2
        self._xy = [0.0, 0.0]
        self.fixed, self.per_row, self.per_request = prior.fixed, prior.per_row, prior.per_request
        self.tail = 1.0  # calls at the 90th percentile take this many times the fit's prediction

    @property
    def theta(self) -> tuple[float, float, float]:
        return self.fixed, self.per_row, self.per_request

    def observe(self, rows: int, requests: int, seconds: float) -> None:
        predicted = self.predict(rows, requests)
        if predicted > 0:  # the tail ratio's 90th percentile, by stochastic approximation
            above = seconds > predicted * self.tail
            self.tail = min(max(self.tail + TAIL_STEP * (TAIL_QUANTILE if above else TAIL_QUANTILE - 1), 1.0), 3.0)
        d, xx, xy = self.decay, self._xx, self._xy
        y = seconds - self.prior.per_request * requests
        xx[0], xx[1], xx[2] = d * xx[0] + 1.0, d * xx[1] + rows, d * xx[2] + rows * rows
        xy[0], xy[1] = d * xy[0] + y, d * xy[1] + rows * y
        a, b, c = xx[0] + self._ridge[0], xx[1], xx[2] + self._ridge[1]
        u, v = xy[0] + self._ridge[0] * self.prior.fixed, xy[1] + self._ridge[1] * self.prior.per_row
        det = a * c - b * b
        # a negative cost would admit without bound
        self.fixed, self.per_row = max((c * u - b * v) / det, 0.0), max((a * v - b * u) / det, 0.0)

    def predict(self, rows: int, requests: int) -> float:
        return self.fixed + self.per_row * rows + self.per_request * requests

    def marginal(self, rows: int) -> float:
        """What one more request of ``rows`` rows adds to a call."""
        return self.per_row * rows + self.per_request

    def optimistic_alone(self, rows: int) -> float:
        """The cheaper of the prior's and the fit's price of a request alone: the fit grows under
        overload, and judged by it alone a mid-size request would pass as bulk and be waved through."""
        return min(self.prior.alone(rows), self.predict(rows, 1))


class HandOff:
    """Seconds per request that a call costs outside the model's own code: Triton staging the
    inputs, the python backend's round trip, the responses going back to the front end.

    Fitted as the gap between the end of one call and the start of the next when they ran back to
    back, divided by the requests of both calls (an exponentially weighted ratio, so it follows the
    machine). Measured on the build VM: 0.1-0.3 ms per 1-row request and up to ~0.8 ms per 100-row
    request while the HTTP front end parses on the same core.
    """

    def __init__(self, per_request: float = 1.5e-4, decay: float = 0.95, prior_weight: float = 4.0) -> None:
        self.decay = decay
        self._seconds = prior_weight * per_request
        self._requests = prior_weight

    @property
    def per_request(self) -> float:
        return self._seconds / self._requests

    def observe(self, gap_s: float, requests: int) -> None:
        self._seconds = self.decay * self._seconds + gap_s
        self._requests = self.decay * self._requests + requests

    def busy_gap(self, requests: int) -> float:
        """The longest gap between calls that still counts as back to back (beyond it the instance
        sat idle): twice the expected hand-off plus half a millisecond of scheduling noise. Not
        more: at light load requests come a few milliseconds apart, and an idle gap counted as busy
        adds the previous call to every wait (measured: 96-row requests at 150/s, a third refused
        with a 10 ms objective when the margin was 2 ms)."""
        return 2 * self.per_request * requests + 5e-4


@dataclass(frozen=True)
class Request:
    """What admission knows of one request of a call.

    Attributes:
        rows: its batch size.
        timeout_s: its client's timeout in seconds (0: none sent).
        bulk: marked bulk by its client (``schema.BULK_PARAMETER``).
    """

    rows: int
    timeout_s: float = 0.0
    bulk: bool = False


@dataclass
class Plan:
    """One call's decisions, by request index: ``first`` scored and answered first (interactive),
    ``bulk`` scored after them, ``refused`` answered UNAVAILABLE with the message given; ``crowded``:
    the refused ones that would have met their deadline on their own (refused for the work ahead)."""

    first: list[int] = field(default_factory=list)
    bulk: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    crowded: list[int] = field(default_factory=list)

    @property
    def taken(self) -> list[int]:
        return self.first + self.bulk


OBJECTIVE, TIMEOUT = "the server's latency objective", "the request's timeout"
BULK = "a bulk request's bound beside interactive traffic"
# Beside interactive traffic a bulk request may wait this share of the objective before its scoring ends;
# "beside" lasts this long (or the objective, if longer) after a call that held an interactive request.
BULK_WAIT = 0.5
YIELD_S = 1.0


# A refusal's text, given (predicted ms, deadline ms, what sets the deadline): one template for the
# Python policy and the compiled one.
REFUSAL_FORMAT = (schema.OVERLOAD_REFUSAL.replace("%", "%%")
                  + "it would miss its deadline (predicted %.1f ms > %.1f ms, %s); retry with backoff")


def refusal(predicted_s: float, deadline_s: float, which: str) -> str:
    """The text of a refusal for a request that would miss its deadline."""
    return REFUSAL_FORMAT % (predicted_s * 1e3, deadline_s * 1e3, which)


AT_CAPACITY = (f"{schema.OVERLOAD_REFUSAL}the ranker is at capacity (a call that refuses takes no more than lets "
               "its refusals be answered within half their deadline); retry with backoff")


class Admission:
    """Decides which requests of one call are scored (see the module docstring).

    Args:
        objective_s: the server's latency objective in seconds.
        cost: the scoring-cost model; hand_off: the per-request cost outside the model's code.
    """

    def __init__(self, objective_s: float, cost: CostModel | None = None,
                 hand_off: HandOff | None = None) -> None:
        if not objective_s > 0:
            raise ValueError(f"latency objective must be > 0 ms, got {objective_s * 1e3:g}")
        self.objective_s = objective_s
        self.cost = cost or CostModel()
        self.hand_off = hand_off or HandOff()
        self._last: tuple[float, float, int] | None = None  # (start, end, requests) of the previous call
        self._idle = True  # the current call started on an idle instance (not back to back)
        self._interactive_at = -math.inf  # when a call last held an interactive request

    def waited(self, now: float, requests: int) -> float:
        """How long the requests of a call starting ``now`` can have waited: since the previous call
        started when it ran back to back with this one, else only the hand-off. It also records the
        back-to-back gap for the hand-off fit."""
        self._idle = True
        if self._last is None:
            return self.hand_off.per_request * requests
        start, end, before = self._last
        gap, busy = now - end, self.hand_off.busy_gap(before + requests)
        if requests > 1:  # requests queued while the previous call ran: most likely a back-to-back gap
            self.hand_off.observe(min(gap, 2 * busy), before + requests)  # (bounded: it may hold idle time)
        if gap <= busy:
            self._idle = False
            return now - start
        return self.hand_off.per_request * requests

    def deadline(self, request: Request, yielding: bool = False) -> tuple[float, str]:
        """Seconds from arrival, and what sets them; ``yielding``: interactive requests are being
        served (a bulk request's bound applies)."""
        timeout = request.timeout_s if request.timeout_s > 0 else math.inf
        if self.is_bulk(request):
            bound = self.cost.tail * self.cost.predict(request.rows, 1) + BULK_WAIT * self.objective_s if yielding else math.inf
            return (bound, BULK) if bound < timeout else (timeout, TIMEOUT)
        if timeout < self.objective_s:
            return timeout, TIMEOUT
        return self.objective_s, OBJECTIVE

    def is_bulk(self, request: Request) -> bool:
        return request.bulk or self.cost.optimistic_alone(request.rows) > self.objective_s

    def plan(self, requests: Sequence[Request], now: float | None = None) -> Plan:
        """The call's plan for ``requests`` (in arrival order) handed over at ``now``."""
        now = time.perf_counter() if now is None else now
        waited = self.waited(now, len(requests))
        hand_off = self.hand_off.per_request * len(requests) + DOOR_S
        tail = self.cost.tail
        bulk = [self.is_bulk(r) for r in requests]
        if not all(bulk):
            self._interactive_at = now
        yielding = now - self._interactive_at <= max(YIELD_S, self.objective_s)
        priced = [(b, *self.deadline(r, yielding), tail * self.cost.marginal(r.rows)) for b, r in zip(bulk, requests)]
        plan = self._greedy(priced, waited, hand_off, cap=math.inf)
        if not plan.taken and self._idle:
            self._take_one_at_prior(plan, requests, priced, waited, hand_off)
        # Keep the refusals prompt: wait (half the window on average) + call <= deadline / 2. The
        # first request that meets its own deadline is taken even when it alone exceeds that (the
        # ranker always makes progress): with no bound then, such a call took everything its
        # deadlines allowed, ran long, and every request that arrived meanwhile missed its deadline
        # in the next call (calls alternated between too long and empty under 2x overload).
        if plan.crowded and plan.first:
            cap = min(priced[i][1] for i in plan.crowded) / 2 - waited / 2 - hand_off
            plan = self._greedy(priced, waited, hand_off, cap=cap)
        return plan

    def _take_one_at_prior(self, plan: Plan, requests: Sequence[Request], priced: list, waited: float,
                           hand_off: float) -> None:
        """A call on an idle instance that would take nothing takes its first request that meets its
        deadline at the prior's price (calibrated at load). The fit learns only from scored calls: one
        inflated by a starved stretch (calls slowed by a front end parsing a flood) would otherwise
        refuse every later request, on an idle server too, and never see a call to correct it."""
        for i, (bulk, deadline, _, _) in enumerate(priced):
            if not bulk and self.cost.prior.alone(requests[i].rows) <= deadline - waited - hand_off:
                plan.refused.pop(i, None)
                if i in plan.crowded:
                    plan.crowded.remove(i)
                plan.first.append(i)
                return

    def _greedy(self, priced: list[tuple[bool, float, str, float]], waited: float, hand_off: float,
                cap: float) -> Plan:
        """Take requests in arrival order while every taken one meets its deadline (and the call's
        scoring stays within ``cap``); ``priced[i]`` = (bulk, deadline, what set it, marginal cost
        at the 90th percentile)."""
        plan = Plan()
        fixed = self.cost.tail * self.cost.fixed
        spent = fixed  # the call's scoring so far, at the 90th percentile
        room = math.inf  # the most it may reach: the taken requests' deadlines, less wait and hand-off
        for i, (bulk, deadline, which, marginal) in enumerate(priced):
            if bulk:
                continue  # after the interactive ones
            own = deadline - waited - hand_off
            if fixed + marginal > own:
                plan.refused[i] = refusal(waited + fixed + marginal + hand_off, deadline, which)
            elif spent + marginal <= min(room, own, cap if plan.first else math.inf):
                plan.first.append(i)
                spent += marginal
                room = min(room, own)
            else:
                meets = spent + marginal <= min(room, own)
                plan.refused[i] = AT_CAPACITY if meets else refusal(waited + spent + marginal + hand_off, deadline, which)
                plan.crowded.append(i)
        for i, (bulk, deadline, which, marginal) in enumerate(priced):
            if not bulk:
                continue
            if waited + spent + marginal + hand_off > deadline:
                plan.refused[i] = refusal(waited + spent + marginal + hand_off, deadline, which)
            else:
                plan.bulk.append(i)
                spent += marginal
        return plan

    def finished(self, start: float, end: float, requests: int, rows: int, scored: int) -> None:
        """Record a call: handed ``requests`` requests at ``start``; ``scored`` of them (``rows``
        rows) were scored by ``end``."""
        if scored:
            self.cost.observe(rows, scored, end - start)
        self._last = (start, end, requests)

    @property
    def last_call(self) -> tuple[float, float, int] | None:
        """(start, end, requests) of the last call recorded, or None."""
        return self._last


class NativeAdmission:
    """An :class:`Admission` in C (``ensemble/native/_admission.c``), starting from ``policy``'s
    state: the same arithmetic in the same order, so the same plans and fits (tested side by side),
    and :attr:`native`, the object the native backend plans calls through with no Python call."""

    def __init__(self, policy: Admission) -> None:
        cost, hand_off = policy.cost, policy.hand_off
        state = (cost.prior.fixed, cost.prior.per_row, cost.prior.per_request, cost.decay, *cost._ridge, *cost._xx,
                 *cost._xy, cost.fixed, cost.per_row, cost.per_request, cost.tail,
                 hand_off.decay, hand_off._seconds, hand_off._requests)
        self.objective_s = policy.objective_s
        self.native = _admission.Admission(policy.objective_s, tuple(float(v) for v in state),
                                           (REFUSAL_FORMAT, OBJECTIVE, TIMEOUT, AT_CAPACITY, BULK))

    def plan(self, requests: Sequence[Request], now: float | None = None) -> Plan:
        """:meth:`Admission.plan`."""
        first, bulk, refused, crowded = self.native.plan(
            tuple(int(r.rows) for r in requests), tuple(float(r.timeout_s) for r in requests),
            tuple(bool(r.bulk) for r in requests), time.perf_counter() if now is None else now)
        return Plan(list(first), list(bulk), dict(refused), list(crowded))

    def finished(self, start: float, end: float, requests: int, rows: int, scored: int) -> None:
        """:meth:`Admission.finished`."""
        self.native.finished(start, end, requests, rows, scored)

    @property
    def last_call(self) -> tuple[float, float, int] | None:
        """(start, end, requests) of the last call recorded, or None."""
        return self.native.state()[4]


def serving_policy(objective_s: float, cost: CostModel) -> Admission | NativeAdmission:
    """The policy a served ranker runs: in C when the extension was built, else in Python."""
    policy = Admission(objective_s, cost)
    return NativeAdmission(policy) if _admission is not None else policy


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
