"""The request path's per-string loops: C when ``ensemble.native._request`` was built (``pip install``
compiles it), Python otherwise. Both produce the same objects; tests compare them.

- :func:`split_wire`: Triton's BYTES wire format (per element a uint32 little-endian length,
  then the bytes) -> list of bytes. The python backend's own loop formats a struct string per
  element (1.2 ms for the 2,600 strings of a 100-row request here), a plain Python loop 0.45 ms.
- :func:`join_wire`: the reverse, for the clients (tritonclient's own loop is per element too).
- :func:`gather`: the online store's cache hit: every key's pair of stored parts from a dict, each part
  joined in key order, or None when a key is absent (ensemble/online/).
- :func:`lookup`: row-major values -> int64 ids, one dict per column (the categorical encoding).
- :class:`Vocabulary`: the same dicts as hash tables in C, looked up straight from Triton's BYTES wire
  buffer (no bytes object per value; the Python form splits the buffer and calls :func:`lookup`).
- :func:`dense_prepare` and :func:`blend`: a request's elementwise arithmetic (the continuous
  features before their logarithm; the blender's weighted logits) in one pass each.
- :func:`tsv_to_wire`: a batch-scoring client's parse of Criteo-shaped TSV lines straight into the
  request's arrays and BYTES wire buffer (C only: without the extension the client parses with
  pandas, as it does for any line outside this parser's narrow grammar).
"""

from __future__ import annotations

import struct
import zlib
from itertools import cycle, repeat
from typing import Sequence

import numpy as np

try:
    from ensemble.native import _request
except ImportError:  # built without a C compiler: the Python loops below
    _request = None

COMPILED = _request is not None

_LENGTH = struct.Struct("<I")


def _split_wire_py(buffer) -> list[bytes]:
    data = bytes(buffer)
    values: list[bytes] = []
    append, offset, end, unpack = values.append, 0, len(data), _LENGTH.unpack_from
    while offset < end:
        if end - offset < 4:
            raise ValueError(f"BYTES tensor truncated at byte {offset} of {end}")
        (length,) = unpack(data, offset)
        offset += 4
        if length > end - offset:
            raise ValueError(f"BYTES tensor truncated at byte {offset - 4} of {end}")
        append(data[offset:offset + length])
        offset += length
    return values


def _join_wire_py(values: list[bytes]) -> bytes:
    pack = _LENGTH.pack
    parts = []
    for i, value in enumerate(values):
        if not isinstance(value, bytes):
            raise TypeError(f"element {i} is {type(value).__name__}, not bytes")
        parts += (pack(len(value)), value)
    return b"".join(parts)


def _lookup_py(values: list, tables: tuple[dict, ...], default: int, out: np.ndarray) -> None:
    out[:] = np.fromiter(map(dict.get, cycle(tables), values, repeat(default)), dtype=np.int64, count=len(values))


def _dense_prepare_py(src: np.ndarray, out: np.ndarray, fill: float, clip_min: float) -> None:
    np.copyto(out, src)
    out[~np.isfinite(out)] = fill
    np.maximum(out, np.float32(clip_min), out=out)
    np.add(out, np.float32(1), out=out)


def _blend_py(scores: tuple, weights: tuple, bias: float, eps: float, out: np.ndarray) -> None:
    p = np.clip(np.stack([np.asarray(s, np.float64).reshape(-1) for s in scores], axis=1), eps, 1 - eps)
    z = (np.log(p) - np.log1p(-p)) @ np.asarray(weights, np.float64) + bias
    out[:] = 1.0 / (1.0 + np.exp(-z))


class _VocabularyPy:
    def __init__(self, tables: tuple[dict, ...], buckets: tuple[int, ...] = ()):
        self.tables = tables
        self.buckets = buckets

    def lookup_wire(self, buffer, default: int, out: np.ndarray) -> None:
        values = _split_wire_py(buffer)
        if len(values) != len(out):
            raise ValueError(f"{len(values)} values in the BYTES tensor, {len(out)} expected")
        _lookup_py(values, self.tables, default, out)
        for j, buckets in enumerate(self.buckets):
            if buckets:
                out[j::len(self.tables)] = hash_ids(values[j::len(self.tables)], buckets)


