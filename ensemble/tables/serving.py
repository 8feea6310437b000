"""A row store DLRM step, served: its tables in a :class:`ensemble.native._tables.Store` (small ones in RAM,
large ones through the hot tier and the disk), its MLPs in the engine its release records, both in
one ``_tables.Dlrm`` that the chain in C calls without Python (``ensemble/native/_chain.c``).

The server's settings come from its environment (``ensemble serve`` sets them from its flags):

- ``ENSEMBLE_EMBEDDING_CACHE_GIB`` (``--embedding-cache-gib``): the hot tier's budget for the whole
  server, split between its row store DLRMs by their large tables' rows;
- ``ENSEMBLE_TABLE_ADMISSION`` (``always``, ``second``, ``none``), ``ENSEMBLE_TABLE_IO`` (``uring``,
  ``pread``, ``mmap``), ``ENSEMBLE_TABLE_DEPTH`` (the cold reads' queue depth);
- ``ENSEMBLE_TABLE_READ_TIMEOUT_MS``: how long a call's cold reads may take when the call names no
  deadline (then the request is answered UNAVAILABLE, naming the table).

At load the step checks every table file's header (a missing or foreign file fails the load, naming
it) and its engine against the reference MLPs on gathered rows; then a thread fills the hot tier from
the warm file while the server already answers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ensemble.tables import files
from ensemble.tables.files import TablesManifest
from ensemble.tables.mlp import MlpWeights, OpenVinoMlp

LOG = logging.getLogger(__name__)
CACHE_ENV = "ENSEMBLE_EMBEDDING_CACHE_GIB"
ADMISSION_ENV = "ENSEMBLE_TABLE_ADMISSION"
IO_ENV = "ENSEMBLE_TABLE_IO"
DEPTH_ENV = "ENSEMBLE_TABLE_DEPTH"
READ_TIMEOUT_ENV = "ENSEMBLE_TABLE_READ_TIMEOUT_MS"
COLD_ENV = "ENSEMBLE_TABLE_COLD"  # redis://host:port[,host:port...]: the large tables' blocks from Redis
REDIS_PREFIX_ENV = "ENSEMBLE_TABLE_REDIS_PREFIX"
DEFAULT_REDIS_PREFIX = "ensemble-tables"
DEFAULT_CACHE_GIB = 6.0
# Chosen by measurement (benchmarks.tables --parts policies, docs/tables.md): every missed row is admitted.
# On Zipf keys (alpha 1.05) at the 6 GiB tier's size its hit rate stayed above "second"'s at every point of
# 300,000 requests (95.8% against 94.9% of unique keys; the large tables 87.0% against 84.2%).
DEFAULT_ADMISSION = "always"
# Chosen by measurement (build/io probes of one DLRM's 100-row Zipf gathers, alternating): 128 reads in flight a
# thread read ~514 blocks in 6.4-6.6 ms against 8.0-8.4 at 32 and 7.0 at 64; 256 no faster.
DEFAULT_DEPTH = 128
DEFAULT_READ_TIMEOUT_MS = 1000.0
ENGINE_AGREEMENT = {"c": 1e-5, "openvino-f32": 1e-5, "openvino-bf16": 1e-3, "openvino-int8": 0.05}


@dataclass(frozen=True)
class Settings:
    """How a server runs its row stores (from its environment)."""

    cache_bytes: int
    admission: str
    io: str
    depth: int
    read_timeout_ms: float
    cold: str = "disk"  # or redis://host:port[,host:port...] (a cluster's nodes, or one node)
    redis_prefix: str = DEFAULT_REDIS_PREFIX

    @classmethod
    def from_environment(cls) -> "Settings":
        from ensemble.native import _tables

        io = os.environ.get(IO_ENV) or ("uring" if _tables.has_uring() else "pread")
        return cls(int(float(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_GIB) * 2**30),
                   os.environ.get(ADMISSION_ENV) or DEFAULT_ADMISSION, io,
                   int(os.environ.get(DEPTH_ENV) or DEFAULT_DEPTH),
                   float(os.environ.get(READ_TIMEOUT_ENV) or DEFAULT_READ_TIMEOUT_MS),
                   os.environ.get(COLD_ENV) or "disk", os.environ.get(REDIS_PREFIX_ENV) or DEFAULT_REDIS_PREFIX)


def cold_is_remote() -> bool:
    """Whether this server reads its large tables from a cold tier in Redis (then their files need not be here)."""
    return (os.environ.get(COLD_ENV) or "").startswith("redis://")


# Large rows of every row store step this process loads, by step: the hot tier's budget is split by them.
_BIG_ROWS: dict[str, int] = {}


def big_rows(manifest: TablesManifest) -> int:
    return sum(t.rows for t in manifest.tables if not t.small)


def budget_share(step: str, manifest: TablesManifest, siblings: dict[str, int] | None = None) -> float:
    """This step's share of the server's hot tier: its large rows over every row store step's (the
    release's other DLRM counted as well, found beside it)."""
    mine = big_rows(manifest)
    others = sum(v for k, v in (siblings or {}).items() if k != step)
    return mine / (mine + others) if mine + others else 1.0


