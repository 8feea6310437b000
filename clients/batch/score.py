"""Batch scoring of one partition: its chunks scored through Triton or in process with several requests in
flight, and the outputs written in input order beside the passed-through columns (label, ids), aside and renamed
at the end, so a run that fails leaves no file that looks complete (the runs over all partitions:
:mod:`clients.batch`)."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from clients.progress import INPUT_BYTES
from clients.triton import Protocol, RankerClient, Retry, ScoringError
from clients.wire import WireStrings
from ensemble import schema
from ensemble.dataset import DatasetSpec

from clients.batch.input import LineReport, Partition, _features, _is_parquet, _open_csv, _tsv_has_label, read_chunks


SCORE_COLUMNS = tuple(t.name for t in schema.RANKER_OUTPUTS)


class ChunkFailed(RuntimeError):
    """A chunk that kept failing: which file, which rows, why."""

    def __init__(self, path: str, first_row: int, stop_row: int, cause: BaseException):
        self.path, self.first_row, self.stop_row = path, first_row, stop_row
        super().__init__(f"{path}: rows {first_row}..{stop_row - 1} of this partition failed: {cause}")


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

    from ensemble.base.console import framework_info_quieted

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # read when TensorFlow is imported (if it is)
    from ensemble.scoring.pipeline import Pipeline

    with framework_info_quieted():
        pipeline = Pipeline.from_repository(repository)
        widths = pipeline.widths
        pipeline.score(np.zeros((1, widths.dense), np.float32), np.full((1, widths.categorical), b"", object))
        pipeline.c_chain  # noqa: B018 - built and checked now (Criteo TSV is scored through it)
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
