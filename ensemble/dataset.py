"""Dataset specs: what a click log's columns are, in one small TOML file.

A spec names the label (0/1), the continuous and the categorical feature columns, and splits them
into the *context* (the user or query: the same for every candidate of one ranking) and the
*candidate* (the item being scored). The ranker's two input tensors follow from it: ``dense`` is
the context's continuous columns then the candidate's, ``categorical`` the same for categorical
columns. Criteo is the built-in default (``ensemble/datasets/criteo.toml``: 13 continuous and 26
categorical candidate columns, no context), so its contract is the one the project always had.

A spec file::

    name = "movielens100k"
    label = "label"              # a 0/1 column
    time = "timestamp"           # optional: orders interactions (time splits)
    freq_threshold = 1           # optional, default for every categorical column (>= 1)

    [context]                    # optional
    continuous = ["age"]
    categorical = ["user_id", "gender"]
    key = "user_id"              # optional: the entity key (ranking by ids, ensemble/online/)

    [candidate]
    continuous = ["release_year"]
    categorical = ["movie_id"]
    key = "movie_id"

    [freq_threshold_by_column]   # optional, per categorical column
    user_id = 2

    [hash_buckets]               # optional: hash a categorical column's values into N buckets
    user_id = 100000

    [model]                      # optional: the models' size (ensemble/base/model_size.py)
    size = "seed"

A *multi-hot* column holds a list of values per row (genres, tags): listed under ``multi_hot`` in
``[context]`` or ``[candidate]``, sent as one string with the items separated by ``list_separator``
(default ``"|"``: ``"comedy|drama"``), and given its most items in ``[max_items]`` (required)::

    [candidate]
    multi_hot = ["genres"]

    [max_items]
    genres = 3

It rides in the ``categorical`` tensor as one column, after the side's categorical columns. The
features step turns it into ``max_items`` slot columns ``genres[0]``, ``genres[1]``, ... holding the
row's distinct items in sorted order (a set: order and repeats do not count; items past
``max_items`` are dropped; unused slots are missing), and each slot is then an ordinary categorical
column with its own vocabulary and embedding table (:meth:`DatasetSpec.prepared`,
:func:`list_slots`). The models see the slots, the client contract the one column.

A side's ``key`` names the categorical column that identifies its entity (the user, the item): the
online store holds each entity's row of that side's columns under its key value, so that a ranking
request can name a user and item ids instead of sending their features (``ensemble materialize``).
The key stays a feature of the side like any other column.

Categorical values seen fewer than their column's threshold times in training map to the
out-of-vocabulary id. A hashed column (``[hash_buckets]``, column = N) has no vocabulary: its id is
``crc32(value) % N`` (DLRM's ``max-ind-range``), in training and in serving alike, so its embedding
table has exactly N rows whatever training saw, a value never seen in training still has a row
(colliding values share one), and missing values share the empty value's row. A built-in table shape
(:data:`TABLE_SHAPES`, ``--table-shape criteo-1tb``) hashes every categorical column of a spec with
the shape's bucket counts. Unknown keys are refused, so a misspelt option fails instead of being
ignored.
"""

from __future__ import annotations

import enum
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ensemble.base import model_size

BUILTIN_DIR = Path(__file__).resolve().parent / "datasets"
DEFAULT = "criteo"


class SpecError(ValueError):
    """A spec that cannot describe a dataset, or data that does not match its spec."""


class Kind(str, enum.Enum):
    CONTINUOUS = "continuous"
    CATEGORICAL = "categorical"


class Side(str, enum.Enum):
    CONTEXT = "context"
    CANDIDATE = "candidate"


