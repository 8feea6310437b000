"""Limits at the server's door: what ``ensemble serve`` asks tritonserver to refuse before any
model sees it.

The largest request the ranker takes is ``MAX_BATCH_SIZE`` rows (8,192): about 4 MB as v2 JSON
(13 numbers and 26 short strings a row), less with the binary tensor extension. A body limit of
16 MiB leaves room for that and refuses what can only be a mistake or an attack.

Triton added ``--http-max-input-size`` after 2.51 (the pip wheel's server does not know it; it
accepts any body, and decompresses gzip/deflate bodies without a bound), so the launcher passes
it only when the binary lists it in ``--help``. Where it cannot, the limit belongs in the load
balancer in front (docs/reliability.md, "Hostile input").
"""

from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path

HTTP_MAX_INPUT_BYTES = 16 * 2**20
MAX_INPUT_OPTION = "--http-max-input-size"


@lru_cache(maxsize=4)
def _help_text(binary: str, library_path: str) -> str:
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30,
                              env={"LD_LIBRARY_PATH": library_path})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def door_options(binary: Path, environment: dict[str, str]) -> list[str]:
    """The tritonserver options that bound what a client can send, as far as ``binary`` has them."""
    if MAX_INPUT_OPTION in _help_text(str(binary), environment.get("LD_LIBRARY_PATH", "")):
        return [f"{MAX_INPUT_OPTION}={HTTP_MAX_INPUT_BYTES}"]
    return []
