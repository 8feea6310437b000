"""Independent readings of the bytes the gateway's Lua reads, for the fuzzer to hold the Lua to.

Each comes from another parser of the same format, not from the Lua's own steps: protobuf (the
``ModelInferRequest`` of tritonclient's generated gRPC code, parsed by the protobuf runtime), Python's
``json`` (its C scanner), and C's ``atoi`` (libc, as Triton reads ``Inference-Header-Content-Length``).
"""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass

TWO_53 = 2**53


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# --- gRPC: the ModelInfer request ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrpcReading:
    """What a ModelInfer request says, as the gateway needs it: the model's name, whether a version
    is named, and the arm key parameter's value (None: absent or of another kind; ``bad``: another
    kind)."""

    name: bytes
    named: bool
    value: bytes | None
    bad: bool


def parse_request(frame: bytes, request_class=None):
    """The ``ModelInferRequest`` in a gRPC frame (5-byte prefix, then the message), or None when the
    frame is compressed, is not exactly one message, or protobuf cannot parse the message."""
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2

    if len(frame) < 5 or frame[0] != 0 or int.from_bytes(frame[1:5], "big") != len(frame) - 5:
        return None
    try:
        return (request_class or service_pb2.ModelInferRequest).FromString(frame[5:])
    except DecodeError:
        return None


_ENTRIES_CLASS = []


def _request_with_entries():
    """ModelInferRequest with ``parameters`` read as the list of entries it is on the wire.

    Python's protobuf (upb) leaves out of a map an entry holding an unknown field; C++ protobuf, which
    Triton's gRPC server parses with, skips the unknown field and keeps the entry. The same
    descriptors, with the entry type no longer marked a map entry, give the entries as C++ reads them
    (each a message: unknown fields skipped, a value given twice merged), in order; the last of a key
    is the map's value.
    """
    if not _ENTRIES_CLASS:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
        from tritonclient.grpc import model_config_pb2, service_pb2

        pool = descriptor_pool.DescriptorPool()
        for module in (model_config_pb2, service_pb2):
            proto = descriptor_pb2.FileDescriptorProto()
            module.DESCRIPTOR.CopyToProto(proto)
            if module is service_pb2:
                request = next(m for m in proto.message_type if m.name == "ModelInferRequest")
                next(m for m in request.nested_type if m.name == "ParametersEntry").options.map_entry = False
            pool.Add(proto)
        _ENTRIES_CLASS.append(message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelInferRequest")))
    return _ENTRIES_CLASS[0]


def grpc_reading(frame: bytes, wanted: bytes | None) -> GrpcReading | None:
    """Protobuf's reading of ``frame`` with the arm key parameter ``wanted`` (None: no key wanted);
    None when protobuf cannot read it (then Triton refuses it, whatever the gateway did)."""
    request = parse_request(frame, _request_with_entries())
    if request is None or parse_request(frame) is None:
        return None
    value, bad = None, False
    entries = [e for e in request.parameters if wanted is not None and e.key == wanted.decode()]
    if entries:
        parameter = entries[-1].value
        kind = parameter.WhichOneof("parameter_choice")
        if kind == "string_param":
            value = parameter.string_param.encode()
        elif kind in ("int64_param", "uint64_param") and 0 <= getattr(parameter, kind) < TWO_53:
            value = str(getattr(parameter, kind)).encode()
        else:
            bad = True
    return GrpcReading(request.model_name.encode(), request.model_version != "", value, bad)


# --- JSON: how deep a parser goes ----------------------------------------------------------------------------------

# a string (closed, or cut off by the end: even right after a backslash), or a bracket
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?$)|[\[\]{}]', re.S)


