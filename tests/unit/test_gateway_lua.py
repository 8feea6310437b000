"""The gateway's Lua filters (``ensemble/fleet/lua``), function by function, in LuaJIT (lupa): each
file loads by itself, the generated source runs, every parser agrees with a Python reading of the
same bytes on chosen cases, and the two filters answer requests through a stand-in for Envoy's handle
(``tests/fuzz/envoy_handle.lua``). ``test_gateway_lua_fuzz.py`` runs the parsers on drawn inputs;
the filters run in real Envoy in the integration tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ensemble.fleet import arms as fleet_arms
from ensemble.fleet import envoy_config as ec
from ensemble.fleet import lua_filters
from tests.fuzz.lua_runtime import GatewayLua


@pytest.fixture(scope="module")
def lua() -> GatewayLua:
    return GatewayLua()


def _frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def _grpc_request(model: str = "ranker", version: str = "", parameters: dict | None = None, rows: int = 2) -> bytes:
    """The frame tritonclient's gRPC client sends for ``rows`` ranker rows."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc._utils import _get_inference_request

    dense = grpcclient.InferInput("dense", [rows, 13], "FP32")
    dense.set_data_from_numpy(np.zeros((rows, 13), np.float32))
    categorical = grpcclient.InferInput("categorical", [rows, 26], "BYTES")
    categorical.set_data_from_numpy(np.full((rows, 26), b"68fd1e64", object))
    request = _get_inference_request(model, [dense, categorical], version, "", None, 0, False, False, 0, None, parameters)
    return _frame(request.SerializeToString())


def _parse(frame: bytes):
    from tritonclient.grpc import service_pb2

    assert int.from_bytes(frame[1:5], "big") == len(frame) - 5
    return service_pb2.ModelInferRequest.FromString(frame[5:])


# --- the files and the generated source ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arm", "pin_version", "client_error"])
def test_each_file_is_lua_by_itself(lua, name):
    compiled = lua.runtime.eval("loadstring")(lua_filters.source(name).encode(), name.encode())
    assert not isinstance(compiled, tuple), compiled  # (nil, error) when it does not compile


@pytest.mark.parametrize("which", list(ec.LuaFilter))
def test_the_generated_source_runs_and_defines_envoys_entry_points(which):
    import lupa.luajit21 as lupa

    runtime = lupa.LuaRuntime(encoding=None)
    runtime.execute(ec.lua_source(which).encode())
    entry = runtime.globals()
    assert entry.envoy_on_request is not None
    assert (entry.envoy_on_response is not None) == (which is ec.LuaFilter.CLIENT_ERROR)


def test_config_values_are_quoted_as_lua_literals(lua):
    tricky = ['plain', 'a "quoted" \\ back', "new\nline\0nul", "]]--[[", "é ✓ \U0001f600", "%s %d"]
    for text in tricky:
        assert lua.runtime.execute(f"return {lua_filters.literal(text)}".encode()) == text.encode()
    assert lua.runtime.execute(b"return " + lua_filters.literal(2**53 - 1).encode()) == 2**53 - 1
    with pytest.raises(TypeError):
        lua_filters.literal(True)
    with pytest.raises(ValueError, match="Lua names"):
        lua_filters.config_table({"not a name": 1})
    assert lua.config.ranker == b"ranker" and lua.config.max_json_depth == ec.MAX_JSON_DEPTH


def test_the_files_run_with_no_global_of_their_own(lua):
    """The loader gives each file an environment that refuses a global it did not find and any global
    write (tests/fuzz/strict.lua): every test here and the fuzzer would fail on one."""
    loadstring = lua.runtime.eval("loadstring")
    with pytest.raises(Exception, match="undeclared global 'nope'"):
        lua.strict(loadstring(b"return nope"))()
    with pytest.raises(Exception, match="assignment to global 'leak'"):
        lua.strict(loadstring(b"leak = 1"))()


