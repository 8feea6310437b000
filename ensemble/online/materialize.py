"""``ensemble materialize``: each entity's latest features into the online store (ensemble/online/).

For each side of the spec that names a key (``[context] key``, ``[candidate] key``), the latest row of
every entity (by the spec's time column; the last in file order without one) becomes its stored row:
the side's continuous values as float32 and its categorical values as bytes, exactly as a ranking
request with inline features sends them, with the row's time as its freshness.

Incremental and idempotent: the stored values are read first (one ``MGET`` per batch) and an entity is
written only when its row differs from the stored one and is not older than it; a second run over the
same data writes nothing. ``check`` reports what the store holds per side and how stale it is.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from ensemble import online
from ensemble.dataset import DatasetSpec, Kind, Side

BATCH = 2_000  # entities per MGET / pipelined write


class MaterializeError(ValueError):
    """A spec or data that cannot be materialized (no key, no time values...)."""


@dataclass
class SideReport:
    side: str
    key: str
    entities: int  # distinct entities in the data
    written: int  # new or changed rows written
    unchanged: int  # rows the store already held
    kept_newer: int  # rows the store held with a later freshness (not overwritten)


@dataclass
class Report:
    dataset: str
    store: str
    sides: list[SideReport]
    seconds: float
    memory_before: int  # the store's used_memory (bytes), summed over its nodes
    memory_after: int

    def as_dict(self) -> dict:
        return asdict(self)


def _names(spec: DatasetSpec, kind: Kind, side: Side) -> tuple[str, ...]:
    return tuple(c.name for c in spec.columns if c.kind is kind and c.side is side)


def layout(spec: DatasetSpec) -> dict:
    """The meta record: per keyed side, its key, the key's index among the side's categorical values,
    and the row's widths."""
    record: dict = {"dataset": spec.name}
    for side in (Side.CONTEXT, Side.CANDIDATE):
        key = spec.key(side)
        if key is None:
            continue
        cats = _names(spec, Kind.CATEGORICAL, side)
        record[side.value] = {"key": key, "key_index": cats.index(key),
                              "dense": len(_names(spec, Kind.CONTINUOUS, side)), "categorical": len(cats)}
    return record


def latest_rows(spec: DatasetSpec, frame, side: Side) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
    """(entity ids, freshness [E], continuous [E x], categorical [E x]) of each entity's latest row."""
    from ensemble.features import transforms

    key = spec.key(side)
    columns = [*_names(spec, Kind.CONTINUOUS, side), *_names(spec, Kind.CATEGORICAL, side)]
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise MaterializeError(f"the data lacks {spec.name} {side.value} columns {missing[:5]}")
    if spec.time is not None:
        if spec.time not in frame.columns:
            raise MaterializeError(f"the data lacks the time column {spec.time!r}")
        frame = frame.sort_values(spec.time, kind="stable")
    ids = frame[key]
    known = ids.notna() & (ids.astype(str) != "")
    latest = frame[known].drop_duplicates(subset=[key], keep="last")
    dense = transforms.dense_array(latest, _names(spec, Kind.CONTINUOUS, side))
    cats = transforms.encode_categorical(latest, _names(spec, Kind.CATEGORICAL, side), spec.list_separator)
    if spec.time is not None:
        fresh = latest[spec.time].to_numpy(dtype=np.float64)
        if np.isnan(fresh).any():
            raise MaterializeError(f"the time column {spec.time!r} has missing values")
    else:
        fresh = np.full(len(latest), time.time())
    index = _names(spec, Kind.CATEGORICAL, side).index(key)
    return [bytes(v) for v in cats[:, index]], fresh, dense, cats


def used_memory(client) -> int:
    info = client.info("memory")
    if "used_memory" in info:
        return int(info["used_memory"])
    return sum(int(node.get("used_memory", 0)) for node in info.values() if isinstance(node, dict))


def materialize(spec: DatasetSpec, frame, url: str) -> Report:
    """Write each keyed side's latest rows of ``frame`` into the store at ``url``."""
    if spec.key(Side.CANDIDATE) is None:
        raise MaterializeError(f"the {spec.name} spec names no [candidate] key: nothing identifies an item")
    client = online.connect(url, timeout_s=10.0)
    started = time.monotonic()
    before = used_memory(client)
    reports = []
    for side in (Side.CONTEXT, Side.CANDIDATE):
        if spec.key(side) is None:
            continue
        ids, fresh, dense, cats = latest_rows(spec, frame, side)
        written = unchanged = newer = 0
        for first in range(0, len(ids), BATCH):
            chunk = range(first, min(first + BATCH, len(ids)))
            keys = [online.entity_key(spec.name, side.value, ids[i]) for i in chunk]
            values = [online.encode_row(fresh[i], dense[i], cats[i]) for i in chunk]
            stored = online.mget(client, keys)
            changed = {}
            for key, value, old in zip(keys, values, stored):
                if old == value:
                    unchanged += 1
                elif old is not None and _freshness(old) > _freshness(value):
                    newer += 1
                else:
                    changed[key] = value
            if changed:
                pipe = client.pipeline(transaction=False)
                for key, value in changed.items():
                    pipe.set(key, value)
                pipe.execute()
                written += len(changed)
        reports.append(SideReport(side.value, spec.key(side), len(ids), written, unchanged, newer))
    meta = json.dumps(layout(spec), sort_keys=True).encode()
    if client.get(online.meta_key(spec.name)) != meta:
        client.set(online.meta_key(spec.name), meta)
    seconds = time.monotonic() - started
    report = Report(spec.name, online.redacted(url), reports, seconds, before, used_memory(client))
    client.close()
    return report


def _freshness(value: bytes) -> float:
    try:
        return online.decode_row(value)[0]
    except ValueError:
        return -np.inf  # not a row of ours: overwritten


def check(spec: DatasetSpec, url: str, now: float | None = None) -> dict:
    """What the store holds of ``spec``: per keyed side, how many entities and how old their
    freshness is (oldest, newest, in seconds before ``now``), and whether its meta record matches."""
    client = online.connect(url, timeout_s=10.0)
    now = time.time() if now is None else now
    out: dict = {"dataset": spec.name, "store": online.redacted(url), "sides": {}}
    meta = client.get(online.meta_key(spec.name))
    out["meta"] = "missing" if meta is None else ("matches" if json.loads(meta) == layout(spec) else "differs")
    for side in (Side.CONTEXT, Side.CANDIDATE):
        if spec.key(side) is None:
            continue
        pattern = online.entity_key(spec.name, side.value, b"*")
        keys = list(client.scan_iter(match=pattern, count=1000))
        fresh = []
        for first in range(0, len(keys), BATCH):
            fresh += [_freshness(v) for v in online.mget(client, keys[first:first + BATCH]) if v is not None]
        ages = [now - f for f in fresh]
        out["sides"][side.value] = {"key": spec.key(side), "entities": len(fresh),
                                    "oldest_s": max(ages) if ages else None, "newest_s": min(ages) if ages else None}
    out["memory"] = used_memory(client)
    client.close()
    return out