def _value_bytes(value) -> bytes:
    """A categorical value as the bytes a hashed column hashes: bytes as they are, text as UTF-8,
    missing (None, NaN, empty) as ``b""``."""
    if isinstance(value, bytes):
        return value
    if value is None or value != value:
        return b""
    return str(value).encode()


def hash_ids(values, buckets: int) -> np.ndarray:
    """A hashed column's ids, from the hash alone: ``crc32(value) % buckets`` (zlib's CRC-32) of each
    value (:func:`_value_bytes`), int64 [len(values)]; missing values share the empty value's row."""
    crc = zlib.crc32
    return np.fromiter((crc(_value_bytes(v)) % buckets for v in values), dtype=np.int64, count=len(values))


def _gather_py(table: dict, keys: list) -> tuple[bytes, bytes] | None:
    pairs = list(map(table.get, keys))
    if None in pairs:
        return None
    if not pairs:
        return b"", b""
    heads, tails = zip(*pairs)
    return b"".join(heads), b"".join(tails)


split_wire = _request.split_wire if COMPILED else _split_wire_py
join_wire = _request.join_wire if COMPILED else _join_wire_py
gather = _request.gather if COMPILED else _gather_py
_lookup = _request.lookup if COMPILED else _lookup_py
_dense_prepare = _request.dense_prepare if COMPILED else _dense_prepare_py
_blend = _request.blend if COMPILED else _blend_py
Vocabulary = _request.Vocabulary if COMPILED else _VocabularyPy
CompactVocabulary = _request.CompactVocabulary if COMPILED else None  # C only: its users check COMPILED


def tsv_to_wire(blob: bytes, rows: int, with_label: bool, n_dense: int, n_categorical: int):
    """Lines of ``with_label`` + ``n_dense`` integer + ``n_categorical`` string tab-separated fields,
    each ending in a newline -> ``(labels int8 [rows] or None, dense float32 [rows x n_dense],
    wire bytes, row_ends int64 [rows])``: what ``parse_criteo`` and the BYTES serialization give
    for the same lines. None when a line is outside the parser's grammar (see ``_request.c``) or the
    extension was not built: the caller then parses the general way."""
    if not COMPILED:
        return None
    labels = np.empty(rows, np.int8) if with_label else None
    dense = np.empty((rows, n_dense), np.float32)
    row_ends = np.empty(rows, np.int64)
    wire = _request.tsv_to_wire(blob, rows, with_label, n_dense, n_categorical, labels, dense, row_ends)
    return None if wire is None else (labels, dense, wire, row_ends)


def lookup(values: list, tables: Sequence[dict], default: int) -> np.ndarray:
    """``out[i] = tables[i % len(tables)].get(values[i], default)`` as int64."""
    out = np.empty(len(values), dtype=np.int64)
    _lookup(values, tuple(tables), int(default), out)
    return out


def dense_prepare(dense: np.ndarray, fill: float, clip_min: float) -> np.ndarray:
    """float32 copy of ``dense`` with non-finite values set to ``fill``, clipped below at
    ``clip_min``, plus one (the continuous transform before its logarithm)."""
    src = np.ascontiguousarray(dense, dtype=np.float32)
    out = np.empty_like(src)
    _dense_prepare(src, out, float(fill), float(clip_min))
    return out


def blend(scores: Sequence[np.ndarray], weights: Sequence[float], bias: float, eps: float) -> np.ndarray:
    """``sigmoid(bias + sum_m weights[m] * logit(clip(scores[m], eps, 1 - eps)))`` in float64, as
    [B] float32; ``scores``: M arrays of B probabilities each."""
    arrays = tuple(np.ascontiguousarray(s, dtype=np.float32) for s in scores)
    out = np.empty(arrays[0].size, dtype=np.float32)
    blend_into(arrays, tuple(float(w) for w in weights), float(bias), float(eps), out)
    return out


def blend_into(scores: tuple, weights: tuple, bias: float, eps: float, out: np.ndarray) -> None:
    """:func:`blend` into ``out`` (B float32), for C-contiguous float32 ``scores`` and float
    ``weights`` as they are."""
    _blend(scores, weights, bias, eps, out)