# --- arm.lua ---------------------------------------------------------------------------------------------------


def test_the_arm_point_is_pythons(lua):
    rng = np.random.default_rng(5)
    values = [b"", b"user-1", "é".encode(), bytes(range(256))] + [rng.bytes(int(n)) for n in rng.integers(1, 40, 300)]
    for value in values:
        assert lua.arm.point_of(value, 3) == fleet_arms.arm_point(value), value
        assert lua.arm.point_of(value, 5) == fleet_arms.arm_point(value, 5), value


def test_the_arm_is_pythons(lua):
    arms = ((4, 10.0), (5, 5.5))
    text = ";".join(f"{r}:{upto}" for r, upto in fleet_arms.arm_bounds(3, arms)[:-1])
    for value in [f"user-{i}".encode() for i in range(500)]:
        assert int(lua.arm.choose(text.encode(), lua.arm.point_of(value, 3), b"3")) == fleet_arms.arm_of(value, 3, arms)


# --- pin_version.lua: the gRPC reader and rewriter -------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**31, 2**53 - 1, 2**53, 2**63, 2**64 - 1])
def test_varints_read_as_protobuf_reads_them(lua, value):
    from google.protobuf.internal.encoder import _VarintBytes

    data = _VarintBytes(value)
    got, after = lua.pin.varint(b"x" + data + b"y", 2)
    assert after == len(data) + 2
    assert got == (value if value < 2**53 else 2**53)  # anything larger only needs to be known as large
    if value < 2**53:
        assert lua.pin.encode(value) == data


def test_varints_past_64_bits_and_unterminated_ones(lua):
    five_past_64 = bytes([0x85] + [0x80] * 8 + [0x02])  # 5 + 2^64: protobuf keeps the low 64 bits
    assert lua.pin.varint(five_past_64, 1) == (5, 11)
    assert lua.pin.varint(bytes([0x80] * 10 + [0x01]), 1) is None  # 11 bytes: not a varint
    assert lua.pin.varint(b"\x80\x80", 1) is None
    assert lua.pin.varint(b"", 1) is None


def test_fields_of_every_wire_type(lua):
    field = lua.pin.field
    assert field(b"\x08\x96\x01", 1, 3, 0) == (1, 0, 150, 4)
    assert field(b"\x12\x03abc", 1, 5, 0) == (2, 2, 3, 6)
    assert field(b"\x19" + bytes(8), 1, 9, 0) == (3, 1, 2, 10)
    assert field(b"\x25" + bytes(4), 1, 5, 0) == (4, 5, 2, 6)
    group = b"\x2b\x08\x01\x33\x34\x2c"  # field 5 group holding field 1 and an empty group 6
    assert field(group, 1, len(group), 0) == (5, 3, 2, len(group) + 1)
    assert field(b"\x2b\x08\x01\x34", 1, 4, 0) is None  # ends group 6, not 5
    assert field(b"\x12\x05abc", 1, 5, 0) is None  # length past the end
    assert field(b"\x02\x00", 1, 2, 0) is None  # field 0
    assert field(b"\x0e", 1, 1, 0) is None  # wire type 6
    nested = b"\x0b" * 100 + b"\x0c" * 100
    assert field(nested, 1, 200, 0) == (1, 3, 2, 201)  # protobuf's depth limit
    assert field(b"\x0b" * 101 + b"\x0c" * 101, 1, 202, 0) is None


def test_a_client_request_reads_as_protobuf_reads_it(lua):
    assert lua.pin.read_request(_grpc_request(), None) == (b"ranker", False, None, False)
    assert lua.pin.read_request(_grpc_request(version="3"), None) == (b"ranker", True, None, False)
    assert lua.pin.read_request(_grpc_request("rank"), None)[0] == b"rank"
    for parameter, expected in [("user-7", (b"user-7", False)), (42, (b"42", False)), (2**53 - 1, (b"9007199254740991", False)),
                                (2**53, (None, True)), (-1, (None, True)), (True, (None, True)), (0.5, (None, True))]:
        frame = _grpc_request(parameters={"user": parameter, "other": "x"})
        assert lua.pin.read_request(frame, b"user")[2:] == expected, parameter
    assert lua.pin.read_request(_grpc_request(parameters={"other": "x"}), b"user")[2:] == (None, False)


