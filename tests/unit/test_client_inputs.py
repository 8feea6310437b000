"""Every input form gives the same request tensors (no server needed)."""

import numpy as np
import pyarrow as pa
import pytest

from clients.inputs import to_tensors
from clients.triton import Protocol, Retry, parse_url
from ensemble.data import criteo
from ensemble.features import transforms


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    out = criteo.synthesize(criteo.SynthConfig(rows=300, scale=0.001, seed=4)).frame
    return criteo.read_criteo([criteo.write_criteo(out, tmp_path_factory.mktemp("in") / "x.tsv")])


def test_frame_table_lines_and_arrays_agree(frame, tmp_path):
    dense, cats = transforms.dense_array(frame), transforms.encode_categorical(frame)
    path = criteo.write_criteo(frame, tmp_path / "x.tsv")
    lines = path.read_text().splitlines()
    unlabelled = ["\t".join(line.split("\t")[1:]) for line in lines]
    for got_dense, got_cats in (to_tensors(frame), to_tensors(pa.Table.from_pandas(frame)),
                                to_tensors(lines), to_tensors(unlabelled),
                                to_tensors(dense, cats.astype(str).astype(object))):
        np.testing.assert_array_equal(got_dense, dense)
        assert (got_cats == cats).all()


def test_bad_inputs_are_explained():
    with pytest.raises(ValueError, match="(?i)lacks criteo columns"):
        to_tensors(__import__("pandas").DataFrame({"I1": [1]}))
    with pytest.raises(ValueError, match="not a Criteo line"):
        to_tensors(["1\t2\t3"])
    with pytest.raises(TypeError, match="cannot score"):
        to_tensors(42)


def test_url_and_retry_policy():
    assert parse_url("grpc://h:1") == ("h:1", Protocol.GRPC)
    assert parse_url("h:2") == ("h:2", Protocol.HTTP)
    assert parse_url("h:2", "grpc") == ("h:2", Protocol.GRPC)
    with pytest.raises(ValueError):
        parse_url("http://h:1", "grpc")
    assert list(Retry(attempts=5, backoff=1, max_sleep=3).sleeps()) == [1, 2, 3, 3]


def test_bytes_serialization_matches_tritonclient():
    from tritonclient.utils import serialize_byte_tensor

    from clients.wire import serialize_bytes

    rng = np.random.default_rng(0)
    values = np.array([bytes(rng.integers(0, 256, rng.integers(0, 12)).astype(np.uint8)) for _ in range(2600)],
                      dtype=object).reshape(100, 26)
    values[0, 0], values[1, 1], values[2, 2] = b"", b"x" * 5000, b"ab\x00\x00"
    assert serialize_bytes(values) == serialize_byte_tensor(values).item()
    assert serialize_bytes(np.empty((0, 26), dtype=object)) == b""


def test_client_library_imports_no_heavy_framework():
    """The client depends on the contract (ensemble.schema), not on the server's frameworks."""
    from tests.helpers import modules_loaded

    heavy = ("pandas", "pyarrow", "torch", "tensorflow", "nvtabular", "xgboost", "tl2cgen", "ai_edge_litert")
    assert modules_loaded("import clients.triton", heavy) == []


def test_one_tsv_line_is_accepted_as_a_string():
    from clients.inputs import to_tensors

    line = "1\t" + "\t".join(["3"] * 13) + "\t" + "\t".join(["68fd1e64"] * 25 + [""])
    one_dense, one_cats = to_tensors(line)
    many_dense, many_cats = to_tensors([line])
    assert one_dense.shape == (1, 13) and one_cats.shape == (1, 26)
    assert (one_dense == many_dense).all() and (one_cats == many_cats).all()
    assert one_cats[0, -1] == b""
