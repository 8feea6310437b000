"""The native backend's Python side (ensemble/serving/embedded.py) in this process, on the real exported
ranker: the C path it offers the backend (the chain in C and the compiled admission policy) scores a
plain call as ``execute`` scores the same requests, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble import schema
from ensemble.serving import calls
from tests.helpers import fresh_rows

FP32, BYTES = 11, 13  # Triton's type codes, as the backend passes them


@pytest.fixture(scope="module")
def ranker_model(trained):
    from google.protobuf import json_format

    from ensemble.models.registry import Layout
    from ensemble.repository import configs
    from ensemble.serving import embedded
    from ensemble.scoring.pipeline import latest_version

    config = json_format.MessageToJson(configs.layout_configs(Layout.NATIVE)[schema.Model.RANKER.value],
                                       preserving_proto_field_name=True)
    folder = trained.repository / schema.Model.RANKER.value
    model = embedded.Model(config, str(folder), int(latest_version(folder).name))
    yield model
    model.close()


def _wire(cats: np.ndarray) -> bytes:
    from clients.wire import serialize_bytes

    return bytes(serialize_bytes(cats))


def _call(sizes, seed, timeouts_us=None):
    """Requests of ``sizes`` rows as execute takes them, and the same as the chain in C takes them."""
    dense, cats = fresh_rows(sum(sizes), seed=seed)
    dense, cats = dense[-sum(sizes):], cats[-sum(sizes):]  # the edge cases come last
    bounds = np.cumsum([0, *sizes])
    timeouts_us = timeouts_us or [10_000_000] * len(sizes)
    parts = [(np.ascontiguousarray(dense[a:b], np.float32).tobytes(), _wire(cats[a:b])) for a, b in zip(bounds, bounds[1:])]
    requests = [(((FP32, (n, dense.shape[1]), memoryview(d)), (BYTES, (n, cats.shape[1]), memoryview(c))), t, False, (), None)
                for n, t, (d, c) in zip(sizes, timeouts_us, parts)]
    return requests, tuple((d, c, n) for n, (d, c) in zip(sizes, parts)), bounds


@pytest.mark.parametrize("sizes", [[1], [7], [1, 1, 1, 1], [3, 40, 2], [33], [300]])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_chain_in_c_scores_a_plain_call_as_execute_does(ranker_model, sizes, threads):
    assert ranker_model.plain is not None  # the exported ranker has the chain in C and reads the wire
    names, chain = ranker_model.plain[1], ranker_model.plain[2]
    assert names == tuple(t.name for t in schema.RANKER_OUTPUTS)
    requests, parts, bounds = _call(sizes, seed=sum(sizes))
    answers = dict(ranker_model.execute(requests, 0.0))
    scores = np.empty((len(names), sum(sizes)), np.float32)
    chain.score(parts, scores, threads)
    for i in range(len(sizes)):
        kind, outputs = answers[i]
        assert kind == "ok"
        for k, (name, array) in enumerate(outputs):
            assert name == names[k]
            np.testing.assert_array_equal(array.reshape(-1), scores[k, bounds[i]:bounds[i + 1]])


def test_execute_refuses_what_would_miss_its_deadline_and_scores_the_rest(ranker_model):
    admission = ranker_model.ranker.admission
    assert admission is not None  # the native layout serves with the latency objective
    sizes = [2, 3, 4]
    requests, _, _ = _call(sizes, seed=5, timeouts_us=[10_000_000, 1, 10_000_000])  # 1 us: cannot be met
    answers = dict(ranker_model.execute(requests, 0.0))
    assert answers[1][0] == "error" and answers[1][1] == calls.UNAVAILABLE and "deadline" in answers[1][2]
    assert [answers[i][0] for i in (0, 2)] == ["ok", "ok"] and ranker_model.rows == 6
    assert admission.last_call[2] == 3  # the call was recorded: three requests
    alone = dict(ranker_model.execute([requests[0], requests[2]], 0.0))
    for j, i in enumerate((0, 2)):
        for (_, array), (_, expected) in zip(answers[i][1], alone[j][1]):
            np.testing.assert_array_equal(array, expected)


def test_no_plain_path_without_the_kernel_chain(ranker_model):
    pipeline = ranker_model.pipeline
    chain = pipeline.kernel_chain
    pipeline.__dict__["kernel_chain"] = None  # a release whose models do not all score in C here
    try:
        assert ranker_model._plain_spec() is None
    finally:
        pipeline.__dict__["kernel_chain"] = chain
    assert ranker_model._plain_spec() is not None


def test_the_plain_path_offers_the_chain_and_the_policy_in_c(ranker_model):
    """What the backend plans and scores plain calls with, without Python: the checked chain in C and
    the compiled admission policy (the one every other path of this model updates too)."""
    from ensemble.serving import admission

    chain, policy, split_rows = ranker_model.plain[2:]
    assert chain is not None and chain is ranker_model.pipeline.c_chain
    assert isinstance(ranker_model.ranker.admission, admission.NativeAdmission)
    assert policy is ranker_model.ranker.admission.native
    assert split_rows == (ranker_model.pipeline.PARALLEL_MIN_ROWS if ranker_model.pipeline.parallel else 0)


def test_no_c_path_beside_a_python_policy_or_without_the_chain_in_c(ranker_model):
    """The backend may plan in C only with the policy every other call of the model updates, and
    scores in C only with the chain in C: otherwise every call goes through execute."""
    from ensemble.serving import admission

    compiled = ranker_model.ranker.admission
    ranker_model.ranker.admission = admission.Admission(compiled.objective_s)
    try:
        assert ranker_model._plain_spec() is None
    finally:
        ranker_model.ranker.admission = compiled
    pipeline = ranker_model.pipeline
    chain = pipeline.c_chain
    pipeline.__dict__["c_chain"] = None  # a build without ensemble.native._chain
    try:
        assert ranker_model._plain_spec() is None
    finally:
        pipeline.__dict__["c_chain"] = chain
    assert ranker_model._plain_spec() is not None



def test_the_model_thread_nice_comes_from_the_config_and_must_be_a_nice_value():
    from ensemble.serving.embedded import thread_nice

    assert thread_nice({}) == 0  # no parameter: the backend leaves its threads alone
    assert thread_nice({"model_thread_nice": "10"}) == 10
    assert thread_nice({"model_thread_nice": "0"}) == 0
    for bad in ("-1", "20", "ten", ""):
        with pytest.raises(ValueError, match="model_thread_nice must be an integer 0..19"):
            thread_nice({"model_thread_nice": bad})