def test_unreadable_frames_pass_unchanged(lua):
    frame = _grpc_request()
    nothing = (None, False, None, False)
    assert lua.pin.read_request(b"\x01" + frame[1:], None) == nothing  # compressed
    assert lua.pin.read_request(frame[:-1], None) == nothing  # shorter than its prefix says
    assert lua.pin.read_request(_frame(frame[5:-1]), None) == nothing  # the message cut
    assert lua.pin.read_request(b"", None) == nothing


def test_the_last_of_a_field_counts_as_in_protobuf(lua):
    message = _parse(_grpc_request(version="3"))
    twice = message.SerializeToString() + b"\x12\x00" + b'"\x0e\n\x04user\x12\x06\x1a\x04late'
    assert lua.pin.read_request(_frame(twice), b"user") == (b"ranker", False, b"late", False)
    assert _parse(_frame(twice)).model_version == ""


def test_pinning_appends_the_version_and_nothing_else(lua):
    frame = _grpc_request()
    pinned = lua.pin.with_version(frame, b"12")
    assert _parse(pinned).model_version == "12"
    rest = _parse(pinned)
    rest.model_version = ""
    assert rest == _parse(frame)


# --- client_error.lua: depth, strings, the key parameter -------------------------------------------------------


def test_json_deeper_than_the_limit_is_refused_and_no_shallower(lua):
    limit = ec.MAX_JSON_DEPTH
    assert not lua.http.too_deep(b"[" * limit + b"]" * limit)
    assert lua.http.too_deep(b"[" * (limit + 1))
    assert lua.http.too_deep(b'{"a":' * (limit + 1))
    assert not lua.http.too_deep(b'["' + b"[" * 200 + b'"]')  # inside a string
    assert not lua.http.too_deep(b'["\\"' + b"[" * 200 + b'"]')  # an escaped quote does not end it
    assert not lua.http.too_deep(b"[]" * 1000)  # many, none deep
    assert not lua.http.too_deep(b"[" * limit + b'"x' + b"]" * 5 + b"[[")  # an unterminated string: a parser stops


@pytest.mark.parametrize("header, length", [
    (None, 100), (b"40", 40), (b"  40", 40), (b"+40", 40), (b"40abc", 40), (b"0", 100), (b"-5", 100), (b"", 100),
    (b"100", 100), (b"1000", 100), (b"0x10", 100),
    (b"150000e-5", 100),  # C's atoi reads 150000 (past the body: all of it), not Lua's 1.5
    (b"60e-1", 60),  # atoi: 60, not 6
    (b"4294967336", 100),  # atoi would wrap it to 40 on glibc: reading all of it covers that
])
def test_the_json_part_is_read_as_triton_reads_the_header(lua, header, length):
    assert lua.http.json_length(100, header) == length


def test_json_strings_decode_as_pythons(lua):
    cases = [b'"plain"', b'"a\\"b\\\\c\\/d\\b\\f\\n\\r\\t"', b'"\\u00e9\\u20AC"', b'"\\ud83d\\ude00"', b'"\\ud800x"',
             b'"\\udc00"', b'"raw \xff bytes"', b'"\\u0000"']
    for case in cases:
        text, after = lua.http.json_string(case, 1)
        assert after == len(case) + 1
        expected = json.decoder.scanstring(case.decode("latin-1"), 1, False)[0]
        if b"\xff" in case:
            assert text == expected.encode("latin-1")
        else:
            assert text == expected.encode("utf-8", "surrogatepass"), case
    for bad in [b'"open', b'"\\x"', b'"\\u12"', b'"\\u12g4"', b'"\\']:
        assert lua.http.json_string(bad, 1) is None, bad


