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


def _vocabulary_case(seed=4):
    rng = np.random.default_rng(seed)
    tables = tuple({**{f"{c}-{v}".encode(): 3 + v for v in range(40 + c)}, b"": 1} for c in range(5))
    values = [f"{i % 5}-{rng.integers(0, 70)}".encode() for i in range(5 * 60)]
    values[7] = b""  # missing
    values[8] = b"\xff" * 9000  # long, unseen
    values[9] = b"2-3"  # another column's value: looked up in its own column only
    return tables, values


@pytest.mark.parametrize("vocabulary", [native.Vocabulary, native._VocabularyPy], ids=["c", "python"])
def test_vocabulary_reads_the_wire_like_lookup_of_the_split_values(vocabulary):
    tables, values = _vocabulary_case()
    expected = native.lookup(values, tables, 2)
    got = np.full(len(values), -9, np.int64)
    vocabulary(tables).lookup_wire(native.join_wire(values), 2, got)
    assert np.array_equal(got, expected)
    assert got[7] == 1 and got[8] == 2 and got[9] == 2 and (got >= 3).sum() > 100


@pytest.mark.parametrize("vocabulary", [native.Vocabulary, native._VocabularyPy], ids=["c", "python"])
def test_vocabulary_refuses_a_truncated_buffer_or_another_count(vocabulary):
    tables, values = _vocabulary_case()
    wire = native.join_wire(values)
    table = vocabulary(tables)
    with pytest.raises(ValueError, match="truncated"):
        table.lookup_wire(wire[:-3], 2, np.empty(len(values), np.int64))
    for count in (len(values) - 1, len(values) + 1):
        with pytest.raises(ValueError, match=f"{len(values)} values in the BYTES tensor, {count} expected"):
            table.lookup_wire(wire, 2, np.empty(count, np.int64))


def test_vocabulary_refuses_keys_that_are_not_bytes():
    with pytest.raises(TypeError, match="bytes"):
        native.Vocabulary(({"a": 3},))


def test_dense_prepare_matches_numpy():
    rng = np.random.default_rng(5)
    dense = (rng.standard_normal((64, 13)) * 1000).astype(np.float32)
    dense[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    for fill, clip in ((0.0, 0.0), (-1.5, -3.0)):
        want = np.empty_like(dense)
        native._dense_prepare_py(dense, want, fill, clip)
        got = native.dense_prepare(dense, fill, clip)
        assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(native.dense_prepare(dense.astype(np.float64), 0.0, 0.0), native.dense_prepare(dense, 0.0, 0.0))


def test_blend_matches_the_numpy_form_bit_for_bit():
    rng = np.random.default_rng(6)
    scores = [rng.random((5000, 1), dtype=np.float32) for _ in range(3)]
    scores[0][:3, 0] = [0.0, 1.0, 1e-9]  # clipped at eps
    weights, bias, eps = (0.7, 1.3, -0.2), 0.1, 1e-6
    stacked = np.clip(np.concatenate(scores, axis=1).astype(np.float64), eps, 1 - eps)
    z = (np.log(stacked) - np.log1p(-stacked)) @ np.asarray(weights) + bias
    want = (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    python = np.empty(5000, np.float32)
    native._blend_py(tuple(scores), weights, bias, eps, python)
    got = native.blend(scores, weights, bias, eps)
    assert np.array_equal(got, want) and np.array_equal(python, want)
    nan = native.blend([np.array([np.nan], np.float32)] * 3, weights, bias, eps)
    assert np.isnan(nan).all()  # a NaN score stays NaN, as in numpy
