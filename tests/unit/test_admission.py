"""The fused ranker's admission: the online cost models and which requests a call takes."""

import time

import numpy as np
import pytest

from ensemble import schema
from ensemble.serving.admission import (AT_CAPACITY, BULK, DOOR_S, Admission, CostModel, CostPrior, HandOff, NativeAdmission,
                                        Request, calibrate)

TRUE = CostPrior(fixed=6e-4, per_row=2e-5, per_request=4e-5)
HAND_OFF = 1e-4  # seconds per request outside the model's code


def observe_calls(model: CostModel, calls: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        requests = int(rng.integers(1, 40))
        rows = int(rng.integers(requests, 40 * requests))
        seconds = TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * requests
        model.observe(rows, requests, seconds * rng.normal(1.0, 0.02))


def admission(objective_ms: float) -> Admission:
    return Admission(objective_ms / 1e3, CostModel(TRUE), HandOff(HAND_OFF))


def back_to_back(policy: Admission, calls: list[list[Request]], start: float = 0.0) -> list:
    """Run calls one after another, each lasting what the cost model predicts for what it took;
    the plans."""
    plans, now = [], start
    for requests in calls:
        plan = policy.plan(requests, now)
        rows = sum(requests[i].rows for i in plan.taken)
        end = now + policy.cost.predict(rows, len(plan.taken))
        policy.finished(now, end, len(requests), rows, len(plan.taken))
        plans.append(plan)
        now = end + HAND_OFF * len(requests)
    return plans


def test_cost_model_converges_to_the_observed_costs_from_a_wrong_prior():
    model = CostModel(CostPrior(fixed=1e-3, per_row=1e-4, per_request=TRUE.per_request))
    assert model.predict(320, 10) == pytest.approx(1e-3 + 320e-4 + 10 * TRUE.per_request)  # the prior
    observe_calls(model, 300)
    for rows, requests in ((1, 1), (32, 1), (320, 10), (4096, 1)):
        expected = TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * requests
        assert model.predict(rows, requests) == pytest.approx(expected, rel=0.1, abs=1e-4)


def test_one_row_traffic_does_not_mislead_the_cost_of_bigger_requests():
    model = CostModel(TRUE)
    for n in range(1, 200):  # rows == requests: one row each
        model.observe(n % 40 + 1, n % 40 + 1, TRUE.fixed + (TRUE.per_row + TRUE.per_request) * (n % 40 + 1))
    assert model.predict(32, 1) == pytest.approx(TRUE.fixed + 32 * TRUE.per_row + TRUE.per_request, rel=0.05)


def test_cost_model_follows_a_machine_that_slows_down():
    model = CostModel(TRUE)
    observe_calls(model, 100)
    rng = np.random.default_rng(1)
    for _ in range(300):  # another job now takes half the core: every call costs twice as much
        requests = int(rng.integers(1, 40))
        rows = int(rng.integers(requests, 40 * requests))
        model.observe(rows, requests, 2 * (TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * requests))
    slow = 2 * (TRUE.fixed + 320 * TRUE.per_row + 10 * TRUE.per_request)
    assert model.predict(320, 10) == pytest.approx(slow, rel=0.1)


def test_hand_off_follows_the_gaps_between_back_to_back_calls():
    hand_off = HandOff(per_request=1e-4)
    for _ in range(200):
        hand_off.observe(gap_s=3e-4 * 10, requests=10)
    assert hand_off.per_request == pytest.approx(3e-4, rel=0.01)


def test_ordinary_concurrency_is_never_refused():
    """32 clients in a closed loop of 100-row requests: each call holds what arrived during the
    previous one, and every request still completes well within the default objective."""
    policy = admission(500)
    calls = [[Request(100, timeout_s=60.0) for _ in range(n)] for n in (1, 31, 1, 31, 16, 16, 32, 32)]
    plans = back_to_back(policy, calls)
    assert all(not plan.refused for plan in plans)
    assert [len(plan.taken) for plan in plans] == [len(c) for c in calls]


def test_a_call_takes_requests_in_arrival_order_and_says_why_it_refuses_the_others():
    policy = admission(20)
    # the first call after an idle instance: no wait but the inputs' hand-off; 32-row requests cost
    # 680 us each after the 600 us fixed cost, and every request's answer is handed off after the call
    requests = [Request(32)] * 30
    plan = policy.plan(requests, now=0.0)
    waited, hand_off = HAND_OFF * 30, HAND_OFF * 30 + DOOR_S  # the answers' hand-off and the front end's share
    each = 32 * TRUE.per_row + TRUE.per_request
    within_deadline = int((20e-3 - waited - hand_off - TRUE.fixed) / each)
    within_cap = int((20e-3 / 2 - waited / 2 - hand_off - TRUE.fixed) / each)
    assert 1 < within_cap < within_deadline < 30
    assert plan.first == list(range(within_cap))
    assert sorted(plan.refused) == list(range(within_cap, 30))
    # each of the others could have been scored in time alone: refused for capacity, and told so
    assert set(plan.refused.values()) == {AT_CAPACITY} and AT_CAPACITY.startswith(schema.OVERLOAD_REFUSAL)
    # with the same requests queued for longer than the objective, they would miss it: told so
    late = admission(10)
    late.finished(start=0.0, end=11e-3, requests=1, rows=400, scored=1)  # they arrived while it ran
    missed = late.plan(requests, now=11.1e-3)
    assert not missed.first and "would miss its deadline" in missed.refused[0]
    assert "the server's latency objective" in missed.refused[0]


def test_a_request_whose_own_timeout_cannot_be_met_is_refused_at_once():
    policy = admission(500)
    # 100 rows cost 2.64 ms: a 1 ms timeout cannot be met even on an idle server; the others can
    plan = policy.plan([Request(1), Request(100, timeout_s=1e-3), Request(100, timeout_s=5.0)], now=0.0)
    assert plan.first == [0, 2] and list(plan.refused) == [1]
    assert "the request's timeout" in plan.refused[1] and "> 1.0 ms" in plan.refused[1]


def test_the_wait_counts_from_the_previous_call_only_when_the_instance_ran_back_to_back():
    policy = admission(500)
    policy.finished(start=0.0, end=5e-3, requests=4, rows=400, scored=4)
    assert policy.waited(5.5e-3, 4) == pytest.approx(5.5e-3)  # queued during the previous call
    policy.finished(start=5.5e-3, end=9e-3, requests=4, rows=400, scored=4)
    assert policy.waited(0.5, 2) == pytest.approx(2 * policy.hand_off.per_request)  # idle in between


def test_requests_that_waited_through_a_long_call_are_refused_for_a_tight_objective():
    policy = admission(10)
    policy.finished(start=0.0, end=0.1, requests=1, rows=4096, scored=1)  # a 100 ms bulk call
    plan = policy.plan([Request(1)] * 4, now=0.1002)
    assert not plan.taken and len(plan.refused) == 4


def test_once_a_call_refuses_it_stays_short_so_its_refusals_come_back_promptly():
    """A backlog: the call takes only what lets its refusals out within half the objective (their
    wait: half the window on average), fewer than the deadlines alone would allow."""
    policy = admission(20)
    policy.finished(start=0.0, end=2.5e-3, requests=10, rows=96, scored=3)
    now = 2.5e-3 + HAND_OFF * 30  # back to back: the hand-off of both calls' requests
    requests = [Request(32)] * 20
    plan = policy.plan(requests, now)
    waited, hand_off = now, HAND_OFF * 20 + DOOR_S
    scoring = policy.cost.predict(32 * len(plan.taken), len(plan.taken))
    assert len(plan.taken) > 1 and plan.refused
    assert scoring <= 20e-3 / 2 - waited / 2 - hand_off
    # the deadlines alone would have let it take more: those beyond the bound are refused for capacity
    assert waited + scoring + policy.cost.marginal(32) + hand_off < 20e-3
    assert plan.refused[len(plan.taken)] == AT_CAPACITY


def test_a_call_that_refuses_still_takes_its_first_request_that_meets_its_deadline():
    policy = admission(10)
    policy.finished(start=0.0, end=3.4e-3, requests=2, rows=192, scored=2)
    # 96 rows cost 2.6 ms: over the refusal bound (5 - 1.75 - hand-off ms) on its own, but the first
    # request meets its 10 ms deadline, so the call makes progress (and stays short)
    plan = policy.plan([Request(96)] * 6, now=3.5e-3)
    assert plan.first == [0] and len(plan.refused) == 5 and AT_CAPACITY in plan.refused.values()


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_without_interactive_traffic_bulk_requests_are_held_to_their_timeout_only(compiled):
    policy = NativeAdmission(admission(10)) if compiled else admission(10)
    requests = [Request(4096, bulk=True, timeout_s=120.0), Request(64, bulk=True, timeout_s=120.0),
                Request(4096, bulk=True), Request(4096, bulk=True, timeout_s=0.01)]
    plan = policy.plan(requests, now=0.0)
    assert plan.first == [] and plan.bulk == [0, 1, 2]
    assert list(plan.refused) == [3] and "the request's timeout" in plan.refused[3]


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_beside_interactive_traffic_bulk_requests_yield(compiled):
    """A call that holds interactive requests scores them first, then takes bulk ones only while
    each ends within its own scoring plus half the objective; the bound holds for a second (or the
    objective, if longer) after the last interactive request, whatever the bulk requests' timeouts."""
    policy = NativeAdmission(admission(200)) if compiled else admission(200)
    big = Request(4096, bulk=True, timeout_s=120.0)  # 83 ms at the true cost; its bound 183 ms

    def run(requests, now):
        plan = policy.plan(requests, now)
        rows = sum(requests[i].rows for i in plan.taken)
        policy.finished(now, now + TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * len(plan.taken),
                        len(requests), rows, len(plan.taken))
        return plan

    plan = run([big, Request(1), Request(1), big, big], now=0.0)
    assert plan.first == [1, 2] and plan.bulk == [0, 3]
    assert list(plan.refused) == [4] and BULK in plan.refused[4]
    plan = run([big, big, big], now=0.75)  # no interactive request in the call, but 0.75 s after one
    assert plan.bulk == [0, 1] and list(plan.refused) == [2] and BULK in plan.refused[2]
    assert run([big, big, big], now=2.0).bulk == [0, 1, 2]  # over a second after it: the timeout only


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_a_request_that_cannot_meet_the_objective_even_alone_is_bulk(compiled):
    policy = admission(10)
    assert policy.is_bulk(Request(4096)) and not policy.is_bulk(Request(100))
    policy = NativeAdmission(policy) if compiled else policy
    assert policy.plan([Request(4096), Request(4096)], now=0.0).bulk == [0, 1]  # alone: its timeout
    plan = policy.plan([Request(1), Request(4096), Request(4096)], now=1.0)  # beside an interactive one
    assert plan.first == [0] and plan.bulk == [1] and list(plan.refused) == [2] and BULK in plan.refused[2]


def test_bulk_is_judged_on_the_cheaper_price_so_an_overloaded_fit_waves_nothing_through():
    policy = admission(3)
    rng = np.random.default_rng(2)
    for _ in range(300):  # overload: every call takes three times what the prior says
        requests = int(rng.integers(1, 40))
        rows = int(rng.integers(requests, 40 * requests))
        policy.cost.observe(rows, requests, 3 * (TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * requests))
    assert policy.cost.predict(64, 1) > policy.objective_s  # alone over the objective on the fit,
    assert not policy.is_bulk(Request(64))  # but not on the prior: judged by its deadline, not waved through
    assert policy.is_bulk(Request(4096))


def test_objective_must_be_positive():
    with pytest.raises(ValueError):
        Admission(0.0)


def test_calibrate_times_the_scorer_at_two_sizes():
    def score(rows: int) -> None:
        time.sleep(2e-3 + 2e-5 * rows)

    prior = calibrate(score, rows=(1, 256), repeats=3)
    assert prior.per_row == pytest.approx(2e-5, rel=0.5)
    assert prior.fixed == pytest.approx(2e-3, rel=0.5)


def test_the_cost_model_tracks_how_far_slow_calls_run_past_its_prediction():
    model = CostModel(TRUE)
    rng = np.random.default_rng(3)
    ratios = rng.uniform(1.0, 1.5, 4000)  # calls take 1-1.5x the true cost, uniformly
    for ratio in ratios:
        model.observe(64, 2, ratio * (TRUE.fixed + 64 * TRUE.per_row + 2 * TRUE.per_request))
    # the fit follows the mean (1.25x); the tail ratio is the 90th percentile over it: 1.45 / 1.25
    assert model.tail == pytest.approx(1.45 / 1.25, abs=0.06)


def test_an_idle_call_takes_a_request_the_prior_prices_within_its_deadline_after_a_starved_stretch():
    """A fit inflated by slow calls (a starved server) must not refuse every later request forever:
    nothing refused is observed, so only a scored call can correct it."""
    from ensemble.serving.admission import Admission, Request

    admission = Admission(0.02)
    for k in range(200):  # a starved stretch: 1-row calls took 40 ms
        admission.finished(k * 0.05, k * 0.05 + 0.04, 1, 1, 1)
    assert admission.cost.predict(1, 1) > 0.02
    busy = admission.plan([Request(1), Request(1)], now=9.9901)  # back to back with the last call: no exception
    assert not busy.taken
    idle = admission.plan([Request(1), Request(1)], now=60.0)  # an idle instance: the first is taken
    assert idle.first == [0] and list(idle.refused) == [1]
    assert not admission.plan([Request(1, timeout_s=1e-4)], now=120.0).taken  # one that cannot make it stays refused


def test_the_compiled_policy_is_built_here_and_serves():
    from ensemble.serving import admission as module

    assert module._admission is not None  # pip install -e . compiles it (setup.py)
    assert isinstance(module.serving_policy(0.5, CostModel(TRUE)), NativeAdmission)
    assert abs(module._admission.now() - time.perf_counter()) < 1e-3  # one clock for both


def _random_calls(seed: int, calls: int):
    """Calls as a server sees them under mixed load: idle and back-to-back starts, 1-40 requests of
    1-5,000 rows, some with tight or no timeouts, some bulk, calls that run fast or far too slow."""
    rng = np.random.default_rng(seed)
    now = 0.0
    for _ in range(calls):
        n = int(rng.choice([1, 1, 2, 4, 16, 40]))
        requests = [Request(int(rng.choice([1, 1, 32, 100, 256, 4096, 5000])),
                            float(rng.choice([0.0, 1e-4, 2e-3, 0.02, 60.0])), bool(rng.random() < 0.1))
                    for _ in range(n)]
        gap = float(rng.choice([1e-5, 2e-4, 3e-3, 0.5]))  # back to back, or after an idle instance
        slowness = float(rng.choice([0.5, 1.0, 1.3, 4.0, 40.0]))
        yield requests, gap, slowness
        now += gap


@pytest.mark.parametrize("objective_ms", [3, 10, 20, 500])
def test_the_compiled_policy_plans_and_fits_exactly_as_the_python_one(objective_ms):
    seen = {"refused": 0, "crowded": 0, "bulk": 0, "first": 0, "bulk bound": 0}
    for seed in range(4):
        python = Admission(objective_ms / 1e3, CostModel(TRUE), HandOff(HAND_OFF))
        compiled = NativeAdmission(Admission(objective_ms / 1e3, CostModel(TRUE), HandOff(HAND_OFF)))
        now = 1000.0
        for requests, gap, slowness in _random_calls(seed, 300):
            now += gap
            expected, got = python.plan(requests, now), compiled.plan(requests, now)
            assert got == expected  # first, bulk, crowded in order; each refusal with its text
            rows = sum(requests[i].rows for i in expected.taken)
            end = now + slowness * (TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * len(expected.taken))
            python.finished(now, end, len(requests), rows, len(expected.taken))
            compiled.finished(now, end, len(requests), rows, len(expected.taken))
            assert compiled.native.state() == (python.cost.fixed, python.cost.per_row, python.cost.tail,
                                               python.hand_off.per_request, python.last_call)
            now = end
            for key in ("refused", "crowded", "bulk", "first"):
                seen[key] += bool(getattr(expected, key))
            seen["bulk bound"] += any(BULK in text for text in expected.refused.values())
    if objective_ms in (10, 20):  # these objectives exercise every branch of the plan
        assert all(seen.values()), seen
