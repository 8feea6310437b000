"""The loadtest report folder: report.md, results.json, raw locust CSVs (already in raw/), plots."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from ensemble.machine import describe
from loadtest.cost import cost_table, load_prices, render
from loadtest.openloop import report_section as overload_section

PRICES = Path(__file__).with_name("prices.yaml")
TRITON = ("triton-http", "triton-grpc", "triton-ensemble-http")
BASELINES = ("inproc", "naive")


def headline(results: list[dict], sla_ms: float) -> list[dict]:
    """Per target and rows/request: the highest throughput whose p99 <= SLA (and < 1% failures)."""
    out = []
    for target in dict.fromkeys(r["target"] for r in results):
        for rows in dict.fromkeys(r["rows"] for r in results):
            ok = [r for r in results if r["target"] == target and r["rows"] == rows
                  and r["p99_ms"] <= sla_ms and r["fail_ratio"] < 0.01 and r["requests"] > 0]
            best = max(ok, key=lambda r: r["rows_per_s"], default=None)
            out.append({"target": target, "rows": rows, "rows_per_s_at_sla": best["rows_per_s"] if best else None,
                        "users": best["users"] if best else None, "p99_ms": best["p99_ms"] if best else None})
    return out


def ratios(head: list[dict]) -> list[dict]:
    """Triton's throughput at SLA over each baseline's, same rows/request, same run."""
    table = {(h["target"], h["rows"]): h["rows_per_s_at_sla"] for h in head}
    out = []
    for (target, rows), rate in table.items():
        if target not in TRITON:
            continue
        for baseline in BASELINES:
            if (baseline, rows) not in table:
                continue
            other = table[(baseline, rows)]
            value = None if not rate else (math.inf if not other else rate / other)
            out.append({"triton": target, "baseline": baseline, "rows": rows, "ratio": value})
    return out


def plot(results: list[dict], sla_ms: float, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows_values = sorted({r["rows"] for r in results})
    fig, axes = plt.subplots(1, len(rows_values), figsize=(6 * len(rows_values), 4.5), squeeze=False)
    for ax, rows in zip(axes[0], rows_values):
        for target in dict.fromkeys(r["target"] for r in results):
            points = sorted((r for r in results if r["target"] == target and r["rows"] == rows),
                            key=lambda r: r["users"])
            if points:
                ax.plot([p["rows_per_s"] for p in points], [max(p["p99_ms"], 0.5) for p in points], marker="o",
                        label=target)
                for p in points:
                    ax.annotate(str(p["users"]), (p["rows_per_s"], max(p["p99_ms"], 0.5)), fontsize=7)
        ax.axhline(sla_ms, color="grey", linestyle="--", linewidth=1, label=f"SLA p99 {sla_ms:g} ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("throughput (rows/s)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_title(f"{rows} row(s) per request (labels: users)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_p99.png", dpi=110)
    plt.close(fig)
    files.append("throughput_vs_p99.png")

    fig, ax = plt.subplots(figsize=(9, 0.32 * len(results) + 1.5))
    labels = [f"{r['target']} r{r['rows']} u{r['users']}" for r in results]
    for offset, key in ((-0.27, "p50_ms"), (0.0, "p90_ms"), (0.27, "p99_ms")):
        ax.barh([i + offset for i in range(len(results))], [max(r[key], 0.1) for r in results], height=0.27,
                label=key.replace("_ms", ""))
    ax.set_yticks(range(len(results)), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.axvline(sla_ms, color="grey", linestyle="--", linewidth=1)
    ax.legend(fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "latency_percentiles.png", dpi=110)
    plt.close(fig)
    files.append("latency_percentiles.png")
    return files


def peaks(results: list[dict]) -> list[dict]:
    """Per target and rows/request: the scenario with the highest throughput, any latency."""
    best: dict[tuple, dict] = {}
    for r in results:
        key = (r["target"], r["rows"])
        if r["requests"] > 0 and (key not in best or r["rows_per_s"] > best[key]["rows_per_s"]):
            best[key] = r
    return list(best.values())


def cpu_rows(results: list[dict]) -> list[str]:
    """Markdown rows: server CPU per request, total and by process, for scenarios that have it."""
    out = []
    for r in results:
        cpu = r.get("server_cpu_ms") or {}
        if not cpu:
            continue
        parts = sorted(cpu.items(), key=lambda kv: (kv[0] != "tritonserver", -kv[1]))
        detail = ", ".join(f"{name} {ms:.2f}" for name, ms in parts) if len(parts) > 1 else ""
        total = sum(cpu.values())
        out.append(f"| {r['target']} r{r['rows']} u{r['users']} | {total:.2f} | {total * 1000 / r['rows']:,.0f} "
                   f"| {detail} |")
    return out


def _ratio(value) -> str:
    if value is None:
        return "- (Triton never met the SLA)"
    if math.isinf(value):
        return "inf (baseline never met the SLA)"
    return f"{value:.1f}x"


def _fmt(value, spec: str = ",.0f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def _json_safe(value):
    """NaN and infinities (a scenario without that figure) as null: strict JSON parsers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_report(out: Path, results: list[dict], options, pinning, seconds: float,
                 overload: dict | None = None) -> Path:
    sla = options.sla_ms
    head = headline(results, sla)
    server_vcpus = len(pinning.server.split(",")) if pinning.server else describe()["cores"]
    payload = {"machine": describe(), "date": time.strftime("%Y-%m-%d %H:%M"), "sla_ms": sla,
               "server_vcpus": server_vcpus, "pinning": {"server": pinning.server, "locust": pinning.load},
               "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
               "seconds": seconds, "scenarios": results, "headline": head, "ratios": ratios(head)}
    payload["overload"] = overload  # loadtest/openloop.py: capacity, then 2x open loop
    payload["peaks"] = [{k: p[k] for k in ("target", "rows", "users", "rows_per_s", "p99_ms")} for p in peaks(results)]
    (out / "results.json").write_text(json.dumps(_json_safe(payload), indent=1, default=str, allow_nan=False))
    plot(results, sla, out)
    costs = cost_table(payload, load_prices(PRICES))
    m = payload["machine"]
    lines = [
        "# Load test: Triton ensemble vs CPU baselines", "",
        f"Measured {payload['date']} on {m['arch']}, {m['cores']} cores ({m['cpu']}), no GPU. "
        + (f"Servers pinned to CPU {pinning.server}, locust to CPU {pinning.load} (taskset)."
           if pinning.server else "No CPU pinning: servers and locust share all cores."),
        f"Each scenario: {options.warmup:g} s warm-up (discarded), then {options.duration:g} s measured; closed loop "
        "(each user sends its next request when the previous one returns). Latencies are locust's, which rounds "
        "them to whole milliseconds.", "",
        f"## Headline: highest throughput with p99 <= {sla:g} ms", "",
        "| target | rows/request | rows/s at SLA | users | p99 ms |", "| --- | --- | --- | --- | --- |",
        *[f"| {h['target']} | {h['rows']} | {_fmt(h['rows_per_s_at_sla'])} | {_fmt(h['users'], 'd')} "
          f"| {_fmt(h['p99_ms'], '.0f')} |" for h in head], "",
        "| Triton target | vs baseline | rows/request | throughput ratio at SLA |", "| --- | --- | --- | --- |",
        *[f"| {r['triton']} | {r['baseline']} | {r['rows']} | {_ratio(r['ratio'])} |" for r in payload["ratios"]], "",
        "Highest throughput measured at any latency (same run):", "",
        "| target | rows/request | rows/s | users | p99 ms |", "| --- | --- | --- | --- | --- |",
        *[f"| {m['target']} | {m['rows']} | {m['rows_per_s']:,.0f} | {m['users']} | {m['p99_ms']:.0f} |"
          for m in peaks(results)], "",
        "![throughput vs p99](throughput_vs_p99.png)", "",
        "## All scenarios", "",
        "| target | rows | users | req/s | rows/s | p50 ms | p90 ms | p99 ms | failures |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {r['target']} | {r['rows']} | {r['users']} | {r['requests_per_s']:,.1f} | {r['rows_per_s']:,.0f} "
          f"| {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | {r['p99_ms']:.0f} | {r['failures']:.0f} |" for r in results], "",
        "![latency percentiles](latency_percentiles.png)", "",
        "## Inside the ensemble (Triton statistics, per request)", "",
        "| scenario | model | queue ms | compute ms | mean rows per execution |", "| --- | --- | --- | --- | --- |",
        *[f"| {r['target']} r{r['rows']} u{r['users']} | {name} | {s['queue_ms']:.3f} | {s['compute_ms']:.3f} "
          f"| {s['mean_batch_rows']:.1f} |" for r in results for name, s in sorted(r["stages"].items())], "",
        "## Server CPU per request", "",
        "CPU time (user + system, from /proc) of the server processes over each measured run, divided by the "
        "requests served: what one request costs the server's core(s), whatever the latency. For Triton it "
        "is split by process (the server and one python-backend stub per model).", "",
        "| scenario | CPU ms per request | CPU us per row | by process (ms per request) |",
        "| --- | --- | --- | --- |", *cpu_rows(results), "",
        "## Cost per million predictions", "",
        "From the headline throughput (prices in `loadtest/prices.yaml`). Extrapolations are labelled with "
        "their formula and are not measurements.", "", render(costs), "",
        *overload_section(overload),
        f"Raw locust CSVs: `raw/`. Results: `results.json`. Total run time {seconds / 60:.1f} min.", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