def _siblings(version_dir: Path, step: str) -> dict[str, int]:
    """The other DLRM step's large rows in the same release (the ranker's release.json names it)."""
    repository = Path(version_dir).parent.parent
    found = {}
    for other in ("dlrm_torch", "dlrm_tf"):
        if other == step:
            continue
        folder = repository / other
        versions = [p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()] if folder.is_dir() else []
        same = folder / Path(version_dir).name
        candidate = same if same.is_dir() else (max(versions, key=lambda p: int(p.name)) if versions else None)
        if candidate is not None and files.has_tables(candidate):
            found[other] = big_rows(TablesManifest.load(candidate))
    return found


def open_store(version_dir: Path, manifest: TablesManifest, budget_bytes: int, settings: Settings):
    """The step's ``_tables.Store`` (every header checked, deltas read whole); with a cold tier in Redis the large
    tables' blocks come from there (their files need not be on this machine)."""
    from ensemble.native import _tables

    redis = settings.cold.startswith("redis://")
    step = Path(version_dir).parent.name
    specs = []
    for t in manifest.tables:
        delta_ids = delta_rows = None
        if t.delta is not None and t.delta.rows:
            delta_ids, delta_rows = files.read_delta(version_dir, t.delta, manifest.format, manifest.dim)
        key = files.cold_key(settings.redis_prefix, step, version_dir, t) if redis and not t.small else ""
        specs.append((t.name, str(Path(version_dir) / t.file), t.rows, manifest.dim, t.small, delta_ids, delta_rows, key))
    return _tables.Store(specs, budget_bytes, settings.admission, settings.cold if redis else settings.io, settings.depth)


def mlp_engine(version_dir: Path, weights: MlpWeights, threads: int = 2):
    """(name, engine callable, its native object) as ``engine.json`` records (the C pass when it does not)."""
    record_path = Path(version_dir) / "engine.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"engine": "c"}
    name = record.get("engine", "c")
    precision = record.get("precision", "f32")
    if name == "openvino":
        ir = Path(version_dir) / "openvino" / ("model-int8.xml" if precision == "int8" else "model.xml")
        try:
            engine = OpenVinoMlp(ir, precision, weights.n_tables, weights.dim, weights.n_dense, threads)
            return f"openvino-{precision}", engine, engine.native
        except Exception as exc:  # noqa: BLE001 - OpenVINO not built or failing: the C pass, said
            LOG.error("%s: the recorded engine openvino-%s cannot run here (%s); the C pass scores", version_dir, precision,
                      exc)
    c = weights.c_engine()
    return "c", c, c.native


