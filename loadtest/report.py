"""The loadtest report folder: report.md, results.json, raw locust CSVs (already in raw/), plots."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from ensemble.base.machine import describe
from loadtest.cost import cost_table, load_prices, render
from loadtest.openloop import report_section as overload_section
from loadtest.perf_analyzer import report_section as perf_analyzer_section
from loadtest.targets import BASELINES, Target

PRICES = Path(__file__).with_name("prices.yaml")
TRITON = tuple(t.value for t in Target if t.layout is not None)


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


def _log_axis(axis, low: float, high: float) -> None:
    """Log scale labelled with plain numbers (1-2-5 steps over a short range, fewer over a long
    one); no labels on the minor ticks (they overlap when the range is under a decade)."""
    from matplotlib import ticker

    decades = math.log10(max(high, 1e-9) / max(low, 1e-9))
    subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0, 3.0) if decades <= 4 else (1.0,)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_locator(ticker.LogLocator(base=10, subs=range(1, 10)))
    axis.set_minor_formatter(ticker.NullFormatter())


def _measured(value) -> float | None:
    """A latency a plot can place (None/NaN/inf: the scenario has none)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def plot(results: list[dict], sla_ms: float, out: Path) -> list[str]:
    """Two PNGs: throughput against p99 per rows-per-request, and each scenario's p50/p90/p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_values = sorted({r["rows"] for r in results})
    targets = list(dict.fromkeys(r["target"] for r in results))
    colors = {t: f"C{i}" for i, t in enumerate(targets)}
    fig, axes = plt.subplots(1, len(rows_values), figsize=(6.5 * len(rows_values), 5), squeeze=False)
    for ax, rows in zip(axes[0], rows_values):
        for target in targets:
            points = sorted((r for r in results if r["target"] == target and r["rows"] == rows
                             and _measured(r["p99_ms"]) and r["rows_per_s"] > 0), key=lambda r: r["users"])
            if not points:
                continue
            xs, ys = [p["rows_per_s"] for p in points], [max(p["p99_ms"], 0.5) for p in points]
            ax.plot(xs, ys, marker="o", color=colors[target], label=target)
            for p, x, y in zip(points, xs, ys):
                ax.annotate(f"{p['users']}", (x, y), xytext=(5, 4), textcoords="offset points", fontsize=9,
                            color=colors[target])
        ax.axhline(sla_ms, color="grey", linestyle="--", linewidth=1, label=f"SLA p99 {sla_ms:g} ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_axis(ax.xaxis, *ax.get_xlim())
        _log_axis(ax.yaxis, *ax.get_ylim())
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("throughput (rows/s, log)")
        ax.set_ylabel("p99 latency (ms, log)")
        ax.set_title(f"{rows} row(s) per request; numbers at points = users")
        ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_p99.png", dpi=110)
    plt.close(fig)

    # Dots on a log axis, not bars: a bar's length from an arbitrary left edge reads as a quantity.
    fig, axes = plt.subplots(1, len(rows_values), figsize=(6.5 * len(rows_values),
                                                           0.3 * max(len(results) / len(rows_values), 4) + 1.8),
                             squeeze=False)
    marks = (("p50_ms", "o", "p50"), ("p90_ms", "s", "p90"), ("p99_ms", "D", "p99"))
    for ax, rows in zip(axes[0], rows_values):
        scenarios = [r for r in results if r["rows"] == rows]
        for i, r in enumerate(scenarios):
            values = [_measured(r[key]) for key, _, _ in marks]
            known = [v for v in values if v is not None]
            if len(known) > 1:
                ax.plot([min(known), max(known)], [i, i], color=colors[r["target"]], linewidth=1.5, alpha=0.6)
            for (key, marker, _), value in zip(marks, values):
                if value is not None:
                    ax.plot(max(value, 0.5), i, marker=marker, linestyle="", color=colors[r["target"]],
                            markerfacecolor="white" if key == "p50_ms" else colors[r["target"]], markersize=6)
        ax.set_yticks(range(len(scenarios)), [f"{r['target']}  u{r['users']}" for r in scenarios], fontsize=9)
        ax.set_ylim(len(scenarios) - 0.5, -0.5)
        ax.set_xscale("log")
        ax.axvline(sla_ms, color="grey", linestyle="--", linewidth=1)
        _log_axis(ax.xaxis, *ax.get_xlim())
        ax.grid(True, axis="x", which="major", alpha=0.3)
        ax.set_xlabel("latency (ms, log)")
        ax.set_title(f"{rows} row(s) per request (u = users)")
    fig.legend(handles=[plt.Line2D([], [], marker=m, linestyle="", color="dimgrey",
                                   markerfacecolor="white" if key == "p50_ms" else "dimgrey", label=label)
                        for key, m, label in marks]
               + [plt.Line2D([], [], color="grey", linestyle="--", label=f"SLA p99 {sla_ms:g} ms")],
               loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out / "latency_percentiles.png", dpi=110)
    plt.close(fig)
    return ["throughput_vs_p99.png", "latency_percentiles.png"]


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
    if value is None or (isinstance(value, float) and math.isnan(value)):
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


def _table(header: str, rows: list[str], intro: tuple[str, ...] = ()) -> list[str]:
    """A markdown table (after its introducing lines) and a blank line; nothing when it has no rows."""
    if not rows:
        return []
    return [*intro, header, "|" + " --- |" * (header.count("|") - 1), *rows, ""]


def title(results: list[dict]) -> str:
    """What was compared: Triton against the baselines only when both were measured."""
    measured = {r["target"] for r in results}
    if measured & set(TRITON) and measured & set(BASELINES):
        return "Load test: Triton vs CPU baselines"
    return "Load test: Triton" if measured & set(TRITON) else "Load test: CPU baselines"


def replot(folder: Path) -> list[str]:
    """Redraw a report folder's plots from its results.json (no new measurement)."""
    payload = json.loads((Path(folder) / "results.json").read_text())
    return plot(payload["scenarios"], payload["sla_ms"], Path(folder))


