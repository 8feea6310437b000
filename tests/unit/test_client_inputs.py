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


def test_wire_strings_send_what_the_object_array_sends(frame):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from clients.triton import build_inputs
    from clients.wire import WireStrings
    from ensemble import native

    dense, cats = to_tensors(frame)
    row_ends = np.cumsum([sum(4 + len(v) for v in row) for row in cats])
    wire = WireStrings(native.join_wire(list(cats.reshape(-1))), row_ends, cats.shape[1])
    assert wire.shape == cats.shape and len(wire) == len(cats)
    for rows in (slice(0, 300), slice(10, 20), slice(299, None), slice(5, 5), slice(None, 7)):
        assert wire[rows].shape == cats[rows].shape
        assert np.array_equal(wire[rows].to_objects(), cats[rows])
    with pytest.raises(TypeError, match="contiguous slice"):
        wire[::2]
    for tc, protocol, binary in ((grpcclient, Protocol.GRPC, True), (httpclient, Protocol.HTTP, True),
                                 (httpclient, Protocol.HTTP, False)):
        sent, want = (build_inputs(tc, protocol, binary, dense[10:20], c[10:20])[1] for c in (wire, cats))
        assert sent._get_tensor() == want._get_tensor()
        if protocol is Protocol.GRPC:
            assert sent._get_content() == want._get_content()
        else:
            assert sent._get_binary_data() == want._get_binary_data()


@pytest.mark.parametrize("all_scores, priority, bulk", [(False, 0, False), (True, 2, True)])
def test_grpc_request_is_the_message_tritonclient_builds(frame, all_scores, priority, bulk):
    """RankerClient serializes its gRPC request itself (grpc_request); it must stay the message
    tritonclient's infer sends for the same tensors and settings (its builder is private: the
    pinned tritonclient's) once parsed, as the server parses it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._utils import _get_inference_request

    from clients.triton import build_inputs, build_outputs, grpc_request
    from clients.wire import WireStrings
    from ensemble import schema
    from ensemble import native

    dense, cats = to_tensors(frame)
    parameters = {schema.BULK_PARAMETER: True} if bulk else None
    want = _get_inference_request(
        model_name="ranker", inputs=build_inputs(grpcclient, Protocol.GRPC, True, dense[:5], cats[:5]),
        model_version="", request_id="", outputs=build_outputs(grpcclient, Protocol.GRPC, True, all_scores),
        sequence_id=0, sequence_start=False, sequence_end=False, priority=priority, timeout=60_000_000,
        parameters=parameters)
    outputs = schema.RANKER_OUTPUTS if all_scores else (schema.SCORE,)
    got = grpc_request("ranker", ((schema.DENSE, dense[:5]), (schema.CATEGORICAL, cats[:5])), outputs,
                       60_000_000, priority, parameters)
    assert service_pb2.ModelInferRequest.FromString(got) == want
    wire = WireStrings(native.join_wire(list(cats[:5].reshape(-1))),
                       np.cumsum([sum(4 + len(v) for v in row) for row in cats[:5]]), cats.shape[1])
    assert grpc_request("ranker", ((schema.DENSE, dense[:5]), (schema.CATEGORICAL, wire)), outputs,
                        60_000_000, priority, parameters) == got
    # a ranking request: context and candidates, an int32 top k, two outputs of other types
    from clients.triton import _input

    sent = ((schema.CONTEXT_DENSE, dense[:1, :4]), (schema.CANDIDATE_DENSE, dense[:5]),
            (schema.CANDIDATE_CATEGORICAL, cats[:5]), (schema.TOP_K, np.array([3], np.int32)))
    answers = (schema.CANDIDATE_SCORES, schema.ORDER)
    want = _get_inference_request(
        model_name=schema.RANK_MODEL, inputs=[_input(grpcclient, Protocol.GRPC, True, t, a) for t, a in sent],
        model_version="", request_id="", outputs=[grpcclient.InferRequestedOutput(t.name) for t in answers],
        sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=60_000_000, parameters=None)
    assert service_pb2.ModelInferRequest.FromString(grpc_request(schema.RANK_MODEL, sent, answers, 60_000_000)) == want
    # a tensor of more than 127 bytes (a multi-byte length) and one of none, after a cached head
    big = np.zeros((2000, 13), np.float32)
    for rows in (big, big[:0], big[:1]):
        want = _get_inference_request(
            model_name="ranker", inputs=build_inputs(grpcclient, Protocol.GRPC, True, rows, cats[:len(rows)]),
            model_version="", request_id="", outputs=build_outputs(grpcclient, Protocol.GRPC, True, False),
            sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=60_000_000, parameters=None)
        got = grpc_request("ranker", ((schema.DENSE, rows), (schema.CATEGORICAL, cats[:len(rows)])), (schema.SCORE,),
                           60_000_000)
        assert service_pb2.ModelInferRequest.FromString(got) == want


def test_tsv_chunks_carry_the_tensors_pandas_gives(frame, tmp_path):
    from clients.inputs import from_frame
    from clients.batch.input import plan_partitions, read_chunks, read_partition
    from clients.progress import INPUT_BYTES
    from clients.wire import WireStrings

    path = criteo.write_criteo(frame, tmp_path / "x.tsv")
    lines = path.read_text().splitlines(keepends=True)
    values = lines[130].split("\t")
    values[2] = "2.5"  # pandas reads it; the C parser leaves this line's block to pandas
    lines[130] = "\t".join(values)
    path.write_text("".join(lines))
    (part,) = plan_partitions([str(path)])
    chunks, frames = list(read_chunks(part, 100)), list(read_partition(part, 100))
    assert [isinstance(c.categorical, WireStrings) for c in chunks] == [True, False, True]
    assert len(chunks) == len(frames) == 3
    for chunk, general in zip(chunks, frames):
        dense, cats = from_frame(general)
        got = chunk.categorical.to_objects() if isinstance(chunk.categorical, WireStrings) else chunk.categorical
        np.testing.assert_array_equal(chunk.dense, dense)
        assert (got == cats).all()
        assert chunk.frame["label"].dtype == general["label"].dtype
        assert chunk.frame["label"].tolist() == general["label"].tolist()
        assert chunk.frame.attrs[INPUT_BYTES] == general.attrs[INPUT_BYTES]
    assert chunks[1].dense[30, 1] == 2.5


def test_client_library_imports_no_heavy_framework():
    """The client depends on the contract (ensemble.schema), not on the server's frameworks."""
    from tests.helpers import modules_loaded

    heavy = ("pandas", "pyarrow", "torch", "tensorflow", "nvtabular", "xgboost", "ai_edge_litert")
    assert modules_loaded("import clients.triton", heavy) == []


