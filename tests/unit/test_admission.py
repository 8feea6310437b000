"""The fused ranker's overload policy: the online cost model and which requests a call takes."""

import time

import numpy as np
import pytest

from ensemble.serving.admission import Admission, CostModel, CostPrior, calibrate

TRUE = CostPrior(fixed=6e-4, per_row=2e-5, per_request=4e-5)


def observe_calls(model: CostModel, calls: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        requests = int(rng.integers(1, 40))
        rows = int(rng.integers(requests, 40 * requests))
        seconds = TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * requests
        model.observe(rows, requests, seconds * rng.normal(1.0, 0.02))


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


def test_a_call_takes_requests_in_order_while_its_predicted_cost_fits():
    admission = Admission(budget_s=3.01e-3, cost=CostModel(TRUE))
    one_row = TRUE.per_row + TRUE.per_request  # 60 us each after the 600 us fixed cost
    fits = int((3.01e-3 - TRUE.fixed) / one_row)  # 40
    taken = admission.admit([1] * 100)
    assert taken == [True] * fits + [False] * (100 - fits)
    assert admission.refused == 100 - fits
    # a light call takes everything
    assert admission.admit([1] * 5) == [True] * 5
    # one request too big for the rest of the budget is refused; smaller ones after it still fit
    assert admission.admit([1] * 20 + [80, 1]) == [True] * 20 + [False, True]


def test_two_requests_at_once_are_not_refused_while_the_ranker_is_not_refusing():
    admission = Admission(budget_s=3e-3, cost=CostModel(TRUE))
    # 100 rows: 2.04 ms each, under the budget alone (not bulk), two of them over it
    assert admission.admit([100, 100]) == [True, True]
    assert admission.admit([100, 100, 100]) == [True, True, False]


def test_while_refusing_a_call_takes_only_its_first_request_beyond_the_budget():
    admission = Admission(budget_s=3e-3, cost=CostModel(TRUE))
    assert admission.admit([100, 100, 100]) == [True, True, False]  # overload begins
    # a backlog: two 100-row requests (4.7 ms predicted) would stretch the call past the budget
    assert admission.admit([100, 100, 100]) == [True, False, False]
    assert admission.admit([1] * 10 + [100]) == [True] * 10 + [False]  # the budget fills as usual
    assert admission.admit([100]) == [True]  # refused nothing: two at once are safe again
    assert admission.admit([100, 100]) == [True, True]


def test_the_first_request_and_bulk_requests_are_always_taken():
    admission = Admission(budget_s=1e-3, cost=CostModel(TRUE))
    # 30 rows alone cost 600 + 600 + 40 us > 1 ms: still taken when it comes first
    assert admission.admit([30]) == [True]
    # bulk (its own cost beyond the budget: batch scoring's big requests) is taken wherever it is,
    # and does not use up the small requests' budget
    taken = admission.admit([1, 4096, 1, 1, 4096])
    assert taken == [True, True, True, True, True]
    assert Admission(budget_s=1e-3, cost=CostModel(TRUE)).admit([1] * 10).count(True) == 6


def test_bulk_is_judged_on_the_prior_so_an_overloaded_fit_waves_nothing_through():
    admission = Admission(budget_s=3e-3, cost=CostModel(TRUE))
    rng = np.random.default_rng(2)
    for _ in range(300):  # overload: every call takes three times what the prior says
        requests = int(rng.integers(1, 40))
        rows = int(rng.integers(requests, 40 * requests))
        admission.observe(rows, requests, 3 * (TRUE.fixed + TRUE.per_row * rows + TRUE.per_request * requests))
    # a 32-row request alone is now predicted over the budget (~3.8 ms), but it is 1.3 ms on the
    # prior: not bulk, so past the first two such requests are refused, not all taken
    assert admission.cost.predict(32, 1) > admission.budget_s
    assert admission.admit([32] * 6) == [True, True] + [False] * 4
    # what is bulk on the prior still is
    assert admission.admit([4096, 4096, 4096]) == [True, True, True]


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        Admission(0.0)


def test_calibrate_times_the_scorer_at_two_sizes():
    def score(rows: int) -> None:
        time.sleep(2e-3 + 2e-5 * rows)

    prior = calibrate(score, rows=(1, 256), repeats=3)
    assert prior.per_row == pytest.approx(2e-5, rel=0.5)
    assert prior.fixed == pytest.approx(2e-3, rel=0.5)
