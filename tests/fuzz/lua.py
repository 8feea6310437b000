"""Property-based fuzzing of the gateway's Lua parsers (``ensemble/fleet/lua``) against independent
readings of the same bytes (``tests/fuzz/lua_oracles.py``), in LuaJIT through lupa.

Four properties, one per parser of client bytes:

- ``grpc``: ``pin_version.lua`` reading a ModelInfer frame (varints, fields, groups, the parameters
  map, the arm key's InferParameter) and appending the release. On every frame protobuf parses, the
  Lua reads the same name, version and key; when the Lua pins, the rewritten frame parses exactly
  when the original does, and then equals it with ``model_version`` set to the release.
- ``depth``: ``client_error.lua``'s JSON extent (Inference-Header-Content-Length) and depth walker.
  It reads at least the bytes Triton parses (C's atoi of the header), refuses whenever Python's
  parser goes deeper than the limit before its first error, and on JSON that parses refuses exactly
  the values deeper than the limit.
- ``string``: the JSON string decoder: the same text and end as Python's ``json`` scanner, and
  unreadable exactly when Python's is.
- ``key``: the arm key walker (``json_parameter``): on JSON Python parses, the same value of
  ``parameters[key]`` (the last member of a name counting) and the same refusal of other kinds.

Hypothesis writes the inputs: protobuf fields in any order, duplicated, unknown, grouped, in
over-long varints; JSON in any spacing and escaping with duplicate and look-alike member names;
bracket soups; then byte edits. An example is checked on each input derived from it (every
truncation of a gRPC message, several spellings of one JSON document), so inputs outnumber examples.

    .venv/bin/python -m tests.fuzz.lua --seconds 600          # each parser for 600 s; prints the counts
    .venv/bin/python -m tests.fuzz.lua --seconds 60 --parsers grpc key
    .venv/bin/python -m tests.fuzz.lua --seconds 30 --coverage   # and the Lua lines the run reached

``tests/unit/test_gateway_lua_fuzz.py`` runs each property for a bounded number of examples in
``make test``.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz import lua_oracles as oracles
from tests.fuzz.lua_runtime import GatewayLua

COVERAGE = Path(__file__).with_name("coverage.lua")
STORAGE = Path(__file__).resolve().parents[2] / "build" / "hypothesis"

WANTED = b"user"  # the arm key asked for; parameters of that name are drawn often
SMALL_DEPTH = 4  # the depth limit the fuzzer runs the walker with (the served one is 64), so both sides are met
COUNTS: Counter = Counter()  # inputs checked, per parser


# --- protobuf wire, written by hand so that any encoding can be drawn -----------------------------------------------


def varint(n: int, width: int = 0) -> bytes:
    """``n`` (below 2^70) as a varint of at least ``width`` bytes (a non-minimal encoding past its own)."""
    out = bytearray()
    while True:
        out.append(n & 0x7F)
        n >>= 7
        if not n and len(out) >= width:
            break
    return bytes(b | 0x80 for b in out[:-1]) + bytes(out[-1:])


def tag(number: int, wire: int, width: int = 0) -> bytes:
    return varint(number << 3 | wire, width)


def delimited(number: int, payload: bytes, width: int = 0) -> bytes:
    return tag(number, 2, width) + varint(len(payload), width) + payload


widths = st.sampled_from([0] * 6 + [2, 5, 10])
utf8_text = st.text(max_size=6).map(str.encode)
some_bytes = st.one_of(utf8_text, st.binary(max_size=6))


@st.composite
def varint_values(draw) -> int:
    """A varint's value: small, near 2^53 and 2^63, any 64 bits, or past 64 bits (protobuf drops those)."""
    return draw(st.one_of(st.integers(0, 300), st.integers(2**53 - 3, 2**53 + 3), st.integers(0, 2**64 - 1),
                          st.integers(2**63 - 2, 2**63 + 2), st.integers(0, 2**70 - 1)))


@st.composite
def infer_parameter(draw) -> bytes:
    """An InferParameter's bytes: one member of its oneof or several (the last counts), any kind."""
    def member() -> bytes:
        kind = draw(st.sampled_from(["bool", "int64", "string", "double", "uint64", "unknown", "wrong wire"]))
        w = draw(widths)
        if kind == "bool":
            return tag(1, 0, w) + varint(draw(st.integers(0, 2)), w)
        if kind in ("int64", "uint64"):
            return tag(2 if kind == "int64" else 5, 0, w) + varint(draw(varint_values()), w)
        if kind == "string":
            return delimited(3, draw(st.one_of(utf8_text, st.sampled_from([b"", b"7", b"\xff"]))), w)
        if kind == "double":
            return tag(4, 1, w) + struct.pack("<d", draw(st.floats(allow_nan=False)))
        if kind == "unknown":
            return tag(draw(st.integers(6, 40)), 0, w) + varint(draw(st.integers(0, 9)))
        return delimited(draw(st.sampled_from([1, 2, 5])), b"x", w)  # a known number, the wrong wire type
    return b"".join(member() for _ in range(draw(st.integers(0, 3))))