def value_depth(value) -> int:
    """How many arrays and objects of a parsed JSON value stand inside one another."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def depth_reached(text: bytes) -> tuple[int, bool]:
    """How deep Python's JSON parser goes into ``text`` before its first error (the whole value's
    depth when it parses), and whether it parses. A recursive parser (Triton's) goes no deeper."""
    s = text.decode("latin-1")  # byte i is character i
    try:
        return value_depth(json.loads(s, parse_constant=_reject_constant)), True
    except RecursionError:
        return 10**9, False
    except ValueError as exc:
        stop = exc.pos if isinstance(exc, json.JSONDecodeError) else len(s)
    # everything before the error reads as JSON: count its brackets outside strings
    depth = deepest = 0
    for token in _TOKENS.finditer(s, 0, stop):
        c = token.group()[0]
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest, False


_LIBC = ctypes.CDLL(None)
_LIBC.atoi.argtypes = [ctypes.c_char_p]
_LIBC.atoi.restype = ctypes.c_int


def triton_json_length(size: int, header: bytes | None) -> int | None:
    """How many bytes of a body of ``size`` Triton parses as JSON given its Inference-Header-Content-Length
    ``header`` (None: absent): C's atoi of it, when that is from 1 to the size; None when Triton parses
    none (0: a raw binary body; out of range: refused)."""
    if header is None:
        return size
    length = _LIBC.atoi(header)
    return length if 0 < length <= size else None


# --- JSON: a string's text -----------------------------------------------------------------------------------------

_LOW_LATIN_ESCAPE = re.compile(rb"\\u00[89a-fA-F][0-9a-fA-F]")


def json_string(content: bytes) -> tuple[bytes, int] | None | tuple[None, int]:
    """Python's reading of the JSON string ``"`` + ``content``: (its text's bytes, the index after its
    closing quote), None when it does not read; (None, index) when the text's bytes cannot be told
    from Python's result (raw bytes of 0x80 and up beside \\u0080-\\u00ff escapes)."""
    from json.decoder import scanstring

    data = b'"' + content
    try:
        text = data.decode("utf-8")
        utf8 = True
    except UnicodeDecodeError:
        text, utf8 = data.decode("latin-1"), False
    try:
        value, end = scanstring(text, 1, False)
    except json.JSONDecodeError:
        return None
    if utf8:
        return value.encode("utf-8", "surrogatepass"), len(text[:end].encode("utf-8"))
    if _LOW_LATIN_ESCAPE.search(data[:end]):
        return None, end
    # latin-1: characters below 256 are the raw bytes, the rest came from escapes
    return b"".join(bytes([ord(c)]) if ord(c) < 256 else c.encode("utf-8", "surrogatepass") for c in value), end


# --- JSON: the arm key parameter of a v2 request -------------------------------------------------------------------


@dataclass(frozen=True)
class KeyReading:
    """The arm key parameter Python's json reads: ``value`` (None: absent, or another kind), ``bad``
    (another kind); ``text_known`` False when the value is a string whose bytes cannot be told."""

    value: bytes | None
    bad: bool
    text_known: bool = True


def json_key(text: bytes, wanted: str) -> KeyReading | None:
    """Python's reading of a v2 request's top-level ``parameters[wanted]`` (the last member of a
    name counts, as in a dict); None when ``text`` is not JSON (Triton refuses it)."""
    try:
        s, utf8 = text.decode("utf-8"), True
    except UnicodeDecodeError:
        s, utf8 = text.decode("latin-1"), False
    try:
        document = json.loads(s, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    parameters = document.get("parameters") if isinstance(document, dict) else None
    if not isinstance(parameters, dict) or wanted not in parameters:
        return KeyReading(None, False)
    value = parameters[wanted]
    if isinstance(value, str):
        if utf8:
            return KeyReading(value.encode("utf-8", "surrogatepass"), False)
        if all(ord(c) < 128 for c in value):
            return KeyReading(value.encode(), False)
        return KeyReading(None, False, text_known=False)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < TWO_53:
        return KeyReading(str(value).encode(), False)
    return KeyReading(None, True)
