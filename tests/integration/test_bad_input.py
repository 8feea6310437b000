"""Malformed requests get a 400-class error that says what is wrong; the server keeps serving."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ensemble import schema
from tests.helpers import post_infer


def _post(layout_server, body: dict):
    return post_infer(f"http://{layout_server.http_url}", json.dumps(body).encode())


def _dense(rows=1, dims=13, datatype="FP32", name="dense"):
    return {"name": name, "shape": [rows, dims], "datatype": datatype, "data": [1.0] * (rows * dims)}


def _cats(rows=1, dims=26):
    return {"name": "categorical", "shape": [rows, dims], "datatype": "BYTES", "data": ["68fd1e64"] * (rows * dims)}


CASES = {
    "wrong dtype": ({"inputs": [_dense(datatype="FP64"), _cats()]}, "data-type"),
    "wrong shape": ({"inputs": [_dense(dims=12), _cats()]}, "shape"),
    "wrong categorical shape": ({"inputs": [_dense(), _cats(dims=25)]}, "shape"),
    "missing input": ({"inputs": [_dense()]}, "categorical"),
    "unknown input": ({"inputs": [_dense(), _cats(), _dense(name="extra")]}, "extra"),
    "over max batch": ({"inputs": [_dense(rows=schema.MAX_BATCH_SIZE + 1), _cats(rows=schema.MAX_BATCH_SIZE + 1)]},
                       "batch"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_rejected_clearly(layout_server, case):
    body, word = CASES[case]
    status, reply = _post(layout_server, body)
    assert 400 <= status < 500, (status, reply)
    assert word.lower() in reply["error"].lower(), reply["error"]
    ok_status, ok = _post(layout_server, {"inputs": [_dense(), _cats()]})
    assert ok_status == 200 and 0 < ok["outputs"][0]["data"][0] < 1


def test_wrong_dtype_over_grpc(layout_server, grpc_client):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    raw = grpcclient.InferenceServerClient(layout_server.grpc_url)
    dense = grpcclient.InferInput("dense", [2, 13], "FP64")
    dense.set_data_from_numpy(np.ones((2, 13), np.float64))
    cats = grpcclient.InferInput("categorical", [2, 26], "BYTES")
    cats.set_data_from_numpy(np.full((2, 26), b"a", dtype=object))
    with pytest.raises(InferenceServerException, match="(?i)data-type") as err:
        raw.infer("ranker", [dense, cats])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert grpc_client.score(np.ones((2, 13), np.float32), np.full((2, 26), b"a", dtype=object)).shape == (2,)


def test_json_data_shorter_than_shape(layout_server):
    """Triton 2.51's HTTP frontend answers this JSON parse failure with 500, not 400 (its
    choice, not ours); the message is still clear and the server keeps serving."""
    status, reply = _post(layout_server, {"inputs": [dict(_dense(), data=[1.0] * 5), _cats()]})
    assert status in (400, 500) and "shape" in reply["error"].lower()
    ok_status, _ = _post(layout_server, {"inputs": [_dense(), _cats()]})
    assert ok_status == 200


def test_json_nan_and_infinity_are_missing_values(layout_server, pipeline):
    """Triton's JSON parser takes bare NaN/Infinity (json.dumps writes them); both mean missing."""
    row = np.array([[np.nan, 5, np.inf, 3, -np.inf, 4, 15, 2, 181, 1, 2, np.nan, 2]], np.float32)
    cats = np.array([[b"68fd1e64", b""] * 13], dtype=object)
    status, reply = _post(layout_server, {"inputs": [
        {"name": "dense", "shape": [1, 13], "datatype": "FP32", "data": row.ravel().tolist()},
        {"name": "categorical", "shape": [1, 26], "datatype": "BYTES", "data": [c.decode() for c in cats[0]]}]})
    assert status == 200, reply
    score = {o["name"]: o["data"][0] for o in reply["outputs"]}["score"]
    assert abs(score - float(pipeline.score(row, cats)["score"][0, 0])) <= 1e-6


def _wire(values) -> bytes:
    return b"".join(len(v).to_bytes(4, "little") + v for v in values)


MALFORMED_STRINGS = {
    "a length past the end": _wire([b"68fd1e64"] * 25) + (100).to_bytes(4, "little") + b"68f",
    "fewer strings than the shape": _wire([b"68fd1e64"] * 25),
    "bytes after the last string": _wire([b"68fd1e64"] * 26) + b"\x00\x00",
}


def _binary_post(layout_server, cats_wire: bytes, rows: int = 1) -> tuple[int, dict]:
    """A v2 request in the binary tensor extension (what the project's clients send), raw."""
    import http.client

    dense = np.ones((rows, 13), np.float32).tobytes()
    header = json.dumps({"inputs": [
        {"name": "dense", "shape": [rows, 13], "datatype": "FP32", "parameters": {"binary_data_size": len(dense)}},
        {"name": "categorical", "shape": [rows, 26], "datatype": "BYTES",
         "parameters": {"binary_data_size": len(cats_wire)}}], "outputs": [{"name": "score"}]}).encode()
    host, port = layout_server.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", schema.RANKER_INFER_PATH, header + dense + cats_wire,
                           {"Inference-Header-Content-Length": str(len(header))})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


@pytest.mark.parametrize("case", sorted(MALFORMED_STRINGS))
def test_a_malformed_string_tensor_is_refused_and_requests_beside_it_are_answered(layout_server, case):
    """A binary BYTES tensor whose strings do not fill its shape exactly gets a 400-class error;
    well-formed requests in flight at the same time (so in the same model calls) are answered.

    Triton counts the strings and their length prefixes itself; a last string whose length runs past
    the buffer passes those checks, and Triton's python backend then answers its error to every
    request of the call it was batched into (docs/serving.md, "The native layout"). So in the
    python-backend layouts a request beside it may get that request's error, and nothing else; the
    native layout answers it alone."""
    import concurrent.futures as cf

    from ensemble.models.registry import Layout

    good = _wire([b"68fd1e64"] * 26)
    shared = case == "a length past the end" and layout_server.options.layout is not Layout.NATIVE
    with cf.ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            others = [pool.submit(_binary_post, layout_server, good) for _ in range(7)]
            status, reply = _binary_post(layout_server, MALFORMED_STRINGS[case])
            assert 400 <= status < 500 and reply.get("error"), (status, reply)
            for other in others:
                ok_status, ok = other.result()
                if shared and ok_status != 200:
                    assert (ok_status, ok) == (status, reply)  # the malformed request's own error, no other
                    continue
                assert ok_status == 200 and 0 < ok["outputs"][0]["data"][0] < 1, (ok_status, ok)