@st.composite
def parameter_entry(draw) -> bytes:
    """One entry of the parameters map (field 4): a key and a value, in either order, either missing
    or given twice (a value given twice is merged)."""
    key = draw(st.one_of(st.just(WANTED), st.sampled_from([b"other", b"User", b"user ", b""]), utf8_text))
    parts = [delimited(1, key, draw(widths)), delimited(2, draw(infer_parameter()), draw(widths))]
    parts += draw(st.lists(st.sampled_from(parts), max_size=2))
    if draw(st.booleans()):
        parts.append(tag(draw(st.integers(3, 9)), 0) + varint(1))
    return delimited(4, b"".join(draw(st.permutations(parts))), draw(widths))


@st.composite
def unknown_field(draw, depth: int = 0) -> bytes:
    """A field a ModelInferRequest does not have: any wire type, a group (with a wrong end now and
    then), or a known number with the wrong wire type."""
    number = draw(st.one_of(st.integers(8, 40), st.integers(2**28, 2**29 - 1), st.sampled_from([1, 2, 4])))
    wire = draw(st.sampled_from([0, 1, 2, 5, 3]))
    if wire == 0:
        return tag(number, 0) + varint(draw(varint_values()))
    if wire in (1, 5):
        return tag(number, wire) + draw(st.binary(min_size=8 if wire == 1 else 4, max_size=8 if wire == 1 else 4))
    if wire == 2:
        return delimited(number, draw(st.binary(max_size=8)))
    inner = b"".join(draw(unknown_field(depth + 1)) for _ in range(draw(st.integers(0, 2 if depth < 2 else 0))))
    end = number if draw(st.integers(0, 9)) else draw(st.integers(1, 40))
    return tag(number, 3) + inner + tag(end, 4)


@st.composite
def request_field(draw) -> bytes:
    """One top-level field of a ModelInferRequest, as a client could write it."""
    from tritonclient.grpc import service_pb2

    kind = draw(st.sampled_from(["name"] * 3 + ["version"] * 2 + ["id", "parameter", "parameter", "input", "output",
                                                                  "raw", "unknown"]))
    w = draw(widths)
    if kind == "name":
        return delimited(1, draw(st.one_of(st.sampled_from([b"ranker"] * 4 + [b"rank", b"", b"rankers"]), some_bytes)), w)
    if kind == "version":
        return delimited(2, draw(st.one_of(st.sampled_from([b"", b"", b"3", b"12"]), some_bytes)), w)
    if kind == "id":
        return delimited(3, draw(utf8_text), w)
    if kind == "parameter":
        return draw(parameter_entry())
    if kind == "input":
        tensor = service_pb2.ModelInferRequest.InferInputTensor(
            name=draw(st.text(max_size=4)), datatype=draw(st.sampled_from(["FP32", "BYTES"])),
            shape=draw(st.lists(st.integers(-1, 2**40), max_size=3)))
        return delimited(5, tensor.SerializeToString(), w)
    if kind == "output":
        return delimited(6, service_pb2.ModelInferRequest.InferRequestedOutputTensor(
            name=draw(st.text(max_size=4))).SerializeToString(), w)
    if kind == "raw":
        return delimited(7, draw(st.binary(max_size=24)), w)
    return draw(unknown_field())


def frame(message: bytes, flag: int = 0, length: int | None = None) -> bytes:
    return bytes([flag]) + (len(message) if length is None else length).to_bytes(4, "big") + message


