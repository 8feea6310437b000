"""Batch scoring's input: partitions planned over the files (byte ranges of plain TSV, whole .gz files, Parquet row
groups, whole CSV files read in streamed batches), read in chunks of rows, each line checked.

Inputs are Criteo TSV (plain or .gz, label optional) or Parquet with the Criteo column names; for another
dataset (``ScoreSettings.dataset``, a spec), CSV or TSV files with a header row, or Parquet, with the spec's
column names.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from clients.inputs import from_frame
from clients.progress import INPUT_BYTES
from clients.wire import WireStrings
from ensemble import schema
from ensemble.data import criteo
from ensemble.dataset import DatasetSpec
from ensemble import native



def _features(spec: DatasetSpec) -> tuple[str, ...]:
    return (*spec.continuous, *spec.categorical)


def _is_criteo(spec: DatasetSpec) -> bool:
    return spec.name == schema.CRITEO.name


class BadInput(ValueError):
    """An input that cannot be scored as given: which file, which line (1-based), why."""

    def __init__(self, path: str, line: int | None, reason: str):
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")

    def __reduce__(self):  # raised in Dask workers: must survive pickling
        return type(self), (self.path, self.line, self.reason)


@dataclass
class LineReport:
    """Malformed lines skipped by a run with ``skip_bad_lines`` (count and the first few)."""

    skipped: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, error: BadInput) -> None:
        self.skipped += 1
        if len(self.examples) < 3:
            self.examples.append(str(error))


@dataclass(frozen=True)
class Partition:
    """A piece of one input file: a byte range of plain TSV, a whole .gz, or Parquet row groups."""

    path: str
    kind: str  # "tsv" or "parquet"
    start: int = 0  # byte offset, or first row group
    stop: int = -1  # byte end (exclusive), or row group end; -1 = to the end
    index: int = 0

    @property
    def name(self) -> str:
        return f"{Path(self.path).name}[{self.start}:{self.stop}]"


def _is_parquet(path: str) -> bool:
    return path.endswith((".parquet", ".pq"))


def plan_partitions(paths: list[str], partition_bytes: int = 64 << 20,
                    spec: DatasetSpec = schema.CRITEO) -> list[Partition]:
    """Cut the inputs into partitions, in input order."""
    parts: list[Partition] = []
    for path in map(str, paths):
        if not Path(path).is_file():
            raise BadInput(path, None, "no such file")
        if not _is_criteo(spec) and not _is_parquet(path):
            parts.append(Partition(path, "csv"))  # a header row names the columns
        elif _is_parquet(path):
            import pyarrow.parquet as pq

            groups = pq.ParquetFile(path).num_row_groups
            parts += [Partition(path, "parquet", g, g + 1) for g in range(groups)]
        elif path.endswith(".gz"):
            parts.append(Partition(path, "tsv"))
        else:
            size = Path(path).stat().st_size
            parts += [Partition(path, "tsv", s, min(s + partition_bytes, size))
                      for s in range(0, max(size, 1), partition_bytes)]
    return [Partition(p.path, p.kind, p.start, p.stop, i) for i, p in enumerate(parts)]


def tsv_layout(path: str) -> tuple[bool, bool]:
    """(has a label column, first line is a header) of a Criteo TSV file.

    A header is a first line whose fields are the Criteo column names (``label, I1..I13,
    C1..C26``, or without ``label``), in any case. Raises :class:`BadInput` for an empty file
    or a first line that is not a Criteo line.
    """
    stat = Path(path).stat()
    return _tsv_layout(path, stat.st_mtime_ns, stat.st_size)

@lru_cache(maxsize=256)
def _tsv_layout(path: str, _mtime_ns: int, _size: int) -> tuple[bool, bool]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        first = handle.readline()
        while first and not first.strip():
            first = handle.readline()
    if not first:
        raise BadInput(path, None, "empty file: no lines to score")
    fields = first.decode(errors="replace").rstrip("\r\n").split("\t")
    names = [f.strip().lower() for f in fields]
    for with_label in (True, False):
        if names == [c.lower() for c in criteo.criteo_columns(with_label)]:
            return with_label, True
    if len(fields) not in (39, 40):
        raise BadInput(path, 1, f"{len(fields)} tab-separated fields; a Criteo line has 40 (39 without label)")
    return len(fields) == 40, False


def _tsv_has_label(path: str) -> bool:
    return tsv_layout(path)[0]


def read_partition(part: Partition, chunk_rows: int, report: LineReport | None = None,
                   spec: DatasetSpec = schema.CRITEO) -> Iterator[pd.DataFrame]:
    """Frames of at most ``chunk_rows`` rows, in file order; each frame's ``attrs["input_bytes"]``
    says how many input bytes it was read from (for the progress bar).

    TSV lines are checked: a wrong field count, or a label or integer feature that is not a
    number, raises :class:`BadInput` with the file and line number or, when ``report`` is given,
    is skipped and counted there. A header line is skipped.
    """
    if part.kind == "csv":
        yield from _read_csv(part, chunk_rows, spec)
        return
    if part.kind == "parquet":
        import pyarrow.parquet as pq

        from clients.progress import partition_bytes

        parquet = pq.ParquetFile(part.path)
        rows = sum(parquet.metadata.row_group(g).num_rows for g in range(part.start, part.stop))
        share = partition_bytes(part)
        for batch in parquet.iter_batches(batch_size=chunk_rows, row_groups=range(part.start, part.stop)):
            frame = batch.to_pandas()
            frame.attrs[INPUT_BYTES] = share * len(frame) // max(rows, 1)
            yield frame
        return
    yield from _read_tsv(part, chunk_rows, report, wire=False)


@dataclass
class Chunk:
    """A chunk of rows ready to send: ``frame`` has the pass-through columns (label, ids; the
    feature columns too when pandas parsed it) and ``attrs["input_bytes"]``; ``dense`` and
    ``categorical`` are the request tensors."""

    frame: pd.DataFrame
    dense: np.ndarray
    categorical: np.ndarray | WireStrings


def read_chunks(part: Partition, chunk_rows: int, report: LineReport | None = None,
                spec: DatasetSpec = schema.CRITEO) -> Iterator[Chunk]:
    """:func:`read_partition`'s chunks with their request tensors. Criteo TSV lines go from bytes
    to the tensors in C (:func:`ensemble.native.tsv_to_wire`: no DataFrame of features, no
    bytes object per value); a block with a line outside that parser's grammar, and every other
    input kind, is parsed as :func:`read_partition` does."""
    frames = _read_tsv(part, chunk_rows, report, wire=True) if part.kind == "tsv" else \
        read_partition(part, chunk_rows, report, spec)
    for item in frames:
        yield item if isinstance(item, Chunk) else Chunk(item, *from_frame(item, spec))


def _wire_chunk(lines: list[bytes], with_label: bool, input_bytes: int) -> Chunk | None:
    parsed = native.tsv_to_wire(b"".join(lines), len(lines), with_label, schema.N_DENSE, schema.N_CATEGORICAL)
    if parsed is None:
        return None
    labels, dense, wire, row_ends = parsed
    frame = pd.DataFrame({schema.LABEL: labels} if with_label else {}, index=pd.RangeIndex(len(lines)))
    frame.attrs[INPUT_BYTES] = input_bytes
    return Chunk(frame, dense, WireStrings(wire, row_ends, schema.N_CATEGORICAL))


def _read_tsv(part: Partition, chunk_rows: int, report: LineReport | None, wire: bool
              ) -> Iterator[pd.DataFrame | Chunk]:
    with_label, header = tsv_layout(part.path)
    fields = len(criteo.criteo_columns(with_label))
    position = max(part.start, 0)
    for block in _line_blocks(part.path, part.start, part.stop, chunk_rows, skip_header=header):
        read, position = block.end - position, block.end
        if wire and (chunk := _wire_chunk(block.lines, with_label, read)) is not None:
            yield chunk
            continue
        block.drop({i: f"{n} tab-separated fields, expected {fields}" for i, line in enumerate(block.lines)
                    if (n := line.count(b"\t") + 1) != fields}, report)
        if not block.lines:
            continue
        try:
            yield _with_bytes(criteo.parse_criteo(io.BytesIO(b"".join(block.lines)), with_label=with_label,
                                                  compression=None), read)
            continue
        except ValueError:
            problems = {i: why for i, line in enumerate(block.lines) if (why := _numeric_problem(line, with_label))}
            if not problems:
                raise
        block.drop(problems, report)
        if block.lines:
            yield _with_bytes(criteo.parse_criteo(io.BytesIO(b"".join(block.lines)), with_label=with_label,
                                                  compression=None), read)


def _open_csv(source, path: str, spec: DatasetSpec, block_size: int = 1 << 20):
    """A streaming reader of a CSV/TSV file with a header row (TSV by the ``.tsv``/``.txt``
    suffix): the spec's continuous columns as float32 (empty = missing), its categorical columns as
    strings (empty = missing); other columns as pyarrow infers them."""
    import pyarrow as pa
    from pyarrow import csv

    types = {**{c: pa.float32() for c in spec.continuous}, **{c: pa.string() for c in spec.categorical}}
    delimiter = "\t" if path.endswith((".tsv", ".txt", ".tsv.gz", ".txt.gz")) else ","
    return csv.open_csv(source, read_options=csv.ReadOptions(block_size=block_size),
                        parse_options=csv.ParseOptions(delimiter=delimiter),
                        convert_options=csv.ConvertOptions(column_types=types))


def _read_csv(part: Partition, chunk_rows: int, spec: DatasetSpec) -> Iterator[pd.DataFrame]:
    with open(part.path, "rb") as source:
        reader = _open_csv(source, part.path, spec, max(1 << 20, chunk_rows * 256))
        position = 0
        for batch in reader:
            frame = batch.to_pandas()
            read, position = source.tell() - position, source.tell()  # bytes consumed: the progress bar's
            for start in range(0, len(frame), chunk_rows):
                chunk = frame.iloc[start:start + chunk_rows].reset_index(drop=True)
                chunk.attrs[INPUT_BYTES] = read * len(chunk) // max(len(frame), 1)
                yield chunk


def _with_bytes(frame: pd.DataFrame, input_bytes: int) -> pd.DataFrame:
    frame.attrs[INPUT_BYTES] = input_bytes
    return frame


def _numeric_problem(line: bytes, with_label: bool) -> str | None:
    """Why a Criteo line's label or integer features do not parse, or None."""
    values = line.rstrip(b"\r\n").split(b"\t")
    names = criteo.criteo_columns(with_label)
    if with_label:
        try:
            int(values[0])
        except ValueError:
            return f"label {values[0][:40]!r} is not an integer"
    first = 1 if with_label else 0
    for name, value in zip(names[first:first + schema.N_DENSE], values[first:first + schema.N_DENSE]):
        if value.strip():
            try:
                float(value)
            except ValueError:
                return f"{name} {value[:40]!r} is not a number"
    return None


