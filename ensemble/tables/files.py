"""The row store's files: every row of a table, written at export, never by the server.

A table file (``<table>.rows``) holds a header block and then the table's rows in id order, packed
into 4 KiB blocks, each with the CRC-32 of its index and bytes in its last 4 bytes
(``ensemble/native/_tables.c`` reads and checks them). A row is ``fp32``, ``fp16`` or ``int8``
(FBGEMM's 8-bit rowwise: 128 values in 128 bytes, then a float32 scale and bias: 136 bytes). The rows no
training step touched are written too, from their deterministic initialization
(:func:`init_rows`, seeded by table and row), so a served table reads real rows everywhere.

Besides the tables, a DLRM's version folder holds:

- ``warm.rows`` + ``warm.keys.npy``: the rows training touched most, in that order (a table file
  of those rows and their keys, ``table << 40 | id``), read sequentially at load to fill the hot tier;
- ``<table>.delta.rows`` + ``.delta.ids.npy``: a release that changed a few rows of a table shares the
  table file of the release before (a hard link: no copy) and writes only the changed rows here;
- ``counts.npz``: per table, the ids training touched and how often (``ensemble tables`` predicts a
  budget's hit rate from them);
- ``tables.json``: the tables' shapes, formats, files, deltas and the held-out AUC of each format.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ensemble.tables import SMALL_ROWS

BLOCK = 4096
FORMATS = ("fp32", "fp16", "int8")
MANIFEST = "tables.json"
TABLES_DIR = "tables"
WARM_ROWS = "warm.rows"
WARM_KEYS = "warm.keys.npy"
# The warm file holds at most this many bytes of rows a DLRM: a 6 GiB hot tier split by two DLRMs fills
# from 3 GiB each (benchmarks.tables --parts warm).
WARM_FILE_BYTES = 4 << 30
COUNTS = "counts.npz"
KEY_SHIFT = 40  # a hot-tier key: table << 40 | id
CHUNK_BLOCKS = 8192  # blocks generated, encoded and written at a time (32 MiB of rows)


class TableFileError(RuntimeError):
    """A table file that is missing, not a table file, or not what its release says."""


def _native():
    try:
        from ensemble.native import _tables
    except ImportError as exc:  # built without a C compiler
        raise TableFileError("the row store needs the C module ensemble.native._tables, which this install did not "
                             "build (python -m ensemble.native says why)") from exc
    return _tables


def row_bytes(fmt: str, dim: int) -> int:
    return {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 8}[fmt]


def per_block(fmt: str, dim: int) -> int:
    return (BLOCK - 4) // row_bytes(fmt, dim)


def file_bytes(rows: int, fmt: str, dim: int) -> int:
    """Bytes a table file of ``rows`` rows takes on disk (the header block included)."""
    return (-(-rows // per_block(fmt, dim)) + 1) * BLOCK


def table_seed(model: str, column: str) -> int:
    """The seed of a table's initialization: its DLRM and column, so two DLRMs' tables differ."""
    return zlib.crc32(f"{model}:{column}".encode()) | (zlib.crc32(f"{column}:{model}".encode()) << 32)


def init_rows(seed: int, ids: np.ndarray, dim: int) -> np.ndarray:
    """The initial rows of ``ids`` (int64 [n]): float32 [n x dim], uniform in [-0.05, 0.05)."""
    out = np.empty((len(ids), dim), np.float32)
    _native().init_ids(seed, np.ascontiguousarray(ids, np.int64), dim, out)
    return out


def encode(rows: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [n x dim] -> uint8 [n x row_bytes] in the format."""
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((len(rows), row_bytes(fmt, rows.shape[1])), np.uint8)
    _native().encode(rows, rows.shape[1], fmt, out)
    return out


def decode(data: np.ndarray, fmt: str, dim: int) -> np.ndarray:
    """uint8 [n x row_bytes] -> float32 [n x dim]."""
    data = np.ascontiguousarray(data, np.uint8)
    out = np.empty((len(data), dim), np.float32)
    _native().decode(data, dim, fmt, out)
    return out


