"""The clients' use of tritonclient's and grpcio's private API stays in clients/adapter.py, written for
the versions installed here."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from clients import adapter
from tests.helpers import lines_matching, requirement_pins

ROOT = Path(__file__).resolve().parents[2]
# attribute names of tritonclient's and grpcio's objects that are not their public API
PRIVATE = re.compile(r"(\w+)\._(raw_content|raw_data|input|parameters|data|channel)\b|\b_registered_method\b")


def test_the_adapter_was_written_for_the_installed_versions():
    """Fails on an upgrade of either library: read clients/adapter.py against the new version, then
    change WRITTEN_FOR and requirements.txt together."""
    installed = {name: metadata.version(name) for name in adapter.WRITTEN_FOR}
    assert installed == adapter.WRITTEN_FOR


def test_requirements_pin_the_versions_the_adapter_was_written_for():
    assert requirement_pins(ROOT, adapter.WRITTEN_FOR) == adapter.WRITTEN_FOR


def test_no_other_module_touches_their_private_api():
    assert lines_matching(ROOT, "adapter.py", lambda line: any(m.group(1) != "self" for m in PRIVATE.finditer(line))) == []
