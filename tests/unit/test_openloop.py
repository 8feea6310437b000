"""The open-loop generator's accounting (its runs against the real server are in
tests/integration/test_overload.py)."""

import math

from loadtest.openloop import UNSENT, Outcome, report_section, server_view, summarize


def test_summary_separates_accepted_refused_and_errors():
    outcomes = ([Outcome(200, 0.002)] * 98 + [Outcome(200, 0.050)] * 2 + [Outcome(503, 0.001, b'{"error":"full"}')] * 10
                + [Outcome(400, 0.001, b"bad")] + [Outcome(0, 1.0, b"TimeoutError")] + [Outcome(UNSENT, 0.0)] * 3)
    result = summarize(rate=56.0, seconds=2.0, outcomes=outcomes)
    assert (result.sent, result.unsent, result.accepted, result.refused, result.errors) == (112, 3, 100, 10, 2)
    assert result.accepted_per_s == 50.0
    assert math.isclose(result.accepted_p50_ms, 2.0) and result.accepted_p99_ms > 2.0
    assert math.isclose(result.refused_p99_ms, 1.0)
    assert result.refusal_reasons == {'503 {"error":"full"}': 10}
    assert math.isclose(result.refused_share, 10 / 112)
    assert len(result.error_samples) == 2


def test_report_section_lists_each_multiple():
    found = {"capacity_per_s": 100.0, "rows": 1, "users": 8,
             "runs": [{"multiple": 2.0, **summarize(200.0, 1.0, [Outcome(200, 0.003)] * 150
                                                   + [Outcome(503, 0.001)] * 50).row()}]}
    text = "\n".join(report_section(found))
    assert "## Overload" in text and "| 2.0x | 200 | 150 | 3.0 / 3.0 | 25.0% | 1.0 / 1.0 | 0 | 0 | - | - |" in text
    assert report_section(None) == []
    # absolute rates (no capacity estimate) and the server's view of the run
    found = {"capacity_per_s": float("nan"), "rows": 32, "users": 8,
             "runs": [{"multiple": float("nan"), **summarize(900.0, 1.0, [Outcome(200, 0.004)] * 900).row(),
                       "server_queue_ms": 1.5, "server_call_ms": 3.1, "requests_per_call": 2.6}]}
    text = "\n".join(report_section(found))
    assert "| - | 900 | 900 | 4.0 / 4.0 | 0.0% | nan / nan | 0 | 0 | 1.5 / 3.1 | 2.6 |" in text


def test_server_view_is_the_difference_of_two_readings_per_request():
    def reading(requests, calls, queue_ns, call_ns):  # Triton's statistics of the one model read
        stats = {"success": {"count": requests}, "queue": {"ns": queue_ns}, "compute_input": {"ns": 0},
                 "compute_infer": {"ns": call_ns}, "compute_output": {"ns": 0}}
        return {"ranker": {"inference_stats": stats, "execution_count": calls, "inference_count": requests}}

    before = reading(1000, 100, 2e9, 5e9)
    after = reading(1600, 300, 2e9 + 600 * 1.5e6, 5e9 + 600 * 3e6)
    view = server_view(before, after)
    assert math.isclose(view["server_queue_ms"], 1.5) and math.isclose(view["server_call_ms"], 3.0)
    assert math.isclose(view["requests_per_call"], 3.0)
    assert server_view(None, after) == {} and server_view(after, after) == {}
