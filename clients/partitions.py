"""Batch scoring, one partition at a time: plan partitions, read and check lines, score chunks
through Triton or in-process, write outputs (the runs over all partitions: :mod:`clients.scoring`).

Inputs are Criteo TSV (plain or .gz, label optional) or Parquet with the Criteo column names; for
another dataset (``ScoreSettings.dataset``, a spec), CSV or TSV files with a header row, or Parquet,
with the spec's column names. They are cut into partitions (byte ranges of plain TSV, whole .gz
files, Parquet row groups, whole CSV files read in streamed batches),
read in chunks of ``batch_size`` rows, scored with several requests in flight, and written in
input order next to the passed-through columns (label, ids). Output is written aside and
renamed at the end: a run that fails leaves no file that looks complete.
"""

from __future__ import annotations

import io
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from clients.inputs import from_frame
from clients.progress import INPUT_BYTES
from clients.triton import Protocol, RankerClient, Retry, ScoringError
from clients.wire import WireStrings
from ensemble import schema
from ensemble.data import criteo
from ensemble.dataset import DatasetSpec
from ensemble import native

FEATURE_COLUMNS = (*schema.DENSE_COLUMNS, *schema.CATEGORICAL_COLUMNS)


def _features(spec: DatasetSpec) -> tuple[str, ...]:
    return (*spec.continuous, *spec.categorical)


def _is_criteo(spec: DatasetSpec) -> bool:
    return spec.name == schema.CRITEO.name
SCORE_COLUMNS = tuple(t.name for t in schema.RANKER_OUTPUTS)


class ChunkFailed(RuntimeError):
    """A chunk that kept failing: which file, which rows, why."""

    def __init__(self, path: str, first_row: int, stop_row: int, cause: BaseException):
        self.path, self.first_row, self.stop_row = path, first_row, stop_row
        super().__init__(f"{path}: rows {first_row}..{stop_row - 1} of this partition failed: {cause}")


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


@dataclass(frozen=True)
class ScoreSettings:
    """Where and how to score.

    Attributes:
        urls: Triton endpoints (partitions go round-robin across them); empty with ``local``.
        protocol: http or grpc (a scheme in a URL wins).
        local: score in-process from ``repository`` instead of a server.
        batch_size: rows per request.
        concurrency: requests in flight per process.
        all_scores: also write the per-model scores.
        retry, timeout: transient-failure policy per request.
        skip_bad_lines: skip malformed TSV lines and count them (default: stop at the first,
            naming its file and line).
    """

    urls: tuple[str, ...] = ()
    protocol: str = "http"
    local: bool = False
    repository: str = "model_repository"
    batch_size: int = 4096
    concurrency: int = 4
    all_scores: bool = False
    retry: Retry = field(default_factory=Retry)
    timeout: float = 120.0
    skip_bad_lines: bool = False
    dataset: DatasetSpec = schema.CRITEO  # the inputs' columns (Criteo's TSV/Parquet unless set)

    def scorer(self, partition_index: int = 0) -> Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]:
        if self.local:
            pipeline = local_pipeline(str(Path(self.repository).resolve()))

            def score_local(dense: np.ndarray, cats) -> dict[str, np.ndarray]:
                if isinstance(cats, WireStrings):  # from the wire buffer, as the native backend scores
                    return pipeline.score_wire(dense, cats.data, len(cats))
                return {k: v.reshape(-1) for k, v in pipeline.score(dense, cats).items()}

            return score_local
        if not self.urls:
            raise ValueError("give --url (one or more) or --local")
        url = self.urls[partition_index % len(self.urls)]
        local_clients = threading.local()  # tritonclient's HTTP client is not shared across threads

        def score(dense: np.ndarray, cats: np.ndarray) -> dict[str, np.ndarray]:
            client = getattr(local_clients, "client", None)
            if client is None:
                client = local_clients.client = RankerClient(url, Protocol(self.protocol) if "://" not in url
                                                             else None, timeout=self.timeout, retry=self.retry,
                                                             priority=schema.Priority.BATCH)
            return client.score(dense, cats, all_scores=True)

        return score


@lru_cache(maxsize=2)
def local_pipeline(repository: str):
    """The in-process pipeline of ``--local`` (loaded once per process and repository), warmed
    up on one row, its chain in C built: the frameworks' start-up lines come now, not through the
    progress bar."""
    import os

    from ensemble.base.console import native_info_quieted

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # read when TensorFlow is imported (if it is)
    from ensemble.scoring.pipeline import Pipeline

    with native_info_quieted():
        pipeline = Pipeline.from_repository(repository)
        widths = pipeline.widths
        pipeline.score(np.zeros((1, widths.dense), np.float32), np.full((1, widths.categorical), b"", object))
        pipeline.native_chain  # noqa: B018 - built and checked now (Criteo TSV is scored through it)
    return pipeline


