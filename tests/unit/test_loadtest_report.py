"""Headline, ratios and the report folder from given scenario results (no servers)."""

import math

from loadtest.report import headline, ratios, write_report
from loadtest.runner import Pinning, RunnerOptions, read_locust_csv, served_rows_per_s
from loadtest.statistics import cpu_per_request, stage_times


def _scenario(target, rows, users, rps, p99, failures=0):
    return {"target": target, "rows": rows, "users": users, "requests": rps * 10, "failures": failures,
            "requests_per_s": rps, "rows_per_s": rps * rows, "mean_ms": p99 / 2, "p50_ms": p99 / 3,
            "p90_ms": p99 / 1.5, "p99_ms": p99, "max_ms": p99 * 2, "fail_ratio": failures / (rps * 10),
            "stages": {"xgb": {"requests": 10, "queue_ms": 0.1, "compute_ms": 1.0, "mean_batch_rows": 3.0}}}


RESULTS = [
    _scenario("triton-http", 1, 1, 300, 4), _scenario("triton-http", 1, 16, 2000, 9),
    _scenario("triton-http", 1, 64, 2500, 30),  # over the SLA: not the headline
    _scenario("inproc", 1, 1, 400, 3), _scenario("inproc", 1, 16, 500, 40),
    _scenario("naive", 1, 1, 15, 70),  # never within the SLA
    _scenario("inproc", 1, 4, 900, 5, failures=100),  # too many failures
]
RESULTS[0]["server_cpu_ms"] = {"tritonserver": 1.0, "xgb": 2.5, "blend": 0.5}
RESULTS[3]["server_cpu_ms"] = {"inproc": 1.75}


def test_headline_picks_the_best_scenario_within_the_sla():
    head = {(h["target"], h["rows"]): h for h in headline(RESULTS, 10)}
    assert head[("triton-http", 1)]["rows_per_s_at_sla"] == 2000 and head[("triton-http", 1)]["users"] == 16
    assert head[("inproc", 1)]["rows_per_s_at_sla"] == 400
    assert head[("naive", 1)]["rows_per_s_at_sla"] is None
    table = {(r["baseline"]): r["ratio"] for r in ratios(list(head.values()))}
    assert table["inproc"] == 5.0 and math.isinf(table["naive"])