def write_report(out: Path, results: list[dict], options, pinning, seconds: float,
                 overload: dict | None = None, perf_analyzer: list[dict] | None = None) -> Path:
    sla = options.sla_ms
    head = headline(results, sla)
    server_vcpus = len(pinning.server.split(",")) if pinning.server else describe()["cores"]
    payload = {"machine": describe(), "date": time.strftime("%Y-%m-%d %H:%M"), "sla_ms": sla,
               "server_vcpus": server_vcpus, "pinning": {"server": pinning.server, "locust": pinning.load},
               "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
               "seconds": seconds, "scenarios": results, "headline": head, "ratios": ratios(head)}
    payload["overload"] = overload  # loadtest/openloop.py: capacity, then 2x open loop
    payload["perf_analyzer"] = perf_analyzer  # loadtest/perf_analyzer.py: Triton's own client, its sweep
    payload["peaks"] = [{k: p[k] for k in ("target", "rows", "users", "rows_per_s", "p99_ms")} for p in peaks(results)]
    (out / "results.json").write_text(json.dumps(_json_safe(payload), indent=1, default=str, allow_nan=False))
    plot(results, sla, out)
    costs = cost_table(payload, load_prices(PRICES))
    m = payload["machine"]
    stages = [f"| {r['target']} r{r['rows']} u{r['users']} | {name} | {s['queue_ms']:.3f} | {s['compute_ms']:.3f} "
              f"| {s['mean_batch_rows']:.1f} |" for r in results for name, s in sorted(r["stages"].items())]
    lines = [
        f"# {title(results)}", "",
        f"Measured {payload['date']} on {m['arch']}, {m['cores']} cores ({m['cpu']}), no GPU. "
        + (f"Servers pinned to CPU {pinning.server}, locust to CPU {pinning.load} (taskset)."
           if pinning.server else "No CPU pinning: servers and locust share all cores."),
        f"Each scenario: {options.warmup:g} s warm-up (discarded), then {options.duration:g} s measured; closed loop "
        "(each user sends its next request when the previous one returns; after a refusal, 503 or UNAVAILABLE, "
        "it backs off as the project's clients do). Latencies are locust's, which rounds them to whole "
        "milliseconds." + (" The mlserver baseline's requests carry missing dense values as 0, not NaN (its JSON "
                           "parser refuses a bare NaN); the rows cost the pipeline the same."
                           if any(r["target"] == Target.MLSERVER.value for r in results) else ""), "",
        f"## Headline: highest throughput with p99 <= {sla:g} ms", "",
        *_table("| target | rows/request | rows/s at SLA | users | p99 ms |",
                [f"| {h['target']} | {h['rows']} | {_fmt(h['rows_per_s_at_sla'])} | {_fmt(h['users'], 'd')} "
                 f"| {_fmt(h['p99_ms'], '.0f')} |" for h in head]),
        *_table("| Triton target | vs baseline | rows/request | throughput ratio at SLA |",
                [f"| {r['triton']} | {r['baseline']} | {r['rows']} | {_ratio(r['ratio'])} |" for r in payload["ratios"]]),
        *_table("| target | rows/request | rows/s | users | p99 ms |",
                [f"| {m['target']} | {m['rows']} | {m['rows_per_s']:,.0f} | {m['users']} | {_fmt(m['p99_ms'], '.0f')} |"
                 for m in peaks(results)], ("Highest throughput measured at any latency (same run):", "")),
        "![throughput vs p99](throughput_vs_p99.png)", "",
        "## All scenarios", "",
        *_table("| target | rows | users | req/s | rows/s | p50 ms | p90 ms | p99 ms | failures |",
                [f"| {r['target']} | {r['rows']} | {r['users']} | {r['requests_per_s']:,.1f} | {r['rows_per_s']:,.0f} "
                 f"| {_fmt(r['p50_ms'], '.0f')} | {_fmt(r['p90_ms'], '.0f')} | {_fmt(r['p99_ms'], '.0f')} "
                 f"| {r['failures']:.0f} |" for r in results]),
        "![latency percentiles](latency_percentiles.png)", "",
        *_table("| scenario | model | queue ms | compute ms | mean rows per execution |", stages,
                ("## Inside the server (Triton statistics, per request)", "")),
        *_table("| scenario | CPU ms per request | CPU us per row | by process (ms per request) |", cpu_rows(results), (
            "## Server CPU per request", "",
            "CPU time (user + system, from /proc) of the server processes over each measured run, divided by the "
            "requests served: what one request costs the server's core(s), whatever the latency. For Triton it "
            "is split by process (the server and one python-backend stub per model).", "")),
        *(["## Cost per million predictions", "",
           "From the headline throughput (prices in `loadtest/prices.yaml`). Extrapolations are labelled with "
           "their formula and are not measurements.", "", render(costs), ""] if costs else []),
        *perf_analyzer_section(perf_analyzer),
        *overload_section(overload),
        f"Raw locust CSVs: `raw/`. Results: `results.json`. Total run time {seconds / 60:.1f} min.", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


if __name__ == "__main__":  # python -m loadtest.report docs/results/loadtest: redraw the plots from results.json
    import sys

    for name in replot(Path(sys.argv[1] if len(sys.argv) > 1 else "build/loadtest/report")):
        print(Path(sys.argv[1] if len(sys.argv) > 1 else "build/loadtest/report") / name)
