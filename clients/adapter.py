"""Every use the clients make of tritonclient's and grpcio's private API, in one place.

The clients send BYTES tensors already in Triton's wire format (tritonclient's own serializer loops per
element in Python) and make ``ModelInfer`` calls with requests they serialize themselves. Both need fields
and arguments those libraries do not document. They were written against the versions in
:data:`WRITTEN_FOR`, which requirements.txt pins; ``tests/unit/test_client_adapter.py`` fails when the
installed versions differ, so an upgrade means reading these few lines again, not a silent break.
"""

from __future__ import annotations

# The versions this module was written and tested against (requirements.txt pins the same).
WRITTEN_FOR = {"tritonclient": "2.73.0", "grpcio": "1.85.1"}
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


def set_raw_bytes(item, raw: bytes, grpc: bool) -> None:
    """Fill a tritonclient ``InferInput`` (BYTES) with ``raw``, already serialized: the fields its
    ``set_data_from_numpy(..., binary_data=True)`` writes."""
    if grpc:
        item._raw_content = raw
        item._input.ClearField("contents")
    else:
        item._data = None
        item._raw_data = raw
        item._parameters["binary_data_size"] = len(raw)


def infer_call(client, response_deserializer):
    """``ModelInfer`` on a tritonclient gRPC client's own channel (sync or asyncio, with its message-size
    limits), taking a request already serialized; registered with the channel, as grpcio's generated stubs
    register theirs."""
    return client._channel.unary_unary(INFER_METHOD, request_serializer=None,
                                       response_deserializer=response_deserializer, _registered_method=True)
