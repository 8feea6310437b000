"""Hostile input at the door, sent to the real server: oversized bodies, lying lengths, many idle
connections, malformed gRPC frames, compressed bodies. Each gets a clear refusal (or is served
correctly, for valid compressed bodies) and the server keeps serving."""

from __future__ import annotations

import gzip
import json
import socket
import zlib

import numpy as np
import pytest

from clients.triton import RankerClient
from ensemble import schema
from ensemble.operate.door import HTTP_MAX_INPUT_BYTES
from tests.helpers import fresh_rows, http_exchange


def _post(address: str, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    reply = http_exchange(address, b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: ranker\r\nContent-Type: application/json\r\n"
                      + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return int(reply.split(b" ", 2)[1]), reply.partition(b"\r\n\r\n")[2]


def _still_serving(server, pipeline) -> None:
    dense, cats = fresh_rows(3, seed=91)
    expected = pipeline.score(dense, cats)["score"].ravel()
    for client in (RankerClient(server.http_url, "http"), RankerClient(server.grpc_url, "grpc")):
        np.testing.assert_allclose(client.score(dense, cats), expected, atol=1e-5)
        client.close()


def test_an_oversized_body_is_refused(server, pipeline):
    rows = HTTP_MAX_INPUT_BYTES // 330 + 1  # ~340 bytes of JSON a row: past the limit and past max_batch_size
    dense = b",".join([b"1.0"] * (rows * schema.N_DENSE))
    cats = b",".join([b'"68fd1e64"'] * (rows * schema.N_CATEGORICAL))
    body = (b'{"inputs":[{"name":"dense","shape":[%d,13],"datatype":"FP32","data":[%s]},'
            b'{"name":"categorical","shape":[%d,26],"datatype":"BYTES","data":[%s]}]}' % (rows, dense, rows, cats))
    assert len(body) > HTTP_MAX_INPUT_BYTES
    status, reply = _post(server.http_url, body)
    # Triton 2.51 (no body limit) refuses the batch size; a Triton with --http-max-input-size the size
    assert status == 400 and ("batch-size must be <=" in reply.decode() or "maximum allowed" in reply.decode()), reply
    _still_serving(server, pipeline)


def test_a_body_shorter_than_its_length_or_headers_never_finished_do_not_block_others(server, pipeline):
    host, port = server.http_url.rsplit(":", 1)
    liars = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
    try:
        for k, sock in enumerate(liars):
            sock.sendall(b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n{"
                         if k % 2 else b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        _still_serving(server, pipeline)
    finally:
        for sock in liars:
            sock.close()
    _still_serving(server, pipeline)


def test_many_idle_connections_do_not_stop_it_serving(server, pipeline):
    opened = []
    try:
        for address, count in ((server.http_url, 400), (server.grpc_url, 200)):
            host, port = address.rsplit(":", 1)
            opened += [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]
        _still_serving(server, pipeline)
    finally:
        for sock in opened:
            sock.close()
    _still_serving(server, pipeline)


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.mark.parametrize("frames", [
    b"\x00\x01\x02garbage that is not HTTP/2 at all" * 40,
    HTTP2_PREFACE + b"\x00\x00\x04\xff\x00\x00\x00\x00\x00" + b"\xde\xad\xbe\xef",  # unknown frame type, short payload
    HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x40\x01\x05\x00\x00\x00\x01"
    + b"\xff" * 64,  # settings, then a HEADERS frame of 64 bytes that are no valid header block
], ids=["not-http2", "unknown-frame", "garbage-headers-frame"])
def test_malformed_grpc_frames_are_refused(server, pipeline, frames):
    # the server answers with its SETTINGS (and for a broken stream, grpc-status 14 "Failed parsing
    # HTTP/2"), then closes the connection: http_exchange returns on that close and raises if it is held
    reply = http_exchange(server.grpc_url, frames, timeout=10)
    assert b"grpc-status\x010" not in reply, reply[:200]
    _still_serving(server, pipeline)


def test_compressed_bodies_are_decompressed_or_refused_clearly(server, pipeline):
    dense, cats = fresh_rows(2, seed=93)
    dense, cats = dense[:2], cats[:2]
    body = schema.v2_json_request(dense, cats)
    status, plain = _post(server.http_url, body)
    assert status == 200
    expected = pipeline.score(dense, cats)["score"].ravel()
    np.testing.assert_allclose(json.loads(plain)["outputs"][0]["data"], expected, atol=1e-5)
    for encoding, packed in ((b"gzip", gzip.compress(body)), (b"deflate", zlib.compress(body))):
        status, reply = _post(server.http_url, packed, b"Content-Encoding: " + encoding + b"\r\n")
        assert status == 200, (encoding, reply)
        assert json.loads(reply)["outputs"] == json.loads(plain)["outputs"]
    status, reply = _post(server.http_url, b"these bytes are not gzip", b"Content-Encoding: gzip\r\n")
    assert status == 400, reply
    status, reply = _post(server.http_url, body, b"Content-Encoding: br\r\n")
    assert status == 501 and b"Unsupported compression type" in reply, reply
    _still_serving(server, pipeline)