@st.composite
def grpc_cases(draw) -> tuple[list[bytes], bytes | None, bytes]:
    """(frames, the key wanted, the release): a message of drawn fields, byte edits now and then, in a
    frame that is right or not; then every truncation of the message, framed right."""
    message = b"".join(draw(st.lists(request_field(), max_size=10)))
    if draw(st.integers(0, 3)) == 0:
        message = draw(edited(message))
    framing = draw(st.sampled_from(["right"] * 8 + ["compressed", "short", "long"]))
    first = {"right": frame(message), "compressed": frame(message, 1), "short": frame(message, 0, (len(message) - 1) % 2**32),
             "long": frame(message, 0, len(message) + 1)}[framing]
    frames = [first] + [frame(message[:cut]) for cut in range(len(message))] + [first[:cut] for cut in range(5)]
    wanted = draw(st.sampled_from([WANTED, WANTED, None]))
    release = draw(st.sampled_from([b"1", b"7", b"12", b"9007199254740993", b"7" * 130]))  # a long one: a 2-byte length
    return frames, wanted, release


@st.composite
def edited(draw, data: bytes) -> bytes:
    """``data`` with a few bytes flipped, inserted or removed."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(out)))
        op = draw(st.sampled_from(["set", "insert", "delete"]))
        byte = draw(st.integers(0, 255))
        if op == "insert" or not out:
            out.insert(at, byte)
        elif op == "set":
            out[min(at, len(out) - 1)] = byte
        else:
            del out[min(at, len(out) - 1)]
    return bytes(out)


def check_grpc(lua: GatewayLua, case: tuple[list[bytes], bytes | None, bytes]) -> None:
    frames, wanted, release = case
    ranker = lua.settings["ranker"].encode()
    for data in frames:
        COUNTS["grpc"] += 1
        name, named, value, bad = lua.pin.read_request(data, wanted)
        expected = oracles.grpc_reading(data, wanted)
        if expected is not None:
            got = oracles.GrpcReading(name, named, value, bool(bad))
            assert got == expected, f"the Lua read {got}, protobuf {expected}, of {data!r} (key {wanted!r})"
        if name == ranker and not named and not (wanted is not None and bad):
            pinned = lua.pin.with_version(data, release)
            original, rewritten = oracles.parse_request(data), oracles.parse_request(pinned)
            assert (original is None) == (rewritten is None), f"pinning {data!r} gave {pinned!r}"
            if original is not None:
                assert rewritten.model_version == release.decode(), (data, pinned)
                rewritten.model_version = original.model_version
                assert rewritten == original, f"pinning changed more than the version: {data!r} -> {pinned!r}"


# --- JSON, written by hand so that any spacing, escaping and member order can be drawn ------------------------------


class Obj(list):
    """A JSON object as its members in order (a name may come twice)."""


NAMES = ["parameters", "inputs", "id", "user", "outputs", 'a"parameters', "parameters\\", "param", "user ", "Parameters"]
leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64), st.sampled_from([2**53 - 1, 2**53, 0]),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=4))


def _tree(children):
    return st.one_of(st.lists(children, max_size=4), st.lists(st.tuples(names, children), max_size=4).map(Obj))


json_trees = st.recursive(leaves, _tree, max_leaves=10)


@st.composite
def requests(draw):
    """A v2 request's JSON as a tree: members in any order, "parameters" (an object holding the key,
    or not, or something else) once, twice or not at all."""
    key_value = draw(st.one_of(st.text(max_size=6), st.integers(-2, 2**54), leaves, json_trees))
    parameters = Obj(draw(st.lists(st.tuples(names, leaves), max_size=3)))
    if draw(st.integers(0, 4)):
        parameters.insert(draw(st.integers(0, len(parameters))), ("user", key_value))
    members = draw(st.lists(st.tuples(names, json_trees), max_size=4))
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
        members.insert(draw(st.integers(0, len(members))),
                       ("parameters", parameters if draw(st.integers(0, 5)) else draw(json_trees)))
    return Obj(members) if draw(st.integers(0, 9)) else draw(json_trees)


SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "/": "\\/"}


def write_string(text: str, rng: random.Random, escapes: float) -> str:
    out = []
    for c in text:
        if c in '"\\' or ord(c) < 32 or rng.random() < escapes:
            if c in SHORT and rng.random() < 0.5:
                out.append(SHORT[c])
            elif ord(c) > 0xFFFF:
                high, low = divmod(ord(c) - 0x10000, 0x400)
                out.append(_u(0xD800 + high, rng) + _u(0xDC00 + low, rng))
            else:
                out.append(_u(ord(c), rng))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _u(code: int, rng: random.Random) -> str:
    text = f"\\u{code:04x}"
    return text.upper().replace("\\U", "\\u") if rng.random() < 0.3 else text


def write_json(tree, rng: random.Random, escapes: float) -> str:
    """``tree`` as JSON text, with random whitespace and escapes."""
    def space() -> str:
        return "".join(rng.choice(" \t\n\r") for _ in range(rng.choice([0, 0, 0, 1, 2])))

    def write(item) -> str:
        if isinstance(item, Obj):
            body = ",".join(space() + write_string(k, rng, escapes) + space() + ":" + space() + write(v) + space()
                            for k, v in item)
            return "{" + (body or space()) + "}"
        if isinstance(item, list):
            return "[" + (",".join(space() + write(v) + space() for v in item) or space()) + "]"
        if isinstance(item, str):
            return write_string(item, rng, escapes)
        if item is None or isinstance(item, bool):
            return {None: "null", True: "true", False: "false"}[item]
        return repr(item) if isinstance(item, float) else str(item)

    return space() + write(tree) + space()


@st.composite
def key_cases(draw) -> tuple[list[bytes], bytes]:
    """(texts, the key wanted): one request written 16 ways (spacing, escapes), and with byte edits."""
    tree = draw(requests())
    rng = random.Random(draw(st.integers(0, 2**32)))
    texts = [write_json(tree, rng, escapes).encode() for escapes in (0.0, 0.0, 0.0, 0.02, 0.1, 0.5) * 3][:16]
    texts += [draw(edited(texts[0])), draw(edited(texts[-1]))]
    return texts, WANTED


def check_key(lua: GatewayLua, case: tuple[list[bytes], bytes]) -> None:
    texts, wanted = case
    for text in texts:
        COUNTS["key"] += 1
        got = lua.http.json_parameter(text, wanted)
        value, bad = (got[0], bool(got[1])) if isinstance(got, tuple) else (got, False)
        expected = oracles.json_key(text, wanted.decode())
        if expected is None:
            continue  # not JSON: Triton refuses it, whatever the gateway read
        assert bad == expected.bad, f"the Lua read ({value!r}, {bad}), Python {expected}, of {text!r}"
        if expected.text_known:
            assert value == expected.value, f"the Lua read {value!r}, Python {expected}, of {text!r}"
        else:
            assert value is not None, (text, expected)


@st.composite
def depth_cases(draw) -> list[tuple[bytes, bytes | None]]:
    """(body, Inference-Header-Content-Length or None): bracket soups and written JSON, edited now
    and then, with a drawn header; then every truncation of the body, without one."""
    kind = draw(st.sampled_from(["soup", "json", "json"]))
    if kind == "soup":
        body = b"".join(draw(st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"1", b" ",
                                                       b'"a"', b"[[[", b"\x00", b"\xff"]), max_size=40)))
    else:
        body = write_json(draw(json_trees), random.Random(draw(st.integers(0, 2**32))), 0.1).encode()
    if draw(st.integers(0, 3)) == 0:
        body = draw(edited(body))
    n = len(body)
    header = draw(st.one_of(
        st.none(), st.none(),
        st.integers(-2, n + 2).map(lambda v: str(v).encode()),
        st.tuples(st.sampled_from([b"", b" ", b"\t", b"+", b"-", b"0", b" +"]), st.integers(0, n + 2),
                  st.sampled_from([b"", b"e-1", b"e1", b".5", b"x", b" ", b"0", b",3"]))
        .map(lambda t: t[0] + str(t[1]).encode() + t[2]),
        st.sampled_from([b"", b"0x10", b"inf", b"nan", b"4294967297", b"99999999999999999999", b"1e400"]),
        st.binary(max_size=6).filter(lambda b: b"\x00" not in b)))
    return [(body, header)] + [(body[:cut], None) for cut in range(len(body))]


def check_depth(lua: GatewayLua, cases: list[tuple[bytes, bytes | None]]) -> None:
    for body, header in cases:
        COUNTS["depth"] += 1
        _check_depth(lua, body, header)


def _check_depth(lua: GatewayLua, body: bytes, header: bytes | None) -> None:
    limit = lua.settings["max_json_depth"]
    length = lua.http.json_length(len(body), header)
    refused = lua.http.too_deep(body[:length])
    parsed = oracles.triton_json_length(len(body), header)
    if parsed is not None:
        assert length >= parsed, f"the Lua reads {length} bytes as JSON, Triton {parsed} (header {header!r})"
        reached, _ = oracles.depth_reached(body[:parsed])
        assert refused or reached <= limit, f"Triton's parser goes {reached} deep into {body[:parsed]!r}"
    reached, valid = oracles.depth_reached(body[:length])
    if valid:
        assert refused == (reached > limit), f"JSON {reached} deep, refused: {refused}: {body[:length]!r}"


ESCAPE_PIECES = [b'\\"', b"\\\\", b"\\/", b"\\b", b"\\f", b"\\n", b"\\r", b"\\t", b"\\u", b"\\x", b"\\", b'"',
                 b"\\ud83d\\ude00", b"\\uD800", b"\\udc00", b"\\uDBFF\\uDFFF", b"\\ud800\\u0041", b"\\u00e9", b"\\u0000"]


@st.composite
def string_cases(draw) -> list[bytes]:
    """What follows a JSON string's opening quote (text, escapes good and bad, raw bytes, quotes),
    and every truncation of it."""
    pieces = st.one_of(utf8_text, st.binary(max_size=3), st.sampled_from(ESCAPE_PIECES),
                       st.integers(0, 0xFFFF).map(lambda c: b"\\u%04x" % c),
                       st.text(alphabet="0123456789abcdefABCDEFg", max_size=4).map(lambda t: b"\\u" + t.encode()))
    content = b"".join(draw(st.lists(pieces, max_size=8)))
    return [content[:cut] for cut in range(len(content) + 1)]


def check_string(lua: GatewayLua, contents: list[bytes]) -> None:
    for content in contents:
        COUNTS["string"] += 1
        _check_string(lua, content)


def _check_string(lua: GatewayLua, content: bytes) -> None:
    data = b'"' + content
    got = lua.http.json_string(data, 1)
    expected = oracles.json_string(content)
    if expected is None:
        assert got is None, f"the Lua read {got!r} of {data!r}, which Python's json does not"
        return
    text, end = expected
    assert isinstance(got, tuple) and got[1] == end + 1, f"the Lua read {got!r}, Python {expected!r}, of {data!r}"
    if text is not None:
        assert got[0] == text, f"the Lua read {got!r}, Python {expected!r}, of {data!r}"
    assert lua.http.string_end(data, 1) == end, data  # the skipping walkers close it where it closes


PARSERS: dict[str, tuple[st.SearchStrategy, Callable]] = {
    "grpc": (grpc_cases(), check_grpc),
    "depth": (depth_cases(), check_depth),
    "string": (string_cases(), check_string),
    "key": (key_cases(), check_key),
}


def property_test(parser: str, lua: GatewayLua, examples: int) -> Callable[[], None]:
    """The hypothesis test of ``parser`` over ``examples`` examples (a failure is shrunk and raised).
    Hypothesis keeps its caches in build/hypothesis, not in the working directory."""
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(STORAGE)
    strategy, check = PARSERS[parser]

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def test(case) -> None:
        check(lua, case)

    return test


def runtime() -> GatewayLua:
    """The Lua as served, but with the depth limit small enough for drawn inputs to cross it."""
    return GatewayLua(max_json_depth=SMALL_DEPTH)


def run(parser: str, seconds: float, lua: GatewayLua | None = None, batch: int = 2000) -> tuple[int, int, float]:
    """``parser``'s property for about ``seconds``: (examples, inputs, seconds taken)."""
    lua = lua or runtime()
    started, examples, before = time.monotonic(), 0, COUNTS[parser]
    while time.monotonic() - started < seconds:
        property_test(parser, lua, batch)()
        examples += batch
    return examples, COUNTS[parser] - before, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run each parser (default: 60)")
    parser.add_argument("--parsers", nargs="+", choices=list(PARSERS), default=list(PARSERS))
    parser.add_argument("--coverage", action="store_true",
                        help="count the Lua lines the run reaches (a line hook: several times slower)")
    args = parser.parse_args(argv)
    lua = runtime()
    coverage = lua.runtime.execute(COVERAGE.read_bytes()) if args.coverage else None
    if coverage is not None:
        coverage.start()
    print(f"gateway Lua fuzzing (LuaJIT via lupa, hypothesis), {args.seconds:g} s a parser:", flush=True)
    for name in args.parsers:
        examples, inputs, took = run(name, args.seconds, lua)
        print(f"  ok    {name:7} {examples:>11,} examples  {inputs:>13,} inputs  {took:7.1f} s  "
              f"{inputs / took:>9,.0f} inputs/s", flush=True)
    if coverage is not None:
        coverage.stop()
        print("Lua lines run (of the lines holding code):")
        for row in coverage.report(lua.runtime.table_from([lua.arm, lua.pin, lua.http])).values():
            source, total, ran, missed = row[1], row[2], row[3], list(row[4].values())
            print(f"  {source.decode().lstrip('@'):17} {ran:>4} of {total:<4} not run: "
                  f"{', '.join(map(str, missed)) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