def test_every_code_point_is_written_as_utf8(lua):
    utf8_char = lua.http.utf8_char
    for code in range(0x110000):
        assert utf8_char(code) == chr(code).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("text, expected", [
    ({"inputs": [], "parameters": {"user": "u-1"}}, (b"u-1", False)),
    ({"parameters": {"user": "u-1"}, "inputs": [{"parameters": {"user": "inner"}}]}, (b"u-1", False)),
    ({"inputs": [{"parameters": {"user": "inner"}}]}, None),
    ({"parameters": {"user": 12}}, (b"12", False)),
    ({"parameters": {"user": -1}}, (None, True)),
    ({"parameters": {"user": 1.5}}, (None, True)),
    ({"parameters": {"user": None}}, (None, True)),
    ({"parameters": {"user": ["u"]}}, (None, True)),
    ({"parameters": {"other": "x"}}, (None, False)),
    ({"parameters": "user"}, None),
    ('{"parameters": {"user": "first"}, "parameters": {"user": "last"}}', (b"last", False)),
    ('{"parameters": {"user": "a", "user": 7}}', (b"7", False)),
    ('{"param\\u0065ters": {"\\u0075ser": "escaped"}}', (b"escaped", False)),
    ('{"inputs": [], "a\\"parameters": {"user": "not the top level"}}', None),
    ('{"parameters": {"user": "\\ud83d\\ude00 \\u00e9"}}', ("\U0001f600 é".encode(), False)),
    ('{"parameters": {"user": -0}}', (b"0", False)),
])
def test_the_key_parameter_is_the_one_python_reads(lua, text, expected):
    body = (text if isinstance(text, str) else json.dumps(text)).encode()
    assert lua.http.json_parameter(body, b"user") == expected


def test_a_tritonclient_request_gives_its_key(lua):
    from tritonclient.http._utils import _get_inference_request
    import tritonclient.http as httpclient

    dense = httpclient.InferInput("dense", [1, 13], "FP32")
    dense.set_data_from_numpy(np.zeros((1, 13), np.float32), binary_data=True)
    body, head = _get_inference_request([dense], "", None, 0, False, False, 0, None, {"user": "u-9"})
    assert lua.http.json_parameter(body[:head] if head else body, b"user") == (b"u-9", False)


def test_a_500_for_the_clients_json_is_recognized(lua):
    assert lua.http.client_error(b'{"error":"failed to parse the request JSON buffer: ..."}')
    assert lua.http.client_error(b"{\"error\":\"Unable to parse 'timeout'\"}")
    assert not lua.http.client_error(b'{"error":"Stub process is not healthy"}')


# --- the filters, end to end, through a stand-in for Envoy's handle ---------------------------------------------


def _headers(handle) -> dict[bytes, list[bytes]]:
    """The stand-in handle's headers now: name -> values in order."""
    found: dict[bytes, list[bytes]] = {}
    for entry in handle.headers_map.entries.values():
        found.setdefault(entry[1], []).append(entry[2])
    return found


def test_the_grpc_filter_pins_an_unversioned_ranker_request(lua):
    frame = _grpc_request()
    handle = lua.handle([(":path", "/inference.GRPCInferenceService/ModelInfer"), ("content-length", str(len(frame)))],
                        {"release": "7"}, frame)
    lua.pin.envoy_on_request(handle)
    pinned = handle.body_buffer.bytes
    assert _parse(pinned).model_version == "7"
    assert _headers(handle)[b"content-length"] == [str(len(pinned)).encode()]
    for kept in (_grpc_request(version="3"), _grpc_request("rank"), b"\x01" + frame[1:]):
        handle = lua.handle([], {"release": "7"}, kept)
        lua.pin.envoy_on_request(handle)
        assert handle.body_buffer.bytes == kept
    handle = lua.handle([], {}, frame)  # no pin on the route: the body is not even read
    lua.pin.envoy_on_request(handle)
    assert handle.bodies_read == 0