_SEES_GRPC_IMPORT = """import os, sys
class Spy:  # sees the variable at the moment grpc's own module starts loading
    def find_spec(self, name, path=None, target=None):
        if name == 'grpc': print(repr(os.environ.get('GRPC_EXPERIMENTS')))
sys.meta_path.insert(0, Spy())
"""


@pytest.mark.parametrize("given", [None, "", "-event_engine_listener"])
@pytest.mark.parametrize("code", [
    "from ensemble.base.grpc_polling import import_grpc\nimport_grpc(); import_grpc()",
    # an `ensemble` command, before NVTabular or anything else imports grpc
    "from ensemble.cli import main\nmain(['synth', '--rows', '5', '--output', sys.argv[1]])",
], ids=["import_grpc", "ensemble-command"])
def test_grpc_is_imported_with_the_variable_set_for_the_import_only(given, code, tmp_path):
    """grpcio reads GRPC_EXPERIMENTS while it is imported: the project's value then (or the user's,
    which is kept, empty included), and afterwards the environment children inherit is untouched."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    probe = f"{_SEES_GRPC_IMPORT}{code}\nprint(repr(os.environ.get('GRPC_EXPERIMENTS')), 'grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "rows.tsv")], capture_output=True, text=True,
                         check=True, env=env)
    during, after = [line for line in out.stdout.splitlines() if line.startswith(("'", "None"))]
    assert during == repr("-event_engine_client" if given is None else given)
    assert after == f"{given!r} True"


def test_one_tsv_line_is_accepted_as_a_string():
    from clients.inputs import to_tensors

    line = "1\t" + "\t".join(["3"] * 13) + "\t" + "\t".join(["68fd1e64"] * 25 + [""])
    one_dense, one_cats = to_tensors(line)
    many_dense, many_cats = to_tensors([line])
    assert one_dense.shape == (1, 13) and one_cats.shape == (1, 26)
    assert (one_dense == many_dense).all() and (one_cats == many_cats).all()
    assert one_cats[0, -1] == b""