@dataclass(frozen=True)
class Column:
    name: str
    kind: Kind
    side: Side
    freq_threshold: int = 1  # categorical columns only
    hash_buckets: int = 0  # categorical columns only; 0: not hashed
    max_items: int = 0  # multi-hot columns (categorical kind): their slots; 0: one value per row

    @property
    def slots(self) -> tuple[str, ...]:
        """The columns the features step gives the models for this one: itself, or its slots."""
        return tuple(slot_name(self.name, i) for i in range(self.max_items)) if self.max_items else (self.name,)


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed, checked spec. ``columns`` lists the features in tensor order."""

    name: str
    label: str
    columns: tuple[Column, ...]
    time: str | None = None
    source: str = "<string>"
    list_separator: str = "|"
    model: tuple[tuple[str, object], ...] = ()  # the [model] table's settings (ensemble.base.model_size)
    keys: tuple[tuple[Side, str], ...] = ()  # each side's entity key column, when named (ranking by ids)

    def key(self, side: Side) -> str | None:
        """The side's entity key column (a single-valued categorical column of that side), or None."""
        return dict(self.keys).get(side)

    def _names(self, kind: Kind, side: Side | None = None) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.kind is kind and (side is None or c.side is side))

    @property
    def continuous(self) -> tuple[str, ...]:
        """Columns of the ``dense`` tensor, in order."""
        return self._names(Kind.CONTINUOUS)

    @property
    def categorical(self) -> tuple[str, ...]:
        """Columns of the ``categorical`` tensor, in order."""
        return self._names(Kind.CATEGORICAL)

    @property
    def context(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.side is Side.CONTEXT)

    @property
    def candidate(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.side is Side.CANDIDATE)

    def context_width(self, kind: Kind) -> int:
        """How many of a tensor's leading columns are the context's."""
        return len(self._names(kind, Side.CONTEXT))

    @property
    def model_categorical(self) -> tuple[str, ...]:
        """The categorical columns the models see, in order: ``categorical`` with every multi-hot
        column replaced by its slots (the same as ``categorical`` when there is none)."""
        return tuple(s for c in self.columns if c.kind is Kind.CATEGORICAL for s in c.slots)

    @property
    def max_items(self) -> tuple[int, ...]:
        """Per column of the categorical tensor: its slots when multi-hot, else 0."""
        return tuple(c.max_items for c in self.columns if c.kind is Kind.CATEGORICAL)

    @property
    def freq_thresholds(self) -> dict[str, int]:
        """Per column the models see (a multi-hot column's slots take its threshold)."""
        return {s: c.freq_threshold for c in self.columns if c.kind is Kind.CATEGORICAL for s in c.slots}

    @property
    def hash_buckets(self) -> tuple[int, ...]:
        """Per column of the categorical tensor: its buckets, 0 when it is not hashed."""
        return tuple(c.hash_buckets for c in self.columns if c.kind is Kind.CATEGORICAL)

    @property
    def hashed_columns(self) -> tuple[str, ...]:
        """The categorical columns whose ids come from a hash (no vocabulary), in tensor order."""
        return tuple(c.name for c in self.columns if c.hash_buckets)

    def with_hash_buckets(self, buckets: tuple[int, ...]) -> "DatasetSpec":
        """This spec with categorical column j hashed into ``buckets[j]`` rows (a table shape)."""
        categorical = [c for c in self.columns if c.kind is Kind.CATEGORICAL]
        if len(buckets) != len(categorical):
            raise SpecError(f"{self.source}: a table shape of {len(buckets)} tables for {len(categorical)} categorical columns")
        multi = [c.name for c in categorical if c.max_items]
        if multi:
            raise SpecError(f"{self.source}: a table shape hashes every column; {', '.join(multi)} is multi-hot")
        given = dict(zip((c.name for c in categorical), buckets))
        columns = tuple(Column(c.name, c.kind, c.side, c.freq_threshold, int(given[c.name]), c.max_items)
                        if c.name in given else c for c in self.columns)
        return DatasetSpec(self.name, self.label, columns, self.time, self.source, self.list_separator, self.model,
                           self.keys)

    def prepared(self, frame):
        """``frame`` as the features step sees it: every multi-hot column replaced by its slot
        columns (:func:`list_slots`); hashed columns as they are (their ids are hashed after)."""
        lists = [c for c in self.columns if c.max_items and c.name in frame.columns]
        if not lists:
            return frame
        import pandas as pd

        columns = {}
        for name in frame.columns:
            column = next((c for c in lists if c.name == name), None)
            if column is None:
                columns[name] = frame[name]
                continue
            sep = self.list_separator.encode()
            rows = [list_slots(cell_bytes(v, self.list_separator), sep, column.max_items)
                    for v in frame[name].tolist()]
            for i, slot in enumerate(column.slots):
                columns[slot] = pd.Series([r[i].decode() if r[i] else None for r in rows], index=frame.index,
                                          dtype=object)
        return pd.DataFrame(columns, index=frame.index)

    def check_frame(self, frame, *, with_label: bool = True) -> None:
        """Refuse a frame that does not match the spec, naming the column.

        Checks: every spec column is present; a continuous column is numeric; a categorical column
        has at least one value; the label is 0/1 with no missing value.
        """
        needed = [*([self.label] if with_label else []), *(c.name for c in self.columns)]
        missing = [name for name in needed if name not in frame.columns]
        if missing:
            raise SpecError(f"{self.name}: column(s) {', '.join(map(repr, missing))} of the spec not in the data "
                            f"(it has {', '.join(map(repr, list(frame.columns)[:20]))})")
        for column in self.columns:
            values = frame[column.name]
            if column.kind is Kind.CONTINUOUS:
                if not (np.issubdtype(values.dtype, np.number) or np.issubdtype(values.dtype, np.bool_)):
                    raise SpecError(f"{self.name}: continuous column {column.name!r} is not numeric "
                                    f"(dtype {values.dtype}); declare it categorical or convert it")
            elif not (present := values.dropna()).size or not present.ne("").any():
                raise SpecError(f"{self.name}: categorical column {column.name!r} has no values")
        if with_label:
            label = frame[self.label]
            if label.isna().any():
                raise SpecError(f"{self.name}: label {self.label!r} is missing in {int(label.isna().sum())} row(s)")
            bad = [v for v in dict.fromkeys(label.tolist()) if not (isinstance(v, (int, float, np.number)) and v in (0, 1))]
            if bad:
                raise SpecError(f"{self.name}: label {self.label!r} must be 0 or 1; found {bad[:5]}")


