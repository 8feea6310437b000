"""What a measurement ran on: every reported figure names its machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> dict:
    """Architecture, usable cores, CPU model, memory (GiB); no GPU is used by this project's runs."""
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"arch": platform.machine(), "cores": len(os.sched_getaffinity(0)), "cpu": cpu,
            "memory_gib": round(memory), "gpu": "none"}


def summary() -> str:
    m = describe()
    return f"{m['arch']}, {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, no GPU"
