"""Feature transforms: NVTabular fits them, a lean numpy transform serves them.

NVTabular's ``Workflow`` is fitted on the training split and saved in its own format. Its
``transform`` costs ~55 ms per call on CPU whatever the row count and crashes when a
categorical column is null in every row of a call, so serving uses :class:`LeanTransform`:
the same arithmetic, built from the fitted workflow's statistics, with no pandas or NVTabular.

Encoding (NVTabular 23.08 ``Categorify``): 0 = padding (unused), 1 = missing, 2 = out of
vocabulary (unseen, or seen fewer than ``freq_threshold`` times), 3.. = vocabulary, most
frequent first. A hashed column (the spec's ``[hash_buckets]``, or a table shape such as
``criteo-1tb``) has no vocabulary: the workflow passes its values through, and its id is
``crc32(value) % N`` (:func:`ensemble.native.hash_ids`; in C from Triton's buffers), so its table has
exactly N rows whatever training saw, and no dictionary holds its values.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ensemble import schema
from ensemble.dataset import DatasetSpec, Kind, cell_bytes, list_slots
from ensemble import native
from ensemble.base.device import Device

LOG = logging.getLogger(__name__)

NULL_ID = 1
OOV_ID = 2
FIRST_ID = 3
# A vocabulary of this many values or more is kept as a CompactVocabulary (12-byte slots of value hash and id,
# ~17 bytes a value) instead of a dict (over 100 bytes a value): docs/tables.md "Vocabulary columns".
COMPACT_FROM = 1_000_000
LEAN_FILE = "lean.json"


def fit_workflow(train, out_dir: str | Path, freq_threshold: int | None = 3, device: Device = Device.CPU,
                 spec: DatasetSpec = schema.CRITEO) -> Path:
    """Fit the NVTabular workflow on a training frame and save it.

    Args:
        train: frame with the spec's columns (Criteo: from :func:`ensemble.data.criteo.read_criteo`,
            ``I*`` float, ``C*`` str/None).
        out_dir: the saved workflow directory (NVTabular's format; categories inside).
        freq_threshold: values seen fewer times than this map to the out-of-vocabulary id; None:
            the spec's threshold of each column.
        device: "gpu" fits on cuDF when cuDF is installed (see :func:`ensemble.base.device.fit_frame`).
        spec: the dataset's columns (default Criteo).

    Returns:
        ``out_dir``.
    """
    import nvtabular as nvt

    from ensemble.base.device import fit_frame

    out_dir = Path(out_dir)
    spec.check_frame(train, with_label=False)
    workflow = build_workflow(out_dir, freq_threshold, spec=spec)
    columns = [*spec.continuous, *spec.categorical]
    frame, on_gpu = fit_frame(spec.prepared(train[columns]).reset_index(drop=True), device)
    workflow.fit(nvt.Dataset(frame, cpu=not on_gpu))
    return save_workflow(workflow, out_dir, spec)


def build_workflow(out_dir: Path, freq_threshold: int | None = 3, client=None, spec: DatasetSpec = schema.CRITEO):
    """The unfitted NVTabular ``Workflow`` (``client``: a dask client to fit and transform on)."""
    import nvtabular as nvt
    from nvtabular import ops

    dense = (list(spec.continuous) >> ops.FillMissing(fill_val=0) >> ops.Clip(min_value=0)
             >> ops.LogOp() >> ops.Normalize())
    vocabulary = [c for c in spec.model_categorical if c not in spec.hashed_columns]
    thresholds = spec.freq_thresholds if freq_threshold is None else freq_threshold
    if isinstance(thresholds, dict):
        thresholds = {c: t for c, t in thresholds.items() if c in vocabulary}
        if len(set(thresholds.values())) == 1:
            thresholds = next(iter(thresholds.values()))  # one value: the form NVTabular has always been given
    graph = dense
    if vocabulary:  # out_path keeps NVTabular from writing ./categories into the working directory.
        graph = graph + (vocabulary >> ops.Categorify(freq_threshold=thresholds,
                                                       out_path=str(out_dir.parent / f".{out_dir.name}-fit")))
    if spec.hashed_columns:  # passed through: their ids come from the hash (hash_ids), not a vocabulary
        graph = graph + list(spec.hashed_columns)
    return nvt.Workflow(graph, client=client)


def save_workflow(workflow, out_dir: Path, spec: DatasetSpec = schema.CRITEO) -> Path:
    """Save a fitted workflow in NVTabular's format plus the lean transform's statistics."""
    workflow.save(str(out_dir))
    _write_lean_stats(workflow, out_dir, spec)
    return out_dir


def load_workflow(workflow_dir: str | Path):
    """The saved NVTabular ``Workflow`` (imports NVTabular, TensorFlow and torch: ~5 s)."""
    import nvtabular as nvt

    return nvt.Workflow.load(str(workflow_dir))


def nvtabular_transform(workflow, frame, device: Device = Device.CPU, spec: DatasetSpec = schema.CRITEO):
    """Run the saved workflow itself (the reference the lean transform is tested against).

    Args:
        workflow: a loaded ``Workflow`` or its directory.
        frame: a frame with the spec's columns (at least one non-null value per categorical
            column: NVTabular 23.08 fails on a column that is null in every row).
        device: "gpu" transforms on cuDF when cuDF is installed (training's bulk transform).

    Returns:
        (dense [B x continuous] float64, ids [B x the models' categorical columns] int64)
    """
    from ensemble.base.device import fit_frame, to_host

    if isinstance(workflow, (str, Path)):
        workflow = load_workflow(workflow)
    columns = [*spec.continuous, *spec.categorical]
    frame, _ = fit_frame(spec.prepared(frame[columns]).reset_index(drop=True), device)
    out = workflow.transform(frame)
    return (to_host(out[list(spec.continuous)].values).astype(np.float64), model_ids(out, spec))


def model_ids(frame, spec: DatasetSpec) -> np.ndarray:
    """[B x the models' categorical columns] int64 of a transformed frame: each vocabulary column's
    ids as the workflow gave them, each hashed column's from its passed-through values."""
    from ensemble.base.device import to_host

    hashed = dict(zip(spec.categorical, spec.hash_buckets))
    columns = []
    for name in spec.model_categorical:
        if hashed.get(name):
            columns.append(native.hash_ids(to_host(frame[name]).tolist(), hashed[name]))
        else:
            columns.append(to_host(frame[name].values).astype(np.int64))
    return np.stack(columns, axis=1) if columns else np.empty((len(frame), 0), np.int64)


def _ops_of(workflow) -> list:
    found, stack = [], [workflow.output_node]
    while stack:
        node = stack.pop()
        if node.op is not None:
            found.append(node.op)
        stack.extend(node.parents_with_dependencies)
    return found


def _write_lean_stats(workflow, out_dir: Path, spec: DatasetSpec = schema.CRITEO) -> None:
    """Copy what the lean transform needs out of the fitted workflow's operators."""
    by_type = {type(op).__name__: op for op in _ops_of(workflow)}
    normalize, fill, clip = (by_type[k] for k in ("Normalize", "FillMissing", "Clip"))
    cat = by_type.get("Categorify")  # absent when every categorical column is hashed
    stats = {
        "dataset": spec.name,
        "dense_columns": list(spec.continuous),
        "categorical_columns": list(spec.categorical),
        "context_dense": spec.context_width(Kind.CONTINUOUS),
        "context_categorical": spec.context_width(Kind.CATEGORICAL),
        "hash_buckets": list(spec.hash_buckets),
        "max_items": list(spec.max_items),
        "list_separator": spec.list_separator,
        "id_columns": list(spec.model_categorical),
        "fill_value": float(fill.fill_val),
        "clip_min": float(clip.min_value),
        "means": [float(normalize.means[c]) for c in spec.continuous],
        "stds": [float(normalize.stds[c]) for c in spec.continuous],
        "freq_threshold": (cat.freq_threshold if cat is not None and isinstance(cat.freq_threshold, (int, dict)) else 0),
        "vocabularies": {c: f"categories/unique.{c}.parquet" for c in spec.model_categorical
                         if c not in spec.hashed_columns},
    }
    (out_dir / LEAN_FILE).write_text(json.dumps(stats, indent=1))


def workflow_widths(workflow_dir: str | Path) -> schema.Widths:
    """How many continuous and categorical columns a saved workflow takes (its lean statistics list
    them; a workflow saved without the lists is Criteo's)."""
    stats = json.loads((Path(workflow_dir) / LEAN_FILE).read_text())
    if "dense_columns" not in stats:
        return schema.CRITEO_WIDTHS
    return schema.Widths(len(stats["dense_columns"]), len(stats["categorical_columns"]),
                         int(stats.get("context_dense", 0)), int(stats.get("context_categorical", 0)),
                         len(stats.get("id_columns", stats["categorical_columns"])))


@dataclass(frozen=True)
class LeanTransform:
    """The fitted workflow's arithmetic in numpy.

    Attributes:
        means, stds: [13] float32 Normalize statistics (of log(x+1) on the training split).
        fill_value, clip_min: FillMissing and Clip parameters.
        lookups: per categorical column, ``bytes value -> id`` (b"" -> missing id).
        dense_columns, categorical_columns: the columns of the two input tensors, in order (the
            dataset spec's; a workflow saved without them is Criteo's).
        hash_buckets: per categorical column, its hash buckets (0: not hashed; empty: none is).
        max_items: per categorical column, its slots when it is multi-hot (0: one value; empty:
            none is multi-hot); ``list_separator`` splits such a column's items.
        id_columns: the columns of the ids the models take (``categorical_columns`` with each
            multi-hot column replaced by its slots); ``lookups`` follow them.
    """

    means: np.ndarray
    stds: np.ndarray
    fill_value: float
    clip_min: float
    lookups: tuple[dict, ...]
    dense_columns: tuple[str, ...] = schema.DENSE_COLUMNS
    categorical_columns: tuple[str, ...] = schema.CATEGORICAL_COLUMNS
    hash_buckets: tuple[int, ...] = ()
    max_items: tuple[int, ...] = ()
    list_separator: bytes = b"|"
    id_columns: tuple[str, ...] = ()
    dataset: str = "criteo"  # the spec's name (the online store's key prefix: ensemble/online/)

    @classmethod
    def load(cls, workflow_dir: str | Path, compact_from: int = COMPACT_FROM) -> "LeanTransform":
        """The fitted statistics; a vocabulary of ``compact_from`` values or more as a compact lookup (when the
        C modules are built: else a dict, said in the log)."""
        import pyarrow.parquet as pq

        workflow_dir = Path(workflow_dir)
        stats = json.loads((workflow_dir / LEAN_FILE).read_text())
        lookups = []
        dense_columns = tuple(stats.get("dense_columns", schema.DENSE_COLUMNS))
        categorical_columns = tuple(stats.get("categorical_columns", schema.CATEGORICAL_COLUMNS))
        id_columns = tuple(stats.get("id_columns", categorical_columns))
        for col in id_columns:
            if col not in stats["vocabularies"]:  # a hashed column: no vocabulary
                lookups.append({})
                continue
            # ParquetFile, not read_table: read_table imports pyarrow.dataset and with it pandas.
            table = pq.ParquetFile(workflow_dir / stats["vocabularies"][col]).read(columns=[col])
            if table.num_rows >= compact_from:
                if native.COMPILED:
                    lookups.append(compact_lookup(table.column(0), col))
                    continue
                LOG.warning("%s: %s values kept in a dict (the C modules are not built: "
                            "ensemble.native's CompactVocabulary is theirs)", col, f"{table.num_rows:,}")
            values = table.column(0).to_pylist()
            lookup = {v.encode("utf-8"): FIRST_ID + i for i, v in enumerate(values) if v is not None}
            lookup[b""] = NULL_ID
            lookups.append(lookup)
        return cls(np.asarray(stats["means"], np.float32), np.asarray(stats["stds"], np.float32),
                   float(stats["fill_value"]), float(stats["clip_min"]), tuple(lookups), dense_columns,
                   categorical_columns, tuple(stats.get("hash_buckets", ())) if any(stats.get("hash_buckets", ())) else (),
                   tuple(stats.get("max_items", ())) if any(stats.get("max_items", ())) else (),
                   stats.get("list_separator", "|").encode(), id_columns, stats.get("dataset", "criteo"))

    @property
    def cardinalities(self) -> tuple[int, ...]:
        """Embedding rows each id column needs: a hashed column's buckets, else the reserved ids and
        the vocabulary."""
        return tuple(buckets or FIRST_ID + len(lookup) - 1 for lookup, buckets in zip(self.lookups, self.id_buckets))

    @functools.cached_property
    def id_buckets(self) -> tuple[int, ...]:
        """Per id column: its hash buckets (0: a vocabulary column, as every multi-hot slot is)."""
        if not self.hash_buckets:
            return (0,) * len(self.lookups)
        found = []
        for buckets, items in zip(self.hash_buckets, self.max_items or (0,) * len(self.hash_buckets)):
            found += [0] * items if items else [buckets]
        return tuple(found)

    def __call__(self, dense: np.ndarray, categorical: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Transform a batch.

        Args:
            dense: [B x 13] raw integer features as float (NaN or +-inf = missing).
            categorical: [B x 26] object array of bytes (b"" = missing).

        Returns:
            (dense_features [B x 13] float32, category_ids [B x 26] int64; wider than the input
            by the slots of multi-hot columns)
        """
        return self.transform_dense(dense), self.transform_categorical(categorical)

    def transform_dense(self, dense: np.ndarray) -> np.ndarray:
        # inf is treated as missing, like NaN; then the clip and the +1 of log(x + 1), in one pass.
        x = native.dense_prepare(dense, self.fill_value, self.clip_min)
        # Bit for bit what NVTabular computes: LogOp in float32 (numpy's float32 log, so not in
        # C), then Normalize on float32 values with scalar statistics, which numpy 1.x evaluates
        # in float32. Being one ulp off would move values that sit exactly on a tree split
        # threshold to the other branch.
        np.log(x, out=x)
        np.subtract(x, self.means, out=x)
        np.divide(x, self.safe_stds, out=x)
        return x

    @functools.cached_property
    def safe_stds(self) -> np.ndarray:
        """The standard deviations the normalization divides by (1 for a column whose is 0)."""
        return np.where(self.stds > 0, self.stds, np.float32(1)).astype(np.float32)

    def transform_categorical(self, categorical: np.ndarray) -> np.ndarray:
        categorical = np.asarray(categorical, dtype=object)
        batch = categorical.shape[0]
        if self.max_items:  # multi-hot columns: each becomes its slots
            categorical = self._slots(categorical)
        # One pass over the row-major values, each looked up in its column's dictionary, in C
        # when it was built (ensemble.native): no per-column or per-value Python overhead.
        ids = native.lookup(categorical.reshape(-1).tolist(), self._dicts, OOV_ID).reshape(batch, len(self.lookups))
        for j, lookup in enumerate(self.lookups):
            if not isinstance(lookup, dict):  # a compact vocabulary
                column = np.empty(batch, np.int64)
                lookup.find(categorical[:, j].tolist(), OOV_ID, column)
                ids[:, j] = column
        for j, buckets in enumerate(self.id_buckets):
            if buckets:  # a hashed column: the id from the hash alone
                ids[:, j] = native.hash_ids(categorical[:, j].tolist(), buckets)
        return ids

    @functools.cached_property
    def _dicts(self) -> tuple[dict, ...]:
        """The lookups that are dicts, an empty one in a compact vocabulary's place."""
        return tuple(lookup if isinstance(lookup, dict) else {} for lookup in self.lookups)

    @property
    def reads_wire(self) -> bool:
        """Whether :meth:`ids_from_wire` applies: no column needs Python per value first (multi-hot
        columns do; hashed ones are hashed from the buffer)."""
        return not self.max_items

    def ids_from_wire(self, buffer, rows: int) -> np.ndarray:
        """What :meth:`transform_categorical` gives for the strings of a Triton BYTES wire buffer
        (``rows`` x columns values, row-major), looked up in place: [rows x columns] int64.

        Raises:
            ValueError: a truncated buffer, or not ``rows`` x columns values.
        """
        if not self.reads_wire:
            raise ValueError("multi-hot columns are transformed from strings (transform_categorical)")
        ids = np.empty((rows, len(self.lookups)), dtype=np.int64)
        self.vocabulary.lookup_wire(buffer, OOV_ID, ids.reshape(-1))
        return ids

    @functools.cached_property
    def vocabulary(self):
        """The lookups as :class:`ensemble.native.Vocabulary` (built on first use), hashed columns by their
        buckets."""
        return native.Vocabulary(tuple(self.lookups), self.id_buckets if any(self.id_buckets) else ())

    def _slots(self, categorical: np.ndarray) -> np.ndarray:
        parts = []
        for j, items in enumerate(self.max_items):
            if items:
                parts.append(np.array([list_slots(v, self.list_separator, items) for v in categorical[:, j].tolist()],
                                      dtype=object).reshape(-1, items))
            else:
                parts.append(categorical[:, j:j + 1])
        return np.concatenate(parts, axis=1) if parts else categorical


def compact_lookup(column, name: str = "a vocabulary"):
    """A vocabulary column's values (a pyarrow string column: value i has id FIRST_ID + i, nulls none; the empty
    value NULL_ID, as in the dicts) as a ``CompactVocabulary``, built from the column's buffers in C."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    array = array.cast(pa.large_binary())
    _, offsets, data = array.buffers()
    offsets = np.frombuffer(offsets, np.int64)[array.offset:array.offset + len(array) + 1]
    ids = FIRST_ID + np.arange(len(array), dtype=np.int64)
    ids[np.asarray(array.is_null())] = -1
    start = int(offsets[0]) if len(offsets) else 0
    # the empty value first: the first of equal values keeps its id (as the dict's b"" set after them does)
    offsets = np.concatenate([[start], offsets]).astype(np.int64)
    ids = np.concatenate([[NULL_ID], ids]).astype(np.int64)
    found = native.CompactVocabulary(offsets, data if data is not None else b"", ids)
    if found.collisions:
        LOG.warning("%s: %d values share another's 64-bit hash and take its id", name, found.collisions)
    return found


def lookup_examples(lookup, n: int = 50) -> list[bytes]:
    """Up to ``n`` values a lookup knows (a compact vocabulary keeps no values: none)."""
    return list(lookup)[:n] if isinstance(lookup, dict) else []


def encode_categorical(frame, columns: tuple[str, ...] = schema.CATEGORICAL_COLUMNS,
                       separator: str = "|") -> np.ndarray:
    """Categorical columns (str, None/NaN = missing; default Criteo's ``C*``) -> [B x columns]
    object array of bytes. A multi-hot cell given as a list of items is joined by ``separator``."""
    out = np.empty((len(frame), len(columns)), dtype=object)
    for j, col in enumerate(columns):
        out[:, j] = [v.encode("utf-8") if isinstance(v, str) else (v if isinstance(v, bytes) else
                     (cell_bytes(v, separator) if isinstance(v, (list, tuple, np.ndarray)) else b""))
                     for v in frame[col].tolist()]
    return out


def dense_array(frame, columns: tuple[str, ...] = schema.DENSE_COLUMNS) -> np.ndarray:
    """Continuous columns (default Criteo's ``I*``) -> [B x columns] float32 (NaN = missing)."""
    return frame[list(columns)].to_numpy(dtype=np.float32, na_value=np.nan)