def test_the_grpc_filter_arms_by_the_key_parameter_and_refuses_another_kind(lua):
    arms = ((4, 30.0),)
    meta = {"release": "3", "arms": "4:3000", "key": "user"}
    for user in ("u-1", "u-2", "u-3", "u-4", "u-5"):
        handle = lua.handle([("x-request-id", "id"), ("ensemble-shadow", "forged")], meta,
                            _grpc_request(parameters={"user": user}))
        lua.pin.envoy_on_request(handle)
        release = fleet_arms.arm_of(user, 3, arms)
        assert _headers(handle)[b"ensemble-release"] == [str(release).encode()]
        assert b"ensemble-shadow" not in _headers(handle)
        assert _parse(handle.body_buffer.bytes).model_version == str(release)
    handle = lua.handle([], meta, _grpc_request(parameters={"user": 0.5}))
    lua.pin.envoy_on_request(handle)
    answer = dict(handle.responded.headers.items())
    assert answer[b"grpc-status"] == b"3" and b"arm key parameter 'user'" in answer[b"grpc-message"]


def test_the_http_filter_refuses_deep_json_whatever_the_header_says(lua):
    deep = b"[" * 200
    for header in ([], [("inference-header-content-length", "200")], [("inference-header-content-length", "2000e-1")]):
        handle = lua.handle([(":method", "POST"), *header], {}, deep)
        lua.http.envoy_on_request(handle)
        assert handle.responded is not None, header
        assert dict(handle.responded.headers.items())[b":status"] == b"400"
        assert b"nested deeper than 64" in handle.responded.body
    handle = lua.handle([(":method", "POST"), ("inference-header-content-length", "4")], {}, b"[[]]" + deep)
    lua.http.envoy_on_request(handle)  # the binary part after the JSON is not JSON
    assert handle.responded is None


def test_the_http_filter_routes_by_the_key_parameter(lua):
    arms = ((4, 30.0),)
    meta = {"release": "3", "arms": "4:3000", "key": "user", "path": "/v2/models/ranker/versions/"}
    for user in ("u-1", "u-2", "u-3", "u-4", "u-5"):
        body = json.dumps({"inputs": [], "parameters": {"user": user}}).encode()
        handle = lua.handle([(":method", "POST"), (":path", "/v2/models/ranker/infer")], meta, body)
        lua.http.envoy_on_request(handle)
        release = fleet_arms.arm_of(user, 3, arms)
        assert _headers(handle)[b":path"] == [f"/v2/models/ranker/versions/{release}/infer".encode()]
        assert _headers(handle)[b"ensemble-release"] == [str(release).encode()]
    handle = lua.handle([(":method", "POST"), ("user", "u-1")], meta, b'{"parameters": {"user": 0.5}}')
    lua.http.envoy_on_request(handle)  # the header wins: the body is not read for the key
    assert handle.responded is None and _headers(handle)[b"ensemble-release"] == [str(fleet_arms.arm_of("u-1", 3, arms)).encode()]
    handle = lua.handle([(":method", "POST")], meta, b'{"parameters": {"user": 0.5}}')
    lua.http.envoy_on_request(handle)
    assert b"arm key parameter 'user'" in handle.responded.body


def test_the_http_filter_answers_tritons_500_for_bad_json_as_400(lua):
    for body, status in [(b'{"error":"failed to parse the request JSON buffer"}', b"400"),
                         (b'{"error":"Stub process is not healthy"}', b"500")]:
        handle = lua.handle([(":status", "500")], {}, body)
        lua.http.envoy_on_response(handle)
        assert _headers(handle)[b":status"] == [status]
