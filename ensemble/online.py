"""The online feature store: each entity's latest features in Redis, read when a ranking request
names a user and item ids instead of sending their features.

Layout in the store (one dataset spec per key prefix, ``ensemble:<spec name>``):

- ``<prefix>:meta``: JSON describing the stored rows (per side: its key column, the key's index in the
  side's categorical values, how many continuous and categorical values a row holds), written by
  ``ensemble materialize``; the server checks it against the ranker's widths before the first lookup.
- ``<prefix>:context:<id>`` and ``<prefix>:candidate:<id>``: one entity's row (:func:`encode_row`):
  its freshness (the spec's time column of the latest row materialized, seconds since the epoch),
  its side's continuous values as float32 and its categorical values as bytes, exactly the values a
  ranking request with inline features carries for it (the key's own value included).

A lookup (:class:`FeatureLookup`) reads whatever its in-process cache (bounded in entries, each kept
at most ``ttl_s``) does not hold with one ``MGET`` (Redis Cluster: one pipelined ``MGET`` per node),
and builds the four tensors of the equivalent inline request. Every unusual case is counted by
reason (:data:`REASONS`).
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import numpy as np

CONTEXT, CANDIDATE = "context", "candidate"
_HEAD = struct.Struct("<dHH")  # freshness, continuous values, categorical values
_LENGTH = struct.Struct("<I")

# What a lookup counts (ensemble_store_lookups_total{reason}): entities found in the cache or the store,
# unknown users (scored with default context features), unknown items (dropped or scored with defaults),
# stale entities (served or refused), and lookups that failed because the store did not answer.
REASONS = ("cache_hit", "store_hit", "unknown_user", "unknown_item", "stale_served", "stale_refused",
           "store_unavailable")

UNKNOWN_ITEMS = ("drop", "default")  # an unknown item is dropped from the ranking (its index answered) or scored
STALE = ("serve", "refuse")


class StoreError(Exception):
    """The store did not answer in time or could not be reached (503 / UNAVAILABLE, naming it)."""


class Unservable(ValueError):
    """A request the store's contents cannot serve (400 / INVALID_ARGUMENT): a stale entity refused,
    no candidates left, or a store holding another dataset."""


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


def redacted(url: str) -> str:
    """The store's URL without its password (what errors and logs name)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username + ':' if parts.username else ''}***@{host}{f':{parts.port}' if parts.port else ''}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def connect(url: str, timeout_s: float = 1.0):
    """A client of the store at ``url`` (``redis://`` or ``rediss://``, with auth), in cluster mode when
    the server says it is a cluster node. No retries: a failure is answered at once, not after backoff."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                   health_check_interval=0)
    single = redis.Redis.from_url(url, **options)
    try:
        clustered = single.info("cluster").get("cluster_enabled") == 1
    except redis.RedisError as exc:
        single.close()
        raise StoreError(f"the feature store {redacted(url)} is unreachable: {exc}") from None
    if not clustered:
        return single
    single.close()
    from redis.cluster import RedisCluster

    return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 retry=Retry(NoBackoff(), 0))


def mget(client, keys: list[bytes]) -> list[bytes | None]:
    """The values of ``keys`` in one round trip per store node."""
    if not keys:
        return []
    if hasattr(client, "mget_nonatomic"):  # a cluster client: one pipelined MGET per node
        return client.mget_nonatomic(keys)
    return client.mget(keys)


@dataclass
class Rows:
    """The tensors of the inline request a lookup stands for, and what it found."""

    context_dense: np.ndarray
    context_categorical: np.ndarray
    candidate_dense: np.ndarray
    candidate_categorical: np.ndarray
    kept: np.ndarray  # int64 indices of the requested items the rows hold, in request order
    dropped: np.ndarray  # int32 indices of the requested items dropped (unknown), in request order
    counts: dict[str, int] = field(default_factory=dict)


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


class FeatureLookup:
    """Lookups of one dataset's entities in the store at ``url``, for the ``rank`` model.

    Thread-safe (the rank model's instances share it). ``cache_entries`` bounds the cache (0: no
    cache), ``ttl_s`` how long an entity is served from it; ``timeout_s`` bounds a store round trip
    (and is shortened to the request's remaining deadline); ``max_staleness_s`` (None: no bound) and
    ``stale`` say what happens to an entity whose freshness is older; ``unknown_items`` what happens to
    an item id the store does not hold."""

    def __init__(self, url: str, dataset: str, *, cache_entries: int = 100_000, ttl_s: float = 60.0,
                 timeout_s: float = 0.05, max_staleness_s: float | None = None, stale: str = "serve",
                 unknown_items: str = "drop", clock=time.time):
        if unknown_items not in UNKNOWN_ITEMS:
            raise ValueError(f"unknown_items must be one of {', '.join(UNKNOWN_ITEMS)}, not {unknown_items!r}")
        if stale not in STALE:
            raise ValueError(f"stale must be one of {', '.join(STALE)}, not {stale!r}")
        self.url, self.dataset = url, dataset
        self.cache_entries, self.ttl_s, self.timeout_s = int(cache_entries), float(ttl_s), float(timeout_s)
        self.max_staleness_s, self.stale, self.unknown_items = max_staleness_s, stale, unknown_items
        self.clock = clock
        self._client = None
        self._sides: dict[str, Side] | None = None
        self._cache: OrderedDict[bytes, tuple[float, object]] = OrderedDict()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(REASONS, 0)
        self.lookup_seconds = 0.0  # summed over store round trips
        self.lookups = 0  # store round trips

    def counters(self) -> dict[str, float]:
        """Everything counted so far: :data:`REASONS`, ``round_trips`` and ``round_trip_seconds``."""
        with self._lock:
            return {**self.counts, "round_trips": self.lookups, "round_trip_seconds": self.lookup_seconds}

    # -- the store ---------------------------------------------------------------------------------------
    def _store(self):
        if self._client is None:
            self._client = connect(self.url, self.timeout_s)
        return self._client

    def _fail(self, exc: Exception) -> StoreError:
        with self._lock:
            self.counts["store_unavailable"] += 1
        client, self._client = self._client, None  # reconnect next time (a restarted store, a failover)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        return StoreError(f"the feature store {redacted(self.url)} did not answer: {type(exc).__name__}: {exc}")

    def _fetch(self, keys: list[bytes], budget_s: float) -> list[bytes | None]:
        """One round trip (per store node); it waits at most ``timeout_s``, which an operator sets below
        the server's latency objective (a request with less time left than that is refused first)."""
        import redis

        if budget_s <= 0:
            raise StoreError(f"no time left before the request's deadline to ask the feature store "
                             f"{redacted(self.url)}")
        try:
            client = self._store()
            started = time.monotonic()
            values = mget(client, keys)
        except StoreError as exc:
            raise self._fail(exc) from None
        except (redis.RedisError, OSError) as exc:
            raise self._fail(exc) from None
        with self._lock:
            self.lookups += 1
            self.lookup_seconds += time.monotonic() - started
        return values

    def sides(self, budget_s: float = 1.0) -> dict[str, Side]:
        """The stored rows' layout (read once from the meta record)."""
        if self._sides is None:
            (meta,) = self._fetch([meta_key(self.dataset).encode()], budget_s)
            if meta is None:
                raise Unservable(f"the feature store {redacted(self.url)} holds no {self.dataset} features: "
                                   f"run `ensemble materialize --dataset {self.dataset} --store URL`")
            record = json.loads(meta)
            self._sides = {side: Side(**record[side]) for side in (CONTEXT, CANDIDATE) if record.get(side)}
        return self._sides

    # -- the cache ---------------------------------------------------------------------------------------
    def _cached(self, key: bytes, now: float):
        if not self.cache_entries:
            return None
        found = self._cache.get(key)
        if found is None or now - found[0] > self.ttl_s:
            return None
        return found[1]

    def _keep(self, key: bytes, row, now: float) -> None:
        if not self.cache_entries:
            return
        self._cache[key] = (now, row)
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    # -- a lookup ----------------------------------------------------------------------------------------
    def rows(self, user_id: bytes | None, item_ids: list[bytes], budget_s: float = math.inf,
             context_dense: np.ndarray | None = None, context_categorical: np.ndarray | None = None) -> Rows:
        """The inline request's tensors for ``user_id`` (None: the spec has no context) and ``item_ids``
        (duplicates are looked up once and scored each time), within ``budget_s`` seconds. Request-time
        context values, when given, replace the stored context row. Raises :class:`StoreError` when the
        store does not answer, :class:`Unservable` when it cannot serve the request."""
        started = time.monotonic()
        sides = self.sides(min(budget_s, self.timeout_s))
        if CANDIDATE not in sides:
            raise Unservable(f"the {self.dataset} features in the store have no candidate key")
        wanted_user = user_id is not None and CONTEXT in sides and context_dense is None
        now = time.monotonic()
        keys = {}
        if wanted_user:
            keys[entity_key(self.dataset, CONTEXT, user_id)] = None
        for item in item_ids:
            keys.setdefault(entity_key(self.dataset, CANDIDATE, item), None)
        counts = dict.fromkeys(REASONS, 0)
        missing = []
        with self._lock:
            for key in keys:
                row = self._cached(key, now)
                if row is None:
                    missing.append(key)
                else:
                    keys[key] = row
                    counts["cache_hit"] += 1
        if missing:
            values = self._fetch(missing, budget_s - (time.monotonic() - started))
            with self._lock:
                for key, value in zip(missing, values):
                    if value is None:
                        continue
                    row = decode_row(value)
                    keys[key] = row
                    counts["store_hit"] += 1
                    self._keep(key, row, now)
        wall = self.clock()

        def fresh(row, what: str) -> None:
            if self.max_staleness_s is None or wall - row[0] <= self.max_staleness_s:
                return
            if self.stale == "refuse":
                counts["stale_refused"] += 1
                raise Unservable(f"{what} is stale: its features are {wall - row[0]:.0f} s old, past the bound "
                                   f"of {self.max_staleness_s:g} s")
            counts["stale_served"] += 1

        try:
            context = sides.get(CONTEXT)
            if context_dense is not None or context is None:
                c_dense = np.asarray(context_dense if context_dense is not None else np.zeros(0), np.float32)
                c_cats = np.asarray(context_categorical if context_categorical is not None else np.zeros(0), object)
            else:
                row = keys[entity_key(self.dataset, CONTEXT, user_id)] if user_id is not None else None
                if row is None:
                    counts["unknown_user"] += 1
                    c_dense, cats = context.default(user_id or b"")
                else:
                    fresh(row, f"user {user_id.decode(errors='replace')!r}")
                    c_dense, cats = row[1], row[2]
                c_cats = np.array(cats, object)
            candidate = sides[CANDIDATE]
            dense_rows, cat_rows, kept, dropped = [], [], [], []
            for i, item in enumerate(item_ids):
                row = keys[entity_key(self.dataset, CANDIDATE, item)]
                if row is None:
                    counts["unknown_item"] += 1
                    if self.unknown_items == "drop":
                        dropped.append(i)
                        continue
                    dense, cats = candidate.default(item)
                else:
                    fresh(row, f"item {item.decode(errors='replace')!r}")
                    dense, cats = row[1], row[2]
                dense_rows.append(dense)
                cat_rows.append(cats)
                kept.append(i)
        finally:
            with self._lock:
                for reason, count in counts.items():
                    self.counts[reason] += count
        n = len(kept)
        cand_dense = np.stack(dense_rows) if n else np.zeros((0, candidate.dense), np.float32)
        cand_cats = np.empty((n, candidate.categorical), object)
        for r, cats in enumerate(cat_rows):
            cand_cats[r] = cats
        return Rows(c_dense, c_cats, cand_dense, cand_cats, np.asarray(kept, np.int64),
                    np.asarray(dropped, np.int32), counts)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass
            self._client = None


# What `ensemble serve --store URL ...` hands tritonserver (the rank model reads them at load): the URL
# stays out of the model repository and the command line (a Kubernetes Secret sets it the same way).
ENV = {"url": "ENSEMBLE_STORE_URL", "timeout_ms": "ENSEMBLE_STORE_TIMEOUT_MS",
       "cache_entries": "ENSEMBLE_STORE_CACHE_ENTRIES", "ttl_s": "ENSEMBLE_STORE_CACHE_TTL_S",
       "unknown_items": "ENSEMBLE_STORE_UNKNOWN_ITEMS", "max_staleness_s": "ENSEMBLE_STORE_MAX_STALENESS_S",
       "stale": "ENSEMBLE_STORE_STALE"}


@dataclass(frozen=True)
class StoreSettings:
    """How the rank model uses the store (``ensemble serve --store URL`` and its ``--store-*`` options)."""

    url: str
    timeout_ms: float = 50.0
    cache_entries: int = 100_000
    ttl_s: float = 60.0
    unknown_items: str = "drop"
    max_staleness_s: float | None = None
    stale: str = "serve"

    def __post_init__(self):
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"the store's URL must be redis://, rediss:// or unix://, not {redacted(self.url)!r}")
        if self.unknown_items not in UNKNOWN_ITEMS:
            raise ValueError(f"unknown items: one of {', '.join(UNKNOWN_ITEMS)}, not {self.unknown_items!r}")
        if self.stale not in STALE:
            raise ValueError(f"stale entities: one of {', '.join(STALE)}, not {self.stale!r}")
        if not self.timeout_ms > 0 or self.cache_entries < 0 or not self.ttl_s >= 0:
            raise ValueError("the store's timeout must be > 0, its cache entries and TTL >= 0")
        if self.max_staleness_s is not None and not self.max_staleness_s > 0:
            raise ValueError("the staleness bound must be > 0 seconds")

    def environment(self) -> dict[str, str]:
        out = {ENV[k]: str(v) for k, v in self.__dict__.items() if v is not None}
        return out

    @classmethod
    def from_environment(cls, env) -> "StoreSettings | None":
        """The settings tritonserver's environment holds; None without a store URL."""
        if not env.get(ENV["url"]):
            return None
        kinds = {"timeout_ms": float, "cache_entries": int, "ttl_s": float, "max_staleness_s": float}
        values = {k: kinds.get(k, str)(env[name]) for k, name in ENV.items() if env.get(name)}
        return cls(**values)

    def lookup(self, dataset: str) -> FeatureLookup:
        return FeatureLookup(self.url, dataset, cache_entries=self.cache_entries, ttl_s=self.ttl_s,
                             timeout_s=self.timeout_ms / 1000, max_staleness_s=self.max_staleness_s,
                             stale=self.stale, unknown_items=self.unknown_items)
