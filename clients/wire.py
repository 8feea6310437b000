"""Faster BYTES tensor serialization for tritonclient (the categorical input).

tritonclient serializes a BYTES tensor element by element in Python (~30 ms for a 4096 x 26
request on the build machine), which is most of the client's CPU in batch scoring. This
builds the same wire format (per element: 4-byte little-endian length, then the bytes) in C
(:func:`ensemble.native.join_wire`, a Python loop when the extension was not built) and hands it to
tritonclient through :mod:`clients.adapter`, which owns the private fields that takes; a unit test
compares the bytes with tritonclient's own serializer.
"""

from __future__ import annotations

import numpy as np

from clients.adapter import set_raw_bytes
from ensemble.native import join_wire, split_wire


class WireStrings:
    """A [rows x columns] BYTES tensor already in Triton's wire format (what batch scoring's C
    parser makes from TSV lines): sent as it is, sliced by rows without re-encoding.

    Attributes:
        data: the serialized values, row-major.
        row_ends: int64 [rows], each row's end offset in ``data``.
        columns: values per row.
    """

    def __init__(self, data: bytes, row_ends: np.ndarray, columns: int):
        self.data, self.row_ends, self.columns = data, np.asarray(row_ends, np.int64), columns

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.row_ends), self.columns

    def __len__(self) -> int:
        return len(self.row_ends)

    def __getitem__(self, rows: slice) -> "WireStrings":
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("WireStrings takes a contiguous slice of rows")
        start, stop, _ = rows.indices(len(self))
        stop = max(start, stop)
        if start == 0 and stop == len(self):
            return self
        first = int(self.row_ends[start - 1]) if start else 0
        last = int(self.row_ends[stop - 1]) if stop > start else first
        return WireStrings(self.data[first:last], self.row_ends[start:stop] - first, self.columns)

    def to_objects(self) -> np.ndarray:
        """The values as a [rows x columns] object array of bytes (for a JSON request)."""
        values = np.empty(len(self) * self.columns, dtype=object)
        values[:] = split_wire(self.data)
        return values.reshape(len(self), self.columns)


def serialize_bytes(array: np.ndarray) -> bytes:
    """Object array of ``bytes`` -> Triton's serialized BYTES tensor (row-major)."""
    return join_wire(np.asarray(array, dtype=object).ravel().tolist())


def set_bytes_input(item, array, grpc: bool) -> None:
    """Fill a tritonclient ``InferInput`` (BYTES, binary) from an object array of bytes or
    :class:`WireStrings`."""
    set_raw_bytes(item, array.data if isinstance(array, WireStrings) else serialize_bytes(array), grpc)
