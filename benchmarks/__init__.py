"""Benchmark scripts: each prints a table and writes its results (committed runs live in docs/results/; not timed tests)."""

import json
import sys
from pathlib import Path

from loadtest.statistics import PERCENTILE_METHOD, percentile  # noqa: F401 - percentile: the benchmarks' one


def write_results(folder: str | Path, name: str, module: str, machine: str, **fields) -> Path:
    """``<folder>/<name>`` as JSON: the machine, the command that ran (``python -m <module>`` and this
    process's arguments) and ``fields``; prints and returns its path."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps({"machine": machine, "command": " ".join([f"python -m {module}", *sys.argv[1:]]),
                                "percentile": PERCENTILE_METHOD, **fields}, indent=1))
    print(f"wrote {path}")
    return path