def _chunk(seed: int, first: int, count: int, dim: int, fmt: str, ids: np.ndarray, rows: np.ndarray,
           base=None) -> bytes:
    """Blocks of rows [first, first + count): the base rows (``base(first, count)``: encoded uint8 rows of
    another release) or the initial ones, the trained ones over them, encoded, packed."""
    t = _native()
    lo, hi = np.searchsorted(ids, [first, first + count])
    if base is None:
        buffer = np.empty((count, dim), np.float32)
        t.init_rows(seed, first, dim, buffer)
        if hi > lo:
            buffer[ids[lo:hi] - first] = rows[lo:hi]
        encoded = np.empty((count, row_bytes(fmt, dim)), np.uint8)
        t.encode(buffer, dim, fmt, encoded)
    else:
        encoded = np.ascontiguousarray(base(first, count), np.uint8)
        if hi > lo:
            encoded[ids[lo:hi] - first] = encode(rows[lo:hi], fmt)
    blocks = np.empty((-(-count // per_block(fmt, dim)), BLOCK), np.uint8)
    t.pack(encoded, row_bytes(fmt, dim), first // per_block(fmt, dim), blocks)
    return blocks.tobytes()


def write_table(path: Path, rows: int, dim: int, fmt: str, seed: int, ids: np.ndarray | None = None,
                trained: np.ndarray | None = None, threads: int = 2, base=None) -> int:
    """Write a table file of ``rows`` rows: every row its initialization (or, with ``base(first, count)``,
    another release's encoded rows), but ``ids`` (sorted int64) whose rows are ``trained`` (float32
    [len(ids) x dim]). Written beside, then renamed into place.

    Returns:
        Bytes written.
    """
    t = _native()
    ids = np.zeros(0, np.int64) if ids is None else np.ascontiguousarray(ids, np.int64)
    trained = np.zeros((0, dim), np.float32) if trained is None else np.ascontiguousarray(trained, np.float32)
    if len(ids) and (np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= rows):
        raise ValueError(f"{path.name}: trained ids must be sorted, distinct and within the table's {rows} rows")
    step = CHUNK_BLOCKS * per_block(fmt, dim)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out, ThreadPoolExecutor(max(1, threads)) as pool:
        out.write(t.header(fmt, dim, rows, seed))
        starts = range(0, rows, step)
        for blob in pool.map(lambda first: _chunk(seed, first, min(step, rows - first), dim, fmt, ids, trained, base),
                             starts):
            out.write(blob)
    os.replace(tmp, path)
    return file_bytes(rows, fmt, dim)


def write_rows_file(path: Path, encoded: np.ndarray, fmt: str, dim: int, seed: int = 0) -> int:
    """A table file holding these encoded rows (uint8 [n x row_bytes]) in order (warm and delta files)."""
    t = _native()
    n = len(encoded)
    blocks = np.empty((-(-n // per_block(fmt, dim)) if n else 0, BLOCK), np.uint8)
    if n:
        t.pack(np.ascontiguousarray(encoded, np.uint8), row_bytes(fmt, dim), 0, blocks)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(t.header(fmt, dim, n, seed))
        out.write(blocks.tobytes())
    os.replace(tmp, path)
    return file_bytes(n, fmt, dim)


@dataclass(frozen=True)
class Header:
    fmt: str
    dim: int
    rows: int
    seed: int


def read_header(path: Path) -> Header:
    """A table file's header, checked (TableFileError naming the file otherwise)."""
    try:
        with open(path, "rb") as handle:
            block = handle.read(BLOCK)
    except OSError as exc:
        raise TableFileError(f"{path}: {exc.strerror}") from None
    if len(block) != BLOCK or block[:8] != b"ENSROWS1" or _native().check_blocks(block, (1 << 64) - 1) != -1:
        raise TableFileError(f"{path} is not a table file (its header fails its check)")
    _, fmt_code, dim, _, _, _ = np.frombuffer(block, np.uint32, 6, 8)
    rows, _, seed = np.frombuffer(block, np.uint64, 3, 32)
    return Header(FORMATS[int(fmt_code)], int(dim), int(rows), int(seed))


def read_rows(path: Path, ids: np.ndarray) -> np.ndarray:
    """Rows of a table file (float32 [len(ids) x dim]), each block checked: for tests, deltas and the
    export's comparisons (the server reads in C)."""
    header = read_header(path)
    ids = np.asarray(ids, np.int64)
    per = per_block(header.fmt, header.dim)
    rb = row_bytes(header.fmt, header.dim)
    out = np.empty((len(ids), rb), np.uint8)
    blocks = ids // per
    with open(path, "rb") as handle:
        for b in np.unique(blocks):
            handle.seek(int(b + 1) * BLOCK)
            block = handle.read(BLOCK)
            if len(block) != BLOCK or _native().check_blocks(block, int(b)) != -1:
                raise TableFileError(f"{path}: block {int(b)} fails its checksum")
            where = np.nonzero(blocks == b)[0]
            data = np.frombuffer(block, np.uint8)
            for i in where:
                k = int(ids[i] % per)
                out[i] = data[k * rb:(k + 1) * rb]
    return decode(out, header.fmt, header.dim)


def read_all_rows(path: Path) -> np.ndarray:
    """Every row of a (small) table file, encoded: uint8 [rows x row_bytes], every block checked."""
    header = read_header(path)
    data = np.fromfile(path, np.uint8)[BLOCK:]
    if len(data) % BLOCK or _native().check_blocks(data, 0) != -1:
        raise TableFileError(f"{path}: a block fails its checksum")
    rb, per = row_bytes(header.fmt, header.dim), per_block(header.fmt, header.dim)
    return data.reshape(-1, BLOCK)[:, :per * rb].reshape(-1, rb)[:header.rows]


@dataclass(frozen=True)
class Delta:
    """The rows a release changed in a table it shares with the release before."""

    file: str  # relative to the version folder
    ids: str
    rows: int


@dataclass(frozen=True)
class TableEntry:
    """One table of a DLRM step, as ``tables.json`` lists it."""

    name: str
    rows: int
    seed: int
    file: str  # relative to the version folder
    small: bool
    bytes: int
    delta: Delta | None = None
    shared_from: str | None = None  # the version folder whose file this one is (a hard link)

    @classmethod
    def of(cls, raw: dict) -> "TableEntry":
        delta = Delta(**raw["delta"]) if raw.get("delta") else None
        return cls(raw["name"], int(raw["rows"]), int(raw["seed"]), raw["file"], bool(raw["small"]), int(raw["bytes"]),
                   delta, raw.get("shared_from"))


@dataclass(frozen=True)
class TablesManifest:
    """``tables.json``: a DLRM step's row store."""

    format: str
    dim: int
    tables: tuple[TableEntry, ...]
    warm_rows: int = 0
    accuracy: dict = field(default_factory=dict)  # held-out AUC per format, and the one chosen
    written_bytes: int = 0  # what the export wrote for this step's tables
    shared_bytes: int = 0  # what it shares with the release before
    changed_rows: int = 0  # rows whose stored bytes differ from the shared release's (all of a table written whole
    # without one to compare with)

    def save(self, version_dir: Path) -> Path:
        path = Path(version_dir) / MANIFEST
        body = asdict(self)
        body["tables"] = [asdict(t) for t in self.tables]
        path.write_text(json.dumps(body, indent=1))
        return path

    @classmethod
    def load(cls, version_dir: Path) -> "TablesManifest":
        raw = json.loads((Path(version_dir) / MANIFEST).read_text())
        return cls(raw["format"], int(raw["dim"]), tuple(TableEntry.of(t) for t in raw["tables"]),
                   int(raw.get("warm_rows", 0)), raw.get("accuracy", {}), int(raw.get("written_bytes", 0)),
                   int(raw.get("shared_bytes", 0)), int(raw.get("changed_rows", 0)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def disk_bytes(self) -> int:
        return sum(t.bytes for t in self.tables)


def has_tables(version_dir: Path) -> bool:
    """Whether a DLRM step's version folder keeps its embedding rows in a row store."""
    return (Path(version_dir) / MANIFEST).is_file()


def is_small(rows: int) -> bool:
    return rows < SMALL_ROWS


def read_encoded(path: Path, ids: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """Rows of a table file as stored (uint8 [len(ids) x row_bytes]), every block they are in checked;
    through a mapping of the file (the export's and training's reads, not the server's)."""
    header = read_header(path)
    rb, per = row_bytes(header.fmt, header.dim), per_block(header.fmt, header.dim)
    ids = np.asarray(ids, np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= header.rows):
        raise TableFileError(f"{path}: an id outside its {header.rows} rows")
    mapped = np.memmap(path, np.uint8, "r")
    blocks = mapped[BLOCK:].reshape(-1, BLOCK)
    out = np.empty((len(ids), rb), np.uint8)
    t = _native()
    span = np.arange(rb)
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        for b in np.unique(part // per):
            if t.check_blocks(np.ascontiguousarray(blocks[b]), int(b)) != -1:
                raise TableFileError(f"{path}: block {int(b)} fails its checksum")
        at = (part // per) * BLOCK + (part % per) * rb
        out[start:start + len(part)] = mapped[BLOCK:][at[:, None] + span]
    return out


def read_delta(version_dir: Path, delta: Delta, fmt: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A table's delta: (sorted ids int64 [n], encoded rows uint8 [n x row_bytes]), every block checked."""
    ids = np.load(Path(version_dir) / delta.ids)
    rows = read_all_rows(Path(version_dir) / delta.file) if delta.rows else np.zeros((0, row_bytes(fmt, dim)), np.uint8)
    if len(ids) != len(rows):
        raise TableFileError(f"{Path(version_dir) / delta.file}: {len(rows)} rows for {len(ids)} ids")
    return np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(rows, np.uint8)


def stored_rows(version_dir: Path, entry: TableEntry, fmt: str, dim: int, ids: np.ndarray) -> np.ndarray:
    """A table's rows as a release serves them (its file, its delta over it), float32 [len(ids) x dim]."""
    data = read_encoded(Path(version_dir) / entry.file, ids)
    if entry.delta is not None and entry.delta.rows:
        delta_ids, delta_rows = read_delta(version_dir, entry.delta, fmt, dim)
        at = np.searchsorted(delta_ids, ids)
        hit = (at < len(delta_ids)) & (delta_ids[np.minimum(at, len(delta_ids) - 1)] == ids)
        data[hit] = delta_rows[at[hit]]
    return decode(data, fmt, dim)


def predicted_hit_rates(version_dir: Path, budget_bytes: int) -> dict[str, float]:
    """The hit rate training's counts predict for a hot tier of ``budget_bytes`` over this step's large
    tables: the tier holding the rows training looked up most (across the tables), each table's share of
    its lookups that land there (a small table's: 1.0), and ``overall`` over every table's lookups."""
    manifest = TablesManifest.load(version_dir)
    rb = row_bytes(manifest.format, manifest.dim)
    slots = budget_bytes // (rb + 9)  # a slot: the row, its 8-byte key and its CLOCK bit
    with np.load(Path(version_dir) / TABLES_DIR / COUNTS) as counts:
        per_table = {t.name: counts[f"{t.name}.counts"].astype(np.int64) for t in manifest.tables}
    big = [t.name for t in manifest.tables if not t.small]
    pooled = np.concatenate([per_table[n] for n in big]) if big else np.zeros(0, np.int64)
    owner = np.concatenate([np.full(len(per_table[n]), k) for k, n in enumerate(big)]) if big else np.zeros(0, np.int64)
    hot = np.argsort(-pooled, kind="stable")[:slots]
    found, total_hits, total = {}, 0, 0
    for t in manifest.tables:
        lookups = int(per_table[t.name].sum())
        hits = lookups if t.small else int(pooled[hot][owner[hot] == big.index(t.name)].sum())
        found[t.name] = hits / lookups if lookups else 1.0
        total_hits += hits
        total += lookups
    found["overall"] = total_hits / total if total else 1.0
    return found


def cold_key(prefix: str, step: str, version_dir: Path, entry: TableEntry) -> str:
    """A large table's keys in the cold tier in Redis (``<key>:header``, ``<key>:<block>``): named after the
    version folder whose file it is, so that releases sharing a file share its keys."""
    return f"{prefix}:{step}:{entry.shared_from or Path(version_dir).name}:{entry.name}"


def to_redis(client, version_dir: Path, step: str, prefix: str, log=print, chunk_blocks: int = 256) -> int:
    """Write a step's large tables into Redis (a client of redis-py, one node or a cluster): each table's header
    and blocks, as they are on disk (their checksums with them), under :func:`cold_key`. A table whose header is
    already there (a file shared with a release written before) is skipped. Returns the bytes written."""
    manifest = TablesManifest.load(version_dir)
    written = 0
    for entry in manifest.tables:
        if entry.small:
            continue
        key = cold_key(prefix, step, version_dir, entry)
        path = Path(version_dir) / entry.file
        header = path.read_bytes()[:BLOCK] if path.stat().st_size >= BLOCK else b""
        if client.get(f"{key}:header") == header:
            log(f"{step} {entry.name}: already in the cold tier ({key})")
            continue
        with open(path, "rb") as handle:
            handle.seek(BLOCK)
            block = 0
            while True:
                data = handle.read(chunk_blocks * BLOCK)
                if not data:
                    break
                pipe = client.pipeline(transaction=False)
                for k in range(len(data) // BLOCK):
                    pipe.set(f"{key}:{block + k}", data[k * BLOCK:(k + 1) * BLOCK])
                pipe.execute()
                block += len(data) // BLOCK
                written += len(data)
        client.set(f"{key}:header", header)  # last: a reader finds the table only once every block is there
        written += BLOCK
        log(f"{step} {entry.name}: {block:,} blocks into the cold tier ({key})")
    return written
