"""Prometheus metrics of the served ranker: the latency summaries tritonserver is asked for, and
the readers the dashboard's tests use (exposition text, metric names in PromQL expressions).

Triton 2.51 exports per-model counters (requests, failures by reason, inferences, executions,
cumulative queue/compute microseconds) and, when started with
``--metrics-config=summary_latencies=true``, Prometheus summaries of the same durations
(``nv_inference_<stage>_summary_us`` with ``quantile`` labels, over a sliding window). The
quantiles come from ``--metrics-config=summary_quantiles=<q>:<error>,...``; the binary logs a
malformed value and starts anyway, so the value is checked here first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The Grafana dashboard shipped with docker-compose (provisioned from docker/grafana/).
DASHBOARD = PROJECT_ROOT / "docker" / "grafana" / "dashboards" / "ranker.json"
# The dashboard's fleet panels also read the Envoy gateway's statistics, which no tritonserver exports.
GATEWAY_METRIC_PREFIX = "envoy_"
# Its online-store panels read the rank model's lookup counters, which appear once a ranking request by
# ids has been served (ensemble/online/; backend.c, "the model's own counters").
STORE_METRIC_PREFIX = "ensemble_store_"
# Its experiment panels read what exists only during an experiment: shadow scoring's records (with a
# shadow share, ensemble/native/backend_shadow.c) and the per-arm counts of ranking requests (requests
# that name their release: backend_statistics.c); its served-score panel, what the native backend counts.
EXPERIMENT_METRIC_PREFIXES = ("ensemble_shadow_", "ensemble_arm_")
NATIVE_METRIC_PREFIX = "ensemble_served_score_"
# Its tables row reads a row store's counters (a release whose DLRMs keep their tables out of memory:
# ensemble/native/backend_tables.c), which only such a release exports.
TABLE_METRIC_PREFIX = "ensemble_table_"

# p50 / p90 / p95 / p99 with the rank error Prometheus' best practices suggest for each: the
# tighter the error, the more samples the server keeps per window.
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.005), (0.99, 0.001))


def parse_quantiles(text: str) -> tuple[tuple[float, float], ...]:
    """``"0.5:0.05,0.99:0.001"`` -> ((0.5, 0.05), (0.99, 0.001)).

    Raises:
        ValueError: naming the bad item (a quantile outside (0, 1), an error outside [0, 1) or
            larger than the distance to 0 or 1, a missing ``:``).
    """
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        quantile, sep, error = item.partition(":")
        try:
            q, e = float(quantile), float(error)
        except ValueError:
            raise ValueError(f"latency quantile {item!r}: expected <quantile>:<error>, e.g. 0.99:0.001") from None
        if not sep or not 0.0 < q < 1.0 or not 0.0 <= e < min(q, 1.0 - q):
            raise ValueError(f"latency quantile {item!r}: need 0 < quantile < 1 and 0 <= error < "
                             "min(quantile, 1 - quantile), e.g. 0.99:0.001")
        out.append((q, e))
    if not out:
        raise ValueError("no latency quantiles given (e.g. 0.5:0.05,0.99:0.001)")
    return tuple(out)


def format_quantiles(quantiles: tuple[tuple[float, float], ...]) -> str:
    return ",".join(f"{q:g}:{e:g}" for q, e in quantiles)


@dataclass(frozen=True)
class LatencySummaries:
    """Whether tritonserver exports latency summaries, and with which quantiles.

    Off by default, as in Triton: on a busy core their upkeep costs more than the native ranker's
    own work on a 1-row request and sets its tail (docs/serving.md, "The 1-row tail"). The
    compose services, which ship the dashboard, turn them on.

    Attributes:
        enabled: export ``nv_inference_{request,queue,compute_input,compute_infer,compute_output}_summary_us``.
        quantiles: (quantile, allowed rank error) pairs.
    """

    enabled: bool = False
    quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES

    def server_args(self) -> list[str]:
        """tritonserver flags (the cumulative counters stay on either way)."""
        if not self.enabled:
            return ["--metrics-config=summary_latencies=false"]
        parse_quantiles(format_quantiles(self.quantiles))  # the binary would only log a bad value
        return ["--metrics-config=summary_latencies=true",
                f"--metrics-config=summary_quantiles={format_quantiles(self.quantiles)}"]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> sample name -> [(labels, value)]. Comments are skipped;
    a summary appears as its own name (quantile samples) plus ``_count`` and ``_sum``."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        samples.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return samples


# PromQL words that look like identifiers but are not metric names.
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}
_STRIP = (re.compile(r'"(?:[^"\\]|\\.)*"'),             # string literals
          re.compile(r"\{[^}]*\}"),                      # label matchers
          re.compile(r"\[[^\]]*\]"),                     # range selectors
          re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),  # label lists
          re.compile(r"\$\{?\w+\}?"))                    # Grafana variables ($model, $__rate_interval)
_WORD = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels, numbers left out)."""
    for pattern in _STRIP:
        expr = pattern.sub(" ", expr)
    return {name for name, call in _WORD.findall(expr) if not call and name.lower() not in _PROMQL_WORDS}


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets (nested rows too) and
    query variables."""
    exprs = []

    def panels(items):
        for panel in items:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            panels(panel.get("panels", []))

    panels(dashboard.get("panels", []))
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if variable.get("type") != "query" or not query:
            continue
        function = re.fullmatch(r"\s*(label_values|query_result)\((.*)\)\s*", query, re.S)
        if function is None:
            exprs.append(query)
        elif function.group(1) == "query_result":
            exprs.append(function.group(2))
        elif "," in function.group(2):  # label_values(<series selector>, <label>)
            exprs.append(function.group(2).rsplit(",", 1)[0])
    return exprs


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    """Every metric name the dashboard queries."""
    dashboard = json.loads(Path(path).read_text())
    return set().union(*(promql_metric_names(e) for e in dashboard_queries(dashboard)))