@dataclass
class _Lines:
    """A block of non-blank lines and where each sits in its partition (blank lines counted)."""

    path: str
    first_line_offset: int  # byte offset of the partition's first line in the (uncompressed) file
    lines: list[bytes]
    index: list[int]  # line index within the partition, per line
    end: int = 0  # read position in the file on disk after the block (compressed bytes for .gz)

    def line_number(self, i: int) -> int:
        """1-based line number in the file (counts the lines before the partition: error path only)."""
        before = 0
        if self.first_line_offset:
            with open(self.path, "rb") as handle:
                remaining = self.first_line_offset
                while remaining > 0:
                    chunk = handle.read(min(remaining, 1 << 24))
                    if not chunk:
                        break
                    before += chunk.count(b"\n")
                    remaining -= len(chunk)
        return before + self.index[i] + 1

    def drop(self, problems: dict[int, str], report: LineReport | None) -> None:
        if not problems:
            return
        listed = sorted(problems.items())[:1 if report is None else None]
        errors = [BadInput(self.path, self.line_number(i), why) for i, why in listed]
        if report is None:
            raise errors[0]
        for error in errors:
            report.add(error)
        keep = [i for i in range(len(self.lines)) if i not in problems]
        self.lines, self.index = [self.lines[i] for i in keep], [self.index[i] for i in keep]


