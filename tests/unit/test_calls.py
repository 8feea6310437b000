"""One call of the ranker (ensemble/serving/calls.py), the logic both backends run, on the real
exported ranker in this process: answers in policy order, errors per request, bulk after FLUSH."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble import schema
from ensemble.serving import admission, calls
from ensemble.scoring import pipeline
from tests.helpers import fresh_rows


@pytest.fixture(scope="module")
def fused(trained):
    from ensemble.scoring.pipeline import latest_version

    return pipeline.load_fused(latest_version(trained.repository / schema.Model.RANKER.value))


def _request(dense, cats, timeout_s=10.0, bulk=False, wanted=()):
    inputs = {schema.DENSE.name: dense, schema.CATEGORICAL.name: cats}
    return calls.CallRequest(lambda: inputs, admission.Request(len(dense), timeout_s, bulk), wanted)


def test_a_call_answers_each_request_with_its_own_rows_or_its_own_error(fused, pipeline):
    dense, cats = fresh_rows(30, seed=91)
    requests = [_request(dense[:3], cats[:3]), _request(dense[3:5, :12], cats[3:5]),  # 12 dense columns
                _request(dense[5:30], cats[5:30], wanted=(schema.SCORE.name,))]
    answers = dict(calls.Ranker(fused).call(requests))
    assert set(answers) == {0, 1, 2}
    assert not answers[1].ok and answers[1].code == calls.INVALID_ARG and "dense" in answers[1].message
    expected = pipeline.score(dense, cats)
    np.testing.assert_allclose(answers[0].outputs[schema.SCORE.name], expected[schema.SCORE.name][:3], atol=1e-6)
    assert set(answers[0].outputs) == {t.name for t in schema.RANKER_OUTPUTS}
    assert set(answers[2].outputs) == {schema.SCORE.name}  # only what it asked for
    np.testing.assert_allclose(answers[2].outputs[schema.SCORE.name], expected[schema.SCORE.name][5:30], atol=1e-6)


def test_refusals_then_interactive_answers_then_flush_then_bulk(fused):
    dense, cats = fresh_rows(40, seed=92)
    ranker = calls.Ranker(fused, objective_ms=500.0)
    requests = [_request(dense[:30], cats[:30], bulk=True), _request(dense[30:31], cats[30:31]),
                _request(dense[31:40], cats[31:40], timeout_s=1e-7)]  # no call completes in 0.1 us
    items = list(ranker.call(requests))
    order = [item if item is calls.FLUSH else item[0] for item in items]
    assert order == [2, 1, calls.FLUSH, 0], order
    refused = items[0][1]
    assert refused.code == calls.UNAVAILABLE and refused.message.startswith(schema.OVERLOAD_REFUSAL)
    assert "the request's timeout" in refused.message
    assert items[1][1].ok and items[3][1].ok and len(items[3][1].outputs[schema.SCORE.name]) == 30
    assert ranker.rows == 31
