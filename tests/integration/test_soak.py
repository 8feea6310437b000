"""A short soak against the real server: the same code as ``python -m loadtest.soak`` (10 minutes
in docs/reliability.md), for seconds."""

from __future__ import annotations

from loadtest.soak import SoakPlan, soak, write_report


def test_a_short_soak_reports_errors_and_server_memory(server, tmp_path):
    plan = SoakPlan(seconds=4.0, fraction=0.7, window=2.0, warmup=1.0, capacity_seconds=1.0)
    found = soak(server.http_url, server.resident_memory_bytes, plan, log=lambda _: None)
    report = write_report(found, tmp_path / "soak.md", note="(test run)")
    print(f"\nshort soak: {found['sent']} sent at {found['rate_per_s']:.0f} req/s, {found['errors']} errors, "
          f"RSS {found['rss_start_mib']:.0f} -> {found['rss_end_mib']:.0f} MiB")
    assert found["errors"] == 0, [w["errors_seen"] for w in found["windows"]]
    assert len(found["windows"]) == 2 and found["accepted"] > 0
    # the server's memory: tritonserver plus the ranker's backend process (which loads torch and TensorFlow)
    assert found["rss_start_mib"] > 300 and all(w["rss_mib"] > 300 for w in found["windows"])
    text = report.read_text()
    assert "RSS growth" in text and "cores" in text and (tmp_path / "soak.json").is_file()