def cell_bytes(value, separator: str = "|") -> bytes:
    """A categorical cell as the bytes the contract sends: text as UTF-8, a list of items (a
    multi-hot cell read from Parquet or built in Python) joined by ``separator``, missing as b""."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple, np.ndarray)):
        return separator.encode().join(cell_bytes(v, separator) for v in value if v is not None)
    if value is None or (isinstance(value, float) and value != value):
        return b""
    return str(value).encode()


def slot_name(column: str, index: int) -> str:
    """The name of a multi-hot column's slot ``index`` (0-based)."""
    return f"{column}[{index}]"


def list_slots(value: bytes, separator: bytes, max_items: int) -> list[bytes]:
    """A multi-hot value (``b"drama|comedy"``) as its ``max_items`` slots: the distinct non-empty
    items, sorted, the first ``max_items`` kept, padded with ``b""`` (missing)."""
    items = sorted({item.strip() for item in value.split(separator)} - {b""}) if value else []
    return items[:max_items] + [b""] * (max_items - len(items[:max_items]))


# Built-in table shapes: each categorical column's rows, in order. criteo-1tb: the DLRM seed's Criteo
# Terabyte configuration (the MLPerf DLRM reference: ids capped at 40M, ``--max-ind-range=40000000``),
# 204,184,588 rows in all.
TABLE_SHAPES: dict[str, tuple[int, ...]] = {
    "criteo-1tb": (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
                   11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36),
}


def with_table_shape(spec: "DatasetSpec", shape: str | None) -> "DatasetSpec":
    """``spec`` hashed into a built-in table shape (None: as it is)."""
    if shape is None:
        return spec
    if shape not in TABLE_SHAPES:
        raise SpecError(f"no table shape {shape!r} (built in: {', '.join(sorted(TABLE_SHAPES))})")
    return spec.with_hash_buckets(TABLE_SHAPES[shape])


_TOP_KEYS = {"name", "label", "time", "freq_threshold", "context", "candidate", "freq_threshold_by_column",
             "hash_buckets", "list_separator", "max_items", "model"}
_SIDE_KEYS = {"continuous", "categorical", "multi_hot", "key"}
_MULTI_HOT = "multi_hot"


