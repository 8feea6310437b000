"""The C request-path loops (ensemble.native._request) against their Python twins: same objects out,
same errors, and the extension is really built in this environment (so CI runs the C path)."""

import numpy as np
import pytest

from ensemble import native

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


@pytest.mark.parametrize("keys", [[b"a", b"b", b"a"], [b"b"], [], [b"a", b"missing"], [b"missing"]])
def test_gather_joins_each_keys_pair_like_the_python_form(keys):
    table = {key: (key * 3, value) for key, value in zip((b"a", b"b", b""), VALUES)}
    assert native.gather(table, keys) == native._gather_py(table, keys)
    if b"missing" not in keys:
        assert native.gather(table, keys) == (b"".join(table[k][0] for k in keys), b"".join(table[k][1] for k in keys))
    else:
        assert native.gather(table, keys) is None


def test_gather_refuses_keys_that_are_not_bytes_and_values_that_are_not_pairs():
    with pytest.raises(TypeError, match="key 1 is str"):
        native.gather({b"a": (b"", b"")}, [b"a", "a"])
    for value in ((b"x",), (b"x", "y"), [b"x", b"y"], b"xy"):
        with pytest.raises(TypeError, match="key 0 is not a pair of bytes"):
            native.gather({b"a": value}, [b"a"])


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
    # Keys of every length around the 8 bytes kept in a slot, and near misses of them: trailing NUL
    # bytes, one byte changed in a long key.
    odd = [b"a", b"a\x00", b"a\x00\x00", b"12345678", b"123456789", b"\x00" * 8, *(bytes([65 + n % 26]) * n for n in
                                                                              range(9, 41))]
    for c, table in enumerate(tables):
        table.update({key: 1000 + 50 * c + k for k, key in enumerate(odd)})
    for k, key in enumerate(odd + [b"a\x00\x00\x00", b"1234567", b"\x00" * 7, b"Z" * 24 + b"Y", b"\x00" * 9]):
        values[20 + 5 * k + k % 5] = key
    return tables, values


@pytest.mark.parametrize("vocabulary", [native.Vocabulary, native._VocabularyPy], ids=["c", "python"])
def test_vocabulary_reads_the_wire_like_lookup_of_the_split_values(vocabulary):
    tables, values = _vocabulary_case()
    expected = native.lookup(values, tables, 2)
    got = np.full(len(values), -9, np.int64)
    vocabulary(tables).lookup_wire(native.join_wire(values), 2, got)
    assert np.array_equal(got, expected)
    assert got[7] == 1 and got[8] == 2 and got[9] == 2 and (got >= 3).sum() > 100
    assert (got >= 1000).sum() == 38  # every odd key found in its column; the near misses (dict.get above) not


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


def _pandas_parse(blob: bytes, with_label: bool):
    """The general path of batch scoring: pandas, then the request tensors, then the wire format."""
    import io

    from clients.inputs import from_frame
    from ensemble.data import criteo

    frame = criteo.parse_criteo(io.BytesIO(blob), with_label=with_label, compression=None)
    dense, cats = from_frame(frame)
    labels = frame["label"].to_numpy() if with_label else None
    return labels, dense, native.join_wire(list(cats.reshape(-1)))


def _line(values) -> bytes:
    return ("\t".join(values) + "\n").encode()


EDGE = ["1", "-0", "", "007", "123456789012345", "-42", *["5"] * 8,  # label, then the 13 integers
        "68fd1e64", "", "nan", "NaN", "0", " padded ", *["x"] * 20]


@pytest.mark.parametrize("with_label", [True, False])
def test_tsv_to_wire_gives_what_pandas_and_the_serializer_give(with_label):
    from ensemble import schema
    from ensemble.data import criteo

    frame = criteo.synthesize(criteo.SynthConfig(rows=500, scale=0.01, seed=5)).frame
    text = frame.to_csv(sep="\t", header=False, index=False, na_rep="").encode()
    lines = text.splitlines(keepends=True) + [_line(EDGE)]
    if not with_label:
        lines = [line.split(b"\t", 1)[1] for line in lines]
    blob = b"".join(lines)
    parsed = native.tsv_to_wire(blob, len(lines), with_label, schema.N_DENSE, schema.N_CATEGORICAL)
    assert parsed is not None
    labels, dense, wire, row_ends = parsed
    want_labels, want_dense, want_wire = _pandas_parse(blob, with_label)
    assert wire == want_wire
    assert np.array_equal(dense, want_dense, equal_nan=True)
    assert np.array_equal(np.signbit(dense), np.signbit(want_dense))  # "-0" is -0.0 in both
    if with_label:
        assert labels.dtype == want_labels.dtype and np.array_equal(labels, want_labels)
    assert row_ends[-1] == len(wire) and np.all(np.diff(row_ends) > 0)
    assert native.split_wire(wire[row_ends[-2]:]) == [v.encode() for v in EDGE[14:]]


@pytest.mark.parametrize("change", [
    (1, "1.5"), (1, "+3"), (1, "1e3"), (1, " 5"), (1, "1234567890123456"), (0, "200"), (0, ""),
    (20, "caf\u00e9"), (20, "a\rb"), (39, "x\r"),
], ids=lambda c: repr(c))
def test_tsv_to_wire_leaves_other_lines_to_pandas(change):
    # Outside the narrow grammar the C parser gives up on the whole block; the client then parses
    # it with pandas, which accepts some of these and names the line of the others.
    from ensemble import schema

    values = list(EDGE)
    index, value = change
    values[index] = value
    blob = _line(EDGE) + _line(values)
    assert native.tsv_to_wire(blob, 2, True, schema.N_DENSE, schema.N_CATEGORICAL) is None


@pytest.mark.parametrize("blob, rows", [
    (_line(EDGE[:-1]), 1),  # a field short
    (_line(EDGE + ["x"]), 1),  # a field more
    (_line(EDGE)[:-1], 1),  # no final newline
    (_line(EDGE) * 2, 1),  # more lines than said
    (_line(EDGE), 2),  # fewer
])
def test_tsv_to_wire_checks_the_shape_of_every_line(blob, rows):
    from ensemble import schema

    assert native.tsv_to_wire(blob, rows, True, schema.N_DENSE, schema.N_CATEGORICAL) is None
