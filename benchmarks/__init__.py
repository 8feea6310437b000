"""Benchmark scripts: each prints a table and writes its results (committed runs live in docs/results/; not timed tests)."""

import json
import sys
from pathlib import Path


def write_results(folder: str | Path, name: str, module: str, machine: str, **fields) -> Path:
    """``<folder>/<name>`` as JSON: the machine, the command that ran (``python -m <module>`` and this
    process's arguments) and ``fields``; prints and returns its path."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps({"machine": machine, "command": " ".join([f"python -m {module}", *sys.argv[1:]]),
                                **fields}, indent=1))
    print(f"wrote {path}")
    return path


def percentile(samples, q: float) -> float:
    """The sample at quantile ``q`` (nearest rank, 0 <= q <= 1) of ``samples``; NaN when there are none."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")