def _threshold(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: freq_threshold must be an integer >= 1, not {value!r}")
    return value


def _names_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SpecError(f"{where} must be a list of column names")
    return value


def parse_spec(text: str, source: str = "<string>") -> DatasetSpec:
    """Parse and check a spec's TOML text (``source`` names it in errors)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise SpecError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_TOP_KEYS))})")
    for key in ("name", "label"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise SpecError(f"{source}: {key!r} is required (a string)")
    name, label = raw["name"], raw["label"]
    time = raw.get("time")
    if time is not None and (not isinstance(time, str) or not time):
        raise SpecError(f"{source}: 'time' must be a column name")
    default_threshold = _threshold(raw.get("freq_threshold", 1), source)
    by_column = raw.get("freq_threshold_by_column", {})
    if not isinstance(by_column, dict):
        raise SpecError(f"{source}: [freq_threshold_by_column] must be a table of column = threshold")
    hashing = raw.get("hash_buckets", {})
    if not isinstance(hashing, dict):
        raise SpecError(f"{source}: [hash_buckets] must be a table of column = buckets")
    for column, buckets in hashing.items():
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 2:
            raise SpecError(f"{source}: column {column!r}: hash_buckets must be an integer >= 2, not {buckets!r}")

    separator = raw.get("list_separator", "|")
    if not isinstance(separator, str) or not separator:
        raise SpecError(f"{source}: 'list_separator' must be a non-empty string")
    max_items = raw.get("max_items", {})
    if not isinstance(max_items, dict):
        raise SpecError(f"{source}: [max_items] must be a table of column = most items per row")
    for column, items in max_items.items():
        if isinstance(items, bool) or not isinstance(items, int) or not 1 <= items <= 64:
            raise SpecError(f"{source}: column {column!r}: max_items must be an integer from 1 to 64, not {items!r}")

    columns: list[Column] = []
    seen: dict[str, str] = {}
    keys: list[tuple[Side, str]] = []
    for side in (Side.CONTEXT, Side.CANDIDATE):
        table = raw.get(side.value, {})
        if not isinstance(table, dict):
            raise SpecError(f"{source}: [{side.value}] must be a table")
        extra = sorted(set(table) - _SIDE_KEYS)
        if extra:
            raise SpecError(f"{source}: unknown key(s) {', '.join(extra)} in [{side.value}] "
                            f"(known: {', '.join(sorted(_SIDE_KEYS))})")
        for key, kind in ((Kind.CONTINUOUS.value, Kind.CONTINUOUS), (Kind.CATEGORICAL.value, Kind.CATEGORICAL),
                          (_MULTI_HOT, Kind.CATEGORICAL)):
            for column in _names_list(table.get(key, []), f"{source}: {side.value}.{key}"):
                where = f"{side.value}.{key}"
                if column in seen:
                    raise SpecError(f"{source}: column {column!r} is listed twice ({seen[column]} and {where})")
                if column in (label, time):
                    what = "label" if column == label else "time column"
                    raise SpecError(f"{source}: column {column!r} is the {what}; it cannot also be a feature")
                seen[column] = where
                threshold = 1
                if kind is Kind.CATEGORICAL:
                    threshold = _threshold(by_column.get(column, default_threshold), f"{source}: column {column!r}")
                items = 0
                if key == _MULTI_HOT:
                    if column not in max_items:
                        raise SpecError(f"{source}: multi-hot column {column!r} needs its most items per row "
                                        f"in [max_items] ({column} = N)")
                    if column in hashing:
                        raise SpecError(f"{source}: multi-hot column {column!r} cannot be hashed "
                                        f"(its items are looked up one by one)")
                    items = max_items[column]
                columns.append(Column(column, kind, side, threshold,
                                      hashing.get(column, 0) if kind is Kind.CATEGORICAL else 0, items))
        if "key" in table:
            key = table["key"]
            ok = next((c for c in columns if c.name == key and c.side is side and c.kind is Kind.CATEGORICAL
                       and not c.max_items), None) if isinstance(key, str) else None
            if ok is None:
                raise SpecError(f"{source}: [{side.value}] key {key!r} must name one of the side's categorical "
                                f"(not multi-hot) columns")
            keys.append((side, key))
    # Tensor order: context then candidate within each kind (the loop above already is).
    for table, names in (("freq_threshold_by_column", by_column), ("hash_buckets", hashing)):
        for column in names:
            if seen.get(column, "").split(".")[-1] not in (Kind.CATEGORICAL.value, _MULTI_HOT):
                raise SpecError(f"{source}: [{table}] names {column!r}, which is not a categorical column of the spec")
    for column in max_items:
        if seen.get(column, "").split(".")[-1] != _MULTI_HOT:
            raise SpecError(f"{source}: [max_items] names {column!r}, which is not a multi-hot column of the spec")
    for column in (c for c in columns if c.max_items):
        for slot in column.slots:
            if slot in seen or slot in (label, time):
                raise SpecError(f"{source}: multi-hot column {column.name!r}: its slot name {slot!r} is taken "
                                f"by another column")
    if not columns:
        raise SpecError(f"{source}: no feature columns: list some under [context] or [candidate]")
    if not any(c.side is Side.CANDIDATE for c in columns):
        raise SpecError(f"{source}: no candidate column: a ranking needs something that differs between candidates")
    if not any(c.kind is Kind.CATEGORICAL for c in columns) or not any(c.kind is Kind.CONTINUOUS for c in columns):
        # The DLRMs need both a dense input and at least one embedding table.
        raise SpecError(f"{source}: the models need at least one continuous and one categorical column")
    try:
        model = tuple(sorted(model_size.from_table(raw.get("model", {}), source).items()))
    except model_size.SizeError as exc:
        raise SpecError(str(exc)) from None
    return DatasetSpec(name, label, tuple(columns), time, source, separator, model, tuple(keys))


def builtin_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in BUILTIN_DIR.glob("*.toml")))


def load_spec(name_or_path: str | Path = DEFAULT) -> DatasetSpec:
    """A built-in spec by name (``criteo``, ``movielens100k``) or a spec file's path."""
    path = Path(name_or_path)
    if path.suffix != ".toml" and str(name_or_path) in builtin_names():
        path = BUILTIN_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise SpecError(f"no spec {str(name_or_path)!r}: not a file, and not a built-in "
                        f"({', '.join(builtin_names())})")
    return parse_spec(path.read_text(), str(path))