def score_chunks(part: Partition, settings: ScoreSettings, on_rows: Callable[[int], None] = lambda n: None,
                 report: LineReport | None = None) -> Iterator[pd.DataFrame]:
    """Scored frames of one partition, in order, with ``concurrency`` chunks in flight; with
    ``settings.skip_bad_lines``, malformed lines are counted in ``report``."""
    if settings.skip_bad_lines and report is None:
        report = LineReport()
    score = settings.scorer(part.index)
    features = set(_features(settings.dataset))
    pending: deque[tuple[Future, pd.DataFrame, int]] = deque()
    first_row = 0

    def finish(item: tuple[Future, pd.DataFrame, int]) -> pd.DataFrame:
        future, frame, start = item
        try:
            scores = future.result()
        except ScoringError as exc:
            raise ChunkFailed(part.path, start + exc.start, start + exc.stop, exc) from exc
        except Exception as exc:  # noqa: BLE001 - reported with its rows
            raise ChunkFailed(part.path, start, start + len(frame), exc) from exc
        out = frame[[c for c in frame.columns if c not in features]].reset_index(drop=True)
        for name in SCORE_COLUMNS if settings.all_scores else (schema.SCORE.name,):
            out[name] = scores[name]
        out.attrs[INPUT_BYTES] = frame.attrs.get(INPUT_BYTES, 0)
        on_rows(len(out))
        return out

    with ThreadPoolExecutor(max(1, settings.concurrency)) as pool:
        try:
            for chunk in read_chunks(part, settings.batch_size, report if settings.skip_bad_lines else None,
                                     settings.dataset):
                pending.append((pool.submit(score, chunk.dense, chunk.categorical), chunk.frame, first_row))
                first_row += len(chunk.frame)
                while len(pending) >= max(1, settings.concurrency):
                    yield finish(pending.popleft())
            while pending:
                yield finish(pending.popleft())
        finally:
            for future, _, _ in pending:
                future.cancel()


def output_schema(parts: list[Partition], all_scores: bool, spec: DatasetSpec = schema.CRITEO):
    """The output's columns: every input's pass-through columns (label, ids; first type seen
    wins), then the scores. A column an input lacks is null in that input's rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields: dict[str, object] = {}
    features = set(_features(spec))
    for part in {p.path: p for p in parts}.values():
        path = part.path
        if part.kind == "csv":
            with open(path, "rb") as source:
                columns = _open_csv(source, path, spec).schema
            for item in columns:
                if item.name not in features:
                    fields.setdefault(item.name, item.type)
        elif _is_parquet(path):
            for item in pq.ParquetFile(path).schema_arrow:
                if item.name not in features:
                    fields.setdefault(item.name, item.type)
        elif _tsv_has_label(path):
            fields.setdefault(schema.LABEL, pa.int8())
    for name in SCORE_COLUMNS if all_scores else (schema.SCORE.name,):
        fields[name] = pa.float32()
    return pa.schema(list(fields.items()))


class OutputWriter:
    """Parquet (default) or CSV by suffix, written to ``<path>.partial`` and renamed by ``commit``."""

    def __init__(self, path: str | Path, arrow_schema):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.schema = arrow_schema
        self.rows = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.unlink(missing_ok=True)
        if self.path.suffix.lower() == ".csv":
            import pyarrow.csv as pacsv

            self._writer = pacsv.CSVWriter(str(self.tmp), arrow_schema)
        else:
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(str(self.tmp), arrow_schema)

    def write(self, frame: pd.DataFrame) -> None:
        import pyarrow as pa

        columns = [pa.array(frame[f.name], type=f.type, from_pandas=True) if f.name in frame.columns
                   else pa.nulls(len(frame), f.type) for f in self.schema]
        self._writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))
        self.rows += len(frame)

    def commit(self) -> Path:
        self._close()
        self.tmp.replace(self.path)
        return self.path

    def abort(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclass
class Summary:
    """What a run did; ``auc``/``logloss`` only when the input had labels."""

    rows: int = 0
    seconds: float = 0.0
    auc: float | None = None
    logloss: float | None = None
    output: str = ""
    parts: int = 0
    lines: LineReport = field(default_factory=LineReport)
    load_seconds: float = 0.0  # --local: loading the models, before the scoring clock starts
    _labels: list = field(default_factory=list, repr=False)
    _scores: list = field(default_factory=list, repr=False)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def observe(self, frame: pd.DataFrame, label: str = schema.LABEL) -> None:
        if label in frame.columns:
            known = frame[label].notna().to_numpy()
            self._labels.append(frame[label].to_numpy()[known].astype(np.int8))
            self._scores.append(frame[schema.SCORE.name].to_numpy(np.float32)[known])

    def finish(self, seconds: float) -> "Summary":
        from ensemble.models import metrics

        self.seconds = seconds
        if self._labels:
            labels, scores = np.concatenate(self._labels), np.concatenate(self._scores)
            self.auc, self.logloss = metrics.auc(labels, scores), metrics.log_loss(labels, scores)
        self._labels, self._scores = [], []
        return self

    def line(self) -> str:
        text = f"{self.rows} rows in {self.seconds:.1f}s ({self.rows_per_second:,.0f} rows/s) -> {self.output}"
        if self.load_seconds:
            text += f" (after {self.load_seconds:.1f}s loading the models)"
        if self.auc is not None:
            text += f"; AUC {self.auc:.4f}, log loss {self.logloss:.4f}"
        if self.lines.skipped:
            text += f"; {self.lines.skipped} malformed line(s) skipped, e.g. " + " | ".join(self.lines.examples)
        return text
