"""What a load test reads of the server around a run: Triton's per-model statistics and the processes' CPU time,
turned into per-request figures."""

from __future__ import annotations

import json
import math
import urllib.request

# How every benchmark, demo and load test of the project reads a percentile from its samples (said
# once in docs/load-testing.md; result files record it).
PERCENTILE_METHOD = "nearest rank: the ceil(q n)-th smallest of n samples"


def percentile(samples, q: float) -> float:
    """The nearest-rank percentile: the ``ceil(q * n)``-th smallest of the ``n`` samples (``0 <= q <= 1``;
    q = 0 gives the smallest); NaN when there are none. Every reported p50 and p99 is this: an actual
    sample, never an interpolation between two."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def model_stats(url: str | None) -> dict | None:
    """Triton's statistics at ``url`` (``/v2/models[/NAME]/stats``), keyed by model name; None
    when there is no URL or the server does not answer."""
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return {m["name"]: m for m in json.load(reply)["model_stats"]}
    except OSError:
        return None


def stage_times(before: dict | None, after: dict | None) -> dict[str, dict[str, float]]:
    """Per model: mean queue and compute milliseconds per request, mean batch size (rows per
    execution) and requests per execution."""
    if not before or not after:
        return {}
    stages = {}
    for name, model in after.items():
        old = before.get(name, {}).get("inference_stats", {})
        new = model["inference_stats"]
        count = new["success"]["count"] - old.get("success", {}).get("count", 0)
        if count <= 0:
            continue
        per = lambda key: (new[key]["ns"] - old.get(key, {}).get("ns", 0)) / count / 1e6  # noqa: E731
        executions = model.get("execution_count", 0) - before.get(name, {}).get("execution_count", 0)
        inferences = model.get("inference_count", 0) - before.get(name, {}).get("inference_count", 0)
        stages[name] = {"requests": count, "queue_ms": per("queue"),
                        "compute_ms": per("compute_input") + per("compute_infer") + per("compute_output"),
                        "mean_batch_rows": inferences / executions if executions else 0.0,
                        "requests_per_call": count / executions if executions else 0.0}
    return stages


def cpu_per_request(before: dict | None, after: dict | None, requests: float) -> dict[str, float]:
    """Server CPU milliseconds per request, per process, over the measured run. The warm-up and
    the few statistics calls around the run are outside the window; CPU time has the kernel's
    clock-tick resolution (10 ms), so a process needs a few thousand requests for 0.01 ms."""
    if not before or not after or not requests:
        return {}
    return {name: max(0.0, after[name] - before.get(name, 0.0)) * 1000 / requests for name in after}
