"""Lookups of one dataset's entities in the online store (:class:`FeatureLookup`, for the ``rank`` model) and
the settings ``ensemble serve --store`` hands it (:class:`StoreSettings`)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ensemble import native
from ensemble.online.codec import CANDIDATE, CONTEXT, Side, entity_key, meta_key
from ensemble.online.transport import StoreError, connect, mget, redacted

# What a lookup counts (ensemble_store_lookups_total{reason}): entities found in the cache or the store,
# unknown users (scored with default context features), unknown items (dropped or scored with defaults),
# stale entities (served or refused), and lookups that failed because the store did not answer.
REASONS = ("cache_hit", "store_hit", "unknown_user", "unknown_item", "stale_served", "stale_refused",
           "store_unavailable")

UNKNOWN_ITEMS = ("drop", "default")  # an unknown item is dropped from the ranking (its index answered) or scored
STALE = ("serve", "refuse")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")



class Unservable(ValueError):
    """A request the store's contents cannot serve (400 / INVALID_ARGUMENT): a stale entity refused,
    no candidates left, or a store holding another dataset."""



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



class FeatureLookup:
    """Lookups of one dataset's entities in the store at ``url``, for the ``rank`` model.

    Thread-safe (the rank model's instances share it). ``cache_entries`` bounds the cache (0: no
    cache), ``ttl_s`` how long an entity is served from it; ``timeout_s`` bounds a store round trip
    (a request whose deadline has passed is refused before it); ``max_staleness_s`` (None: no bound) and
    ``stale`` say what happens to an entity whose freshness is older; ``unknown_items`` what happens to
    an item id the store does not hold. Staleness is counted on ``clock`` (wall time, as the stored
    freshness), the cache's TTL on ``cache_clock`` (monotonic seconds)."""

    def __init__(self, url: str, dataset: str, *, cache_entries: int = 100_000, ttl_s: float = 60.0,
                 timeout_s: float = 0.05, max_staleness_s: float | None = None, stale: str = "serve",
                 unknown_items: str = "drop", clock=time.time, cache_clock=time.monotonic):
        _check_choice("unknown_items", unknown_items, UNKNOWN_ITEMS)
        _check_choice("stale", stale, STALE)
        self.url, self.dataset = url, dataset
        self.cache_entries, self.ttl_s, self.timeout_s = int(cache_entries), float(ttl_s), float(timeout_s)
        self.max_staleness_s, self.stale, self.unknown_items = max_staleness_s, stale, unknown_items
        self.clock, self.cache_clock = clock, cache_clock
        self._client = None
        self._sides: dict[str, Side] | None = None
        # The cache: per side, id -> an item's stored value split (Side.split) or a user's decoded
        # (Side.row), and when each entry came (insertion order: the oldest first), so that expired and
        # surplus entries leave from the front.
        self._cache: dict[str, dict[bytes, tuple]] = {CONTEXT: {}, CANDIDATE: {}}
        self._born: deque[tuple[float, str, bytes]] = deque()
        self._born_at: dict[tuple[str, bytes], float] = {}
        self._prefix = {side: entity_key(dataset, side, b"") for side in (CONTEXT, CANDIDATE)}
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
        the server's latency objective (a request whose deadline has passed is refused first)."""
        import redis

        if budget_s <= 0:
            raise StoreError(f"no time left before the request's deadline to ask the feature store "
                             f"{redacted(self.url)}")
        try:
            client = self._store()
            started = time.monotonic()
            values = mget(client, keys)
        except (StoreError, redis.RedisError, OSError) as exc:
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
    def _keep(self, side: str, entity_id: bytes, value: tuple, now: float) -> None:
        """Cache an entity's row (with the lock held); past the bound (both sides' entries together) the
        oldest leave."""
        if not self.cache_entries:
            return
        self._cache[side][entity_id] = value
        self._born_at[(side, entity_id)] = now
        self._born.append((now, side, entity_id))
        while len(self._born_at) > self.cache_entries:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        born, side, entity_id = self._born.popleft()
        if self._born_at.get((side, entity_id)) == born:  # not cached again since
            del self._born_at[(side, entity_id)]
            del self._cache[side][entity_id]

    def _expire(self, now: float) -> None:
        """Entries older than the TTL leave (with the lock held)."""
        while self._born and now - self._born[0][0] > self.ttl_s:
            self._drop_oldest()

    # -- a lookup ----------------------------------------------------------------------------------------
    def rows(self, user_id: bytes | None, item_ids: list[bytes], budget_s: float = math.inf,
             context_dense: np.ndarray | None = None, context_categorical: np.ndarray | None = None) -> Rows:
        """The inline request's tensors for ``user_id`` (None: the spec has no context) and ``item_ids``
        (duplicates are looked up once and scored each time), within ``budget_s`` seconds. Request-time
        context values, when given, replace the stored context row. Raises :class:`StoreError` when the
        store does not answer, :class:`Unservable` when it cannot serve the request."""
        started = time.monotonic()
        sides = self.sides(min(budget_s, self.timeout_s))
        candidate, context = sides.get(CANDIDATE), sides.get(CONTEXT)
        if candidate is None:
            raise Unservable(f"the {self.dataset} features in the store have no candidate key")
        counts = dict.fromkeys(REASONS, 0)
        wanted_user = user_id is not None and context is not None and context_dense is None
        if not isinstance(item_ids, list):
            item_ids = list(item_ids)
        now = self.cache_clock()
        if self.cache_entries and item_ids:  # every entity cached: one C call joins their rows
            with self._lock:
                self._expire(now)
                joined = native.gather(self._cache[CANDIDATE], item_ids)
                user_row = self._cache[CONTEXT].get(user_id) if wanted_user else None
            if joined is not None and (user_row is not None or not wanted_user):
                counts["cache_hit"] = len(set(item_ids)) + wanted_user
                return self._assemble(candidate, context, user_id, user_row, item_ids, joined, counts,
                                      context_dense, context_categorical)
        # Every distinct id once: its stored value, split (Side.split), from the cache, else from the store.
        unique = dict.fromkeys(item_ids)
        user_value = None
        missing = list(unique)
        with self._lock:
            if self.cache_entries:
                self._expire(now)
                found = dict(zip(unique, map(self._cache[CANDIDATE].get, unique)))
                missing = [item for item, hit in found.items() if hit is None] if None in found.values() else []
                if wanted_user:
                    user_value = self._cache[CONTEXT].get(user_id)
            else:
                found = unique
        missing_user = wanted_user and user_value is None
        counts["cache_hit"] = len(unique) - len(missing) + (wanted_user and not missing_user)
        if missing or missing_user:
            prefix = self._prefix[CANDIDATE]
            keys = [prefix + item for item in missing]
            if missing_user:
                keys.append(self._prefix[CONTEXT] + user_id)
            values = self._fetch(keys, budget_s - (time.monotonic() - started))
            if missing_user:
                user_value = values.pop()
            fixed = candidate.head.itemsize
            parts = [None if v is None else (v[:fixed], v[fixed:]) for v in values]
            fetched = [part for part in parts if part is not None]
            try:
                if fetched:
                    heads, cats = zip(*fetched)
                    candidate.check(b"".join(heads), b"".join(cats), len(fetched))
                if missing_user and user_value is not None:
                    user_value = context.row(user_value)
            except ValueError as exc:
                raise Unservable(f"{exc} ({self.dataset})") from None
            found.update(zip(missing, parts))
            if self.cache_entries:
                with self._lock:
                    for item, part in zip(missing, parts):
                        if part is not None:
                            self._keep(CANDIDATE, item, part, now)
                    if missing_user and user_value is not None:
                        self._keep(CONTEXT, user_id, user_value, now)
            counts["store_hit"] = len(values) - values.count(None) + (missing_user and user_value is not None)
        ids, kept, dropped = item_ids, None, None
        if None in found.values():
            counts["unknown_item"] += sum(hit is None for hit in found.values())
            if self.unknown_items == "drop":
                kept_list = [i for i, item in enumerate(item_ids) if found[item] is not None]
                dropped = np.asarray([i for i, item in enumerate(item_ids) if found[item] is None], np.int32)
                kept = np.asarray(kept_list, np.int64)
                ids = [item_ids[i] for i in kept_list]
            else:
                for item, hit in list(found.items()):
                    if hit is None:
                        found[item] = candidate.split(candidate.default_value(item))
        joined = native.gather(found, ids) if ids else (b"", b"")
        return self._assemble(candidate, context, user_id, user_value, ids, joined, counts, context_dense,
                              context_categorical, kept, dropped)

    def _assemble(self, candidate: Side, context: Side | None, user_id: bytes | None, user_row, ids: list[bytes],
                  joined: tuple[bytes, bytes], counts: dict, context_dense, context_categorical, kept=None,
                  dropped=None) -> Rows:
        """The request's rows from the user's decoded row (None: unknown) and the items' joined rows."""
        wall = self.clock()
        try:
            if context_dense is not None or context is None:
                c_dense = np.asarray(context_dense if context_dense is not None else np.zeros(0), np.float32)
                c_cats = np.asarray(context_categorical if context_categorical is not None else np.zeros(0), object)
            elif user_row is None:
                counts["unknown_user"] += 1
                c_dense, cats = context.default(user_id or b"")
                c_cats = np.array(cats, object)
            else:
                freshness, c_dense, c_cats = user_row
                self._fresh(freshness, wall, counts, lambda: f"user {user_id.decode(errors='replace')!r}")
            if ids:
                freshness, cand_dense, cand_cats = candidate.decode(joined[0], joined[1], len(ids))
                if self.max_staleness_s is not None:
                    old = wall - freshness > self.max_staleness_s
                    if old.any():
                        first = int(np.argmax(old))
                        self._fresh(float(freshness[first]), wall, counts,
                                    lambda: f"item {cand_cats[first, candidate.key_index].decode(errors='replace')!r}",
                                    int(old.sum()))
            else:
                cand_dense = np.zeros((0, candidate.dense), np.float32)
                cand_cats = np.empty((0, candidate.categorical), object)
        finally:
            with self._lock:
                for reason, count in counts.items():
                    self.counts[reason] += count
        if kept is None:
            kept, dropped = np.arange(len(ids), dtype=np.int64), np.empty(0, np.int32)
        return Rows(c_dense, c_cats, cand_dense, cand_cats, kept, dropped, counts)

    def _fresh(self, freshness: float, wall: float, counts: dict, what, stale: int = 1) -> None:
        """Count (or refuse) ``stale`` entities past the staleness bound, the first of them ``freshness``."""
        if self.max_staleness_s is None or wall - freshness <= self.max_staleness_s:
            return
        if self.stale == "refuse":
            counts["stale_refused"] += stale
            raise Unservable(f"{what()} is stale: its features are {wall - freshness:.0f} s old, past the bound "
                             f"of {self.max_staleness_s:g} s")
        counts["stale_served"] += stale

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
        _check_choice("unknown_items", self.unknown_items, UNKNOWN_ITEMS)
        _check_choice("stale", self.stale, STALE)
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
