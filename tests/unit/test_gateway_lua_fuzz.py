"""The gateway's Lua parsers fuzzed against independent readings of the same bytes (``tests/fuzz/lua.py``:
protobuf, Python's json, C's atoi), a bounded number of examples each, about 25 s in all on the
build VM. Longer runs: ``.venv/bin/python -m tests.fuzz.lua --seconds 600`` (docs/fuzzing.md)."""

from __future__ import annotations

import pytest

from tests.fuzz import lua as fuzz

# hypothesis examples per parser; each gives many inputs (truncations, spellings)
EXAMPLES = {"grpc": 1500, "depth": 2000, "string": 3000, "key": 1200}


@pytest.fixture(scope="module")
def lua():
    return fuzz.runtime()


@pytest.mark.parametrize("parser", list(fuzz.PARSERS))
def test_the_lua_reads_what_the_reference_reads(lua, parser):
    before = fuzz.COUNTS[parser]
    fuzz.property_test(parser, lua, EXAMPLES[parser])()
    assert fuzz.COUNTS[parser] - before >= EXAMPLES[parser]  # every example reached the check