def check_engine(name: str, engine, weights: MlpWeights, rows: int = 32, seed: int = 0) -> float:
    """The engine's largest difference from the reference MLPs on random gathered rows (raises when above
    its tolerance)."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(rows, weights.n_dense)).astype(np.float32)
    pooled = rng.uniform(-0.05, 0.05, size=(rows, weights.n_tables * weights.dim)).astype(np.float32)
    gap = float(np.abs(engine(dense, pooled) - weights.score(dense, pooled)).max())
    if not gap <= ENGINE_AGREEMENT.get(name, 1e-5):
        raise RuntimeError(f"the {name} engine differs from the reference MLPs by {gap:.2g}")
    return gap


class TableScorer:
    """A row store DLRM step: ``(dense_features [B x n_dense], category_ids [B x F]) -> [B x 1]``; ``kernel``
    (with ``native``, the ``_tables.Dlrm``) is what the chain calls."""

    def __init__(self, version_dir: Path, step: str, threads: int = 2, settings: Settings | None = None,
                 warm: bool = True):
        from ensemble.native import _tables

        version_dir = Path(version_dir)
        self.folder, self.step = version_dir, step
        self.settings = settings or Settings.from_environment()
        self.manifest = TablesManifest.load(version_dir)
        self.weights = MlpWeights.load(version_dir)
        share = budget_share(step, self.manifest, _siblings(version_dir, step))
        self.budget_bytes = int(self.settings.cache_bytes * share)
        start = time.perf_counter()
        self.store = open_store(version_dir, self.manifest, self.budget_bytes, self.settings)
        self.engine, engine, engine_native = mlp_engine(version_dir, self.weights, threads)
        check_engine(self.engine, engine, self.weights)
        self.native = _tables.Dlrm(self.store, engine_native, self.settings.read_timeout_ms / 1e3)
        self.kernel = self
        self.load_seconds = time.perf_counter() - start
        self.warmed = threading.Event()
        self.warm_thread = None
        if warm:
            self.warm_thread = threading.Thread(target=self._warm, name=f"{step}-warm", daemon=True)
            self.warm_thread.start()
        LOG.info("%s: %d tables in %s (%.1f GB on disk), hot tier %.2f GiB, engine %s, io %s, admission %s",
                 step, len(self.manifest.tables), self.manifest.format, self.manifest.disk_bytes() / 1e9,
                 self.budget_bytes / 2**30, self.engine, self.settings.io, self.settings.admission)

    def _warm(self) -> None:
        keys_path = self.folder / files.TABLES_DIR / files.WARM_KEYS
        try:
            if keys_path.is_file() and self.budget_bytes:
                self.store.warm(str(self.folder / files.TABLES_DIR / files.WARM_ROWS), np.load(keys_path))
        except Exception as exc:  # noqa: BLE001 - a warm file that fails: the tier fills from misses, said
            LOG.error("%s: the hot tier was not warmed: %s", self.step, exc)
        finally:
            self.warmed.set()

    @property
    def engines(self) -> tuple[str, str]:
        return self.step, self.engine

    def into(self, dense_features: np.ndarray, category_ids: np.ndarray, out: np.ndarray) -> None:
        self.native(np.ascontiguousarray(dense_features, np.float32), np.ascontiguousarray(category_ids, np.int64), out)

    def __call__(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(dense_features), np.float32)
        self.into(dense_features, category_ids, out)
        return out.reshape(-1, 1)

    def framework(self, dense_features: np.ndarray, category_ids: np.ndarray) -> np.ndarray:
        """The reference: the rows gathered by the store, the MLPs in numpy."""
        pooled = np.empty((len(dense_features), len(self.manifest.tables), self.manifest.dim), np.float32)
        self.store.gather(np.ascontiguousarray(category_ids, np.int64), pooled)
        return self.weights.score(dense_features, pooled).reshape(-1, 1)

    def stats(self) -> dict:
        return self.store.stats()