def _line_blocks(path: str, start: int, stop: int, lines_per_block: int, skip_header: bool = False) -> Iterator[_Lines]:
    """Lines that *start* inside [start, stop) (stop < 0: to the end; .gz files whole), grouped;
    each line belongs to one range. ``skip_header`` drops the file's first non-blank line."""
    import gzip

    compressed = path.endswith(".gz")
    with (gzip.open(path, "rb") if compressed else open(path, "rb")) as handle:
        if start > 0 and not compressed:
            handle.seek(start - 1)
            if handle.read(1) != b"\n":
                handle.readline()  # the line in progress belongs to the previous range
        first_offset = 0 if compressed else handle.tell()
        on_disk = handle.fileobj if compressed else handle  # where the bytes read so far are counted
        header_pending = skip_header and first_offset == 0
        block, index, n = [], [], 0
        while compressed or stop < 0 or handle.tell() < stop:
            line = handle.readline()
            if not line:
                break
            if line.strip():
                if header_pending:
                    header_pending = False
                else:
                    block.append(line if line.endswith(b"\n") else line + b"\n")
                    index.append(n)
            n += 1
            if len(block) >= lines_per_block:
                yield _Lines(path, first_offset, block, index, on_disk.tell())
                block, index = [], []
        if block:
            yield _Lines(path, first_offset, block, index, on_disk.tell())
