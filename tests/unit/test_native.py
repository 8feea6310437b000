"""The C request-path loops (ensemble.serving._native) against their Python twins: same objects out,
same errors, and the extension is really built in this environment (so CI runs the C path)."""

import numpy as np
import pytest

from ensemble.serving import native

VALUES = [b"68fd1e64", b"", b"x" * 70000, "\u00e9".encode(), b"\xff\x00\xfe", b"  "]


def test_the_extension_is_built_here():
    # pip install -e . compiles it (setup.py); a silent fallback would hide a broken build.
    assert native.COMPILED


@pytest.mark.parametrize("values", [VALUES, [b""] * 26, []])
def test_wire_round_trip_matches_the_python_loops(values):
    wire = native.join_wire(values)
    assert wire == native._join_wire_py(values)
    assert native.split_wire(wire) == native._split_wire_py(wire) == values
    assert native.split_wire(np.frombuffer(wire, np.uint8)) == values  # what the stub passes


@pytest.mark.parametrize("cut", [1, 3, 5, 12])
def test_a_truncated_buffer_is_refused_by_both(cut):
    wire = native.join_wire([b"abcdefgh", b"ij"])[:-cut]
    for split in (native.split_wire, native._split_wire_py):
        with pytest.raises(ValueError, match="truncated"):
            split(wire)


def test_join_refuses_non_bytes_like_the_python_loop():
    for join in (native.join_wire, native._join_wire_py):
        with pytest.raises(TypeError, match="element 1"):
            join([b"a", "not bytes"])


def test_lookup_matches_dict_get_per_column():
    rng = np.random.default_rng(0)
    tables = tuple({f"{c}-{v}".encode(): 3 + v for v in range(50)} for c in range(26))
    values = [f"{i % 26}-{rng.integers(0, 80)}".encode() for i in range(26 * 40)] + [b""] * 26
    expected = np.empty(len(values), np.int64)
    native._lookup_py(values, tables, 2, expected)
    got = native.lookup(values, tables, 2)
    assert got.dtype == np.int64 and np.array_equal(got, expected)
    assert set(got[-26:]) == {2} and (got[:-26] >= 3).any()
