"""The online store's keys and its row format (one entity's latest features as one Redis value).

Keys, one dataset spec per prefix ``ensemble:<spec name>``: ``<prefix>:meta`` (JSON: per side its key
column, the key's index among its categorical values, how many continuous and categorical values a row
holds) and ``<prefix>:context:<id>`` / ``<prefix>:candidate:<id>`` (:func:`encode_row`).
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np

from ensemble import native

CONTEXT, CANDIDATE = "context", "candidate"
_HEAD = struct.Struct("<dHH")  # freshness, continuous values, categorical values
_LENGTH = struct.Struct("<I")


def prefix(dataset: str) -> str:
    return f"ensemble:{dataset}"


def entity_key(dataset: str, side: str, entity_id: bytes | str) -> bytes:
    ident = entity_id.encode() if isinstance(entity_id, str) else bytes(entity_id)
    return f"{prefix(dataset)}:{side}:".encode() + ident


def meta_key(dataset: str) -> str:
    return f"{prefix(dataset)}:meta"


def encode_row(freshness: float, dense, categorical) -> bytes:
    """One entity's stored value: freshness, float32 continuous values, length-prefixed bytes values."""
    dense = np.ascontiguousarray(dense, np.float32).reshape(-1)
    parts = [_HEAD.pack(float(freshness), dense.size, len(categorical)), dense.tobytes()]
    for value in categorical:
        value = bytes(value)
        parts += [_LENGTH.pack(len(value)), value]
    return b"".join(parts)


def decode_row(value: bytes) -> tuple[float, np.ndarray, tuple[bytes, ...]]:
    """(freshness, float32 continuous values, categorical values) of a stored value; ValueError when
    it is not one."""
    try:
        freshness, n_dense, n_cat = _HEAD.unpack_from(value, 0)
        at = _HEAD.size + 4 * n_dense
        dense = np.frombuffer(value, np.float32, n_dense, _HEAD.size)
        cats = []
        for _ in range(n_cat):
            (length,) = _LENGTH.unpack_from(value, at)
            at += _LENGTH.size
            if at + length > len(value):
                raise ValueError("truncated")
            cats.append(value[at:at + length])
            at += length
    except (struct.error, ValueError) as exc:
        raise ValueError(f"not a stored feature row ({exc})") from None
    if at != len(value):
        raise ValueError("not a stored feature row (trailing bytes)")
    return freshness, dense, tuple(cats)



@dataclass(frozen=True)
class Side:
    """One side's stored rows, from the meta record."""

    key: str
    key_index: int
    dense: int
    categorical: int

    def default(self, entity_id: bytes) -> tuple[np.ndarray, tuple[bytes, ...]]:
        """An unknown entity's row: every continuous value missing (NaN), every categorical value
        missing (empty) but its key, as an inline request for a new user or item would carry."""
        cats = [b""] * self.categorical
        cats[self.key_index] = entity_id
        return np.full(self.dense, np.nan, np.float32), tuple(cats)

    def default_value(self, entity_id: bytes) -> bytes:
        """:meth:`default` as a stored value, fresh forever."""
        return encode_row(math.inf, *self.default(entity_id))

    @functools.cached_property
    def head(self) -> np.dtype:
        """A stored value's fixed part (freshness, widths, continuous values) as a numpy record."""
        return np.dtype([("t", "<f8"), ("nd", "<u2"), ("nc", "<u2"), ("d", "<f4", (self.dense,))])

    def split(self, value: bytes) -> tuple[bytes, bytes]:
        """A stored value's fixed part (freshness, widths, continuous values) and its categorical part
        (Triton's BYTES wire format)."""
        fixed = self.head.itemsize
        return value[:fixed], value[fixed:]

    def check(self, heads: bytes, cats: bytes, n: int) -> None:
        """Refuse (ValueError) ``n`` stored values from the store, given as :meth:`decode` takes them,
        that are not rows of this side's widths; done once per value, when it comes from the store."""
        try:
            records = np.frombuffer(heads, self.head)
        except ValueError:
            raise ValueError("the store holds a malformed feature row") from None
        if len(records) != n or (records["nd"] != self.dense).any() or (records["nc"] != self.categorical).any():
            raise ValueError("the store holds a feature row of other widths than its meta record says")
        if self.categorical and len(native.split_wire(cats)) != n * self.categorical:
            raise ValueError("the store holds a malformed feature row")

    def row(self, value: bytes) -> tuple[float, np.ndarray, np.ndarray]:
        """One stored value from the store, checked and decoded: (freshness, continuous, categorical)."""
        head, cats = self.split(value)
        self.check(head, cats, 1)
        freshness, dense, values = self.decode(head, cats, 1)
        return float(freshness[0]), dense[0], values[0]

    def decode(self, heads: bytes, cats: bytes, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(freshness [n], continuous [n x dense] float32, categorical [n x categorical] bytes) of ``n``
        checked stored values (:meth:`check`) given as their fixed parts joined and their categorical
        parts joined: the first read as one record array, the second split in C."""
        records = np.frombuffer(heads, self.head)
        values = native.split_wire(cats) if self.categorical else []
        out = np.empty(n * self.categorical, object)
        out[:] = values
        return records["t"], records["d"].reshape(n, self.dense), out.reshape(n, self.categorical)

