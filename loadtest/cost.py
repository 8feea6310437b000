"""Dollars per million predictions from measured throughput.

``cost per 1M = hourly price / (predictions per second x 3600) x 1e6``. A figure for the
machine the load test ran on is *measured* (only when the price file gives that machine a
price). Anything else is an *extrapolation* and is labelled with its formula: CPU instances
scale the measured throughput linearly with vCPUs (``rows/s x instance vCPUs / server vCPUs``,
optimistic: it ignores memory bandwidth and contention); GPU instances get no figure without a
GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instance:
    name: str
    hourly_usd: float | None
    vcpus: int
    gpus: int = 0
    source: str = ""


def load_prices(path: str | Path) -> dict:
    """The price file: ``instances`` (name -> Instance) and ``measured_machine``."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    instances = {name: Instance(name, spec.get("hourly_usd"), int(spec["vcpus"]), int(spec.get("gpus", 0)),
                                spec.get("source", "")) for name, spec in raw.get("instances", {}).items()}
    return {"instances": instances, "measured_machine": raw.get("measured_machine") or {}}


def cost_per_million(hourly_usd: float, predictions_per_s: float) -> float:
    if predictions_per_s <= 0:
        return float("inf")
    return hourly_usd / (predictions_per_s * 3600.0) * 1e6


def cost_table(results: dict, prices: dict) -> list[dict]:
    """One row per (target, rows per request, instance) from a report's ``headline``."""
    server_vcpus = int(results.get("server_vcpus") or 1)
    rows_out = []
    measured = prices.get("measured_machine", {})
    for item in results.get("headline", []):
        rate = item.get("rows_per_s_at_sla")
        base = {"target": item["target"], "rows": item["rows"], "measured_rows_per_s": rate}
        if not rate:
            rows_out.append({**base, "instance": "-", "usd_per_million": None,
                             "basis": f"no scenario met the SLA (p99 <= {results.get('sla_ms')} ms)"})
            continue
        if measured.get("hourly_usd"):
            rows_out.append({**base, "instance": measured.get("name", "measured machine"),
                             "usd_per_million": cost_per_million(float(measured["hourly_usd"]), rate),
                             "basis": "measured"})
        for inst in prices["instances"].values():
            if inst.gpus:
                rows_out.append({**base, "instance": inst.name, "usd_per_million": None,
                                 "basis": "not measured: no GPU run on this machine"})
                continue
            scaled = rate * inst.vcpus / server_vcpus
            rows_out.append({**base, "instance": inst.name, "usd_per_million": cost_per_million(inst.hourly_usd, scaled),
                             "basis": f"extrapolated: {rate:,.0f} rows/s x {inst.vcpus}/{server_vcpus} vCPUs "
                                      f"= {scaled:,.0f} rows/s at ${inst.hourly_usd}/h"})
    return rows_out


def render(rows: list[dict]) -> str:
    lines = ["| target | rows/request | instance | $ per 1M predictions | basis |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        usd = "-" if r["usd_per_million"] is None else f"${r['usd_per_million']:.4f}"
        lines.append(f"| {r['target']} | {r['rows']} | {r['instance']} | {usd} | {r['basis']} |")
    return "\n".join(lines)