def test_report_folder_is_complete(tmp_path):
    options = RunnerOptions(out=tmp_path)
    report = write_report(tmp_path, RESULTS, options, Pinning("1", "0"), 42.0)
    text = report.read_text()
    for expected in ("Headline", "5.0x", "inf (baseline never met the SLA)", "pinned to CPU 1",
                     "Cost per million", "extrapolated", "Inside the server",
                     "| triton-http r1 u1 | 4.00 | 4,000 | tritonserver 1.00, xgb 2.50, blend 0.50 |",
                     "| inproc r1 u1 | 1.75 | 1,750 |  |"):
        assert expected in text, expected
    for name in ("results.json", "throughput_vs_p99.png", "latency_percentiles.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_results_json_is_strict_json_even_with_missing_figures(tmp_path):
    import json

    results = [dict(r) for r in RESULTS]
    results[0]["p99_ms"] = float("nan")  # e.g. a scenario locust could not measure
    write_report(tmp_path, results, RunnerOptions(out=tmp_path), Pinning("1", "0"), 42.0)

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    payload = json.loads((tmp_path / "results.json").read_text(), parse_constant=refuse)
    assert payload["scenarios"][0]["p99_ms"] is None


def test_locust_csv_and_triton_stats_parsing(tmp_path):
    header = ("Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
              "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
              "99.99%,100%")
    (tmp_path / "x_stats.csv").write_text(header + "\n" + ",Aggregated,100,2,4,5.5,1,40,20,50.0,1.0,4,5,6,6,8,9,"
                                          "12,15,30,40,40\n")
    row = read_locust_csv(tmp_path / "x")
    assert row["requests"] == 100 and row["p99_ms"] == 15 and row["requests_per_s"] == 50
    stat = lambda n, ns: {"success": {"count": n}, **{k: {"ns": ns} for k in  # noqa: E731
                          ("queue", "compute_input", "compute_infer", "compute_output")}}
    before = {"xgb": {"inference_stats": stat(10, 0), "execution_count": 5, "inference_count": 10}}
    after = {"xgb": {"inference_stats": stat(30, 4_000_000), "execution_count": 10, "inference_count": 60}}
    stages = stage_times(before, after)["xgb"]
    assert stages["requests"] == 20 and stages["queue_ms"] == 0.2
    assert abs(stages["compute_ms"] - 0.6) < 1e-12
    assert stages["mean_batch_rows"] == 10.0


def test_rows_per_second_counts_answered_requests_only():
    # 1,200 requests in 12 s, 120 of them refused (503): 90 answered per second
    result = {"requests": 1200.0, "failures": 120.0, "requests_per_s": 100.0}
    assert math.isclose(served_rows_per_s(result, 100), 9000.0)
    assert served_rows_per_s({"requests": 0.0, "failures": 0.0, "requests_per_s": 0.0}, 100) == 0.0


def test_cpu_per_request_divides_the_window_by_the_requests():
    before = {"tritonserver": 10.0, "xgb": 4.0}
    after = {"tritonserver": 12.0, "xgb": 7.0, "blend": 0.5}  # blend appeared: counted from 0
    assert cpu_per_request(before, after, 1000) == {"tritonserver": 2.0, "xgb": 3.0, "blend": 0.5}
    assert cpu_per_request(None, after, 1000) == {} and cpu_per_request(before, after, 0) == {}


def _tables(text: str) -> list[list[str]]:
    """Markdown tables of a report: header, separator, rows."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_a_run_without_baselines_is_not_titled_against_them_and_has_no_empty_table(tmp_path):
    triton_only = [r for r in RESULTS if r["target"] == "triton-http"]
    for r in triton_only:
        r.setdefault("server_cpu_ms", {})
    text = write_report(tmp_path, triton_only, RunnerOptions(out=tmp_path, targets=("triton-http",)),
                        Pinning(None, None), 42.0).read_text()
    assert text.startswith("# Load test: Triton\n") and "baseline" not in text.splitlines()[0]
    assert "vs baseline" not in text  # the ratio table has no rows without baselines
    for table in _tables(text):
        assert len(table) > 2, f"table without rows: {table[0]}"


def test_sections_without_rows_are_left_out(tmp_path):
    bare = [{**r, "stages": {}, "server_cpu_ms": {}} for r in RESULTS]
    text = write_report(tmp_path, bare, RunnerOptions(out=tmp_path), Pinning("1", "0"), 42.0).read_text()
    assert text.startswith("# Load test: Triton vs CPU baselines\n")
    assert "Inside the server" not in text and "Server CPU per request" not in text
    assert all(len(table) > 2 for table in _tables(text))
    baselines_only = [r for r in bare if r["target"] in ("inproc", "naive")]
    text = write_report(tmp_path, baselines_only, RunnerOptions(out=tmp_path), Pinning("1", "0"), 1.0).read_text()
    assert text.startswith("# Load test: CPU baselines\n") and all(len(t) > 2 for t in _tables(text))


def test_plots_redraw_from_a_results_file_even_with_missing_figures(tmp_path):
    from loadtest.report import replot

    results = [dict(r) for r in RESULTS]
    results[1]["p99_ms"] = float("inf")  # a scenario that timed out: no point, no crash
    write_report(tmp_path, results, RunnerOptions(out=tmp_path), Pinning("1", "0"), 42.0)
    for name in ("throughput_vs_p99.png", "latency_percentiles.png"):
        (tmp_path / name).unlink()
    assert replot(tmp_path) == ["throughput_vs_p99.png", "latency_percentiles.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in replot(tmp_path))


def test_targets_name_their_server_and_protocol():
    from ensemble.models.registry import Layout
    from loadtest.report import TRITON
    from loadtest.targets import BASELINES, Target

    assert Target("triton-native-grpc").layout is Layout.NATIVE and Target("triton-native-grpc").grpc
    assert Target("triton-http").layout is Layout.FUSED and not Target("triton-http").grpc
    assert set(TRITON) | set(BASELINES) == {t.value for t in Target} and not set(TRITON) & set(BASELINES)
    assert [t.value for t in Target if t.strict_json] == ["mlserver"]


def test_only_the_strict_json_target_gets_finite_bodies(tmp_path):
    import numpy as np

    from loadtest.payloads import Payloads
    from loadtest.runner import holdout_file, locust_command

    options = RunnerOptions(out=tmp_path)
    data = holdout_file(options)
    plain, strict = Payloads(str(data), 20), Payloads(str(data), 20, strict_json=True)
    assert any(b"NaN" in body for body in plain.json) and not any(b"NaN" in body for body in strict.json)
    assert all(np.isfinite(d).all() for d, _ in strict.arrays)
    for target, expected in (("mlserver", True), ("inproc", False), ("triton-native-http", False)):
        cmd = locust_command(target, "http://x", 1, 1, 1, options, data, Pinning(None, None), None)
        assert ("--strict-json" in cmd) is expected, target


def test_perf_analyzer_table_names_the_target_when_the_points_have_one():
    from loadtest.perf_analyzer import Point, format_table, report_section

    points = [Point("http", 1, 1, 100.0, 100.0, 1.0, 1.5, 2.0, 0.1, 0.5, target="triton-native-http"),
              Point("grpc", 100, 2, error="boom", target="triton-native-grpc")]
    table = format_table(points)
    assert table.splitlines()[0].startswith("| target | protocol") and "| triton-native-http | http | 1 | 1 |" in table
    assert "errors at triton-native-grpc 100x2" in "\n".join(report_section([vars(p) for p in points]))
    assert format_table([Point("http", 1, 1, 1.0, 1.0)]).startswith("| protocol")
