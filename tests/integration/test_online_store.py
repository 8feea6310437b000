"""Lookups of the online store (ensemble/online/) against a real redis-server: the cache's bound and
TTL, unknown ids, staleness, authentication, and one round trip per lookup."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ensemble import dataset, online
from ensemble.online import materialize
from ensemble.base.machine import free_port
from ensemble.online.local import LocalRedis

SPEC = dataset.parse_spec("""
name = "shop"
label = "clicked"
time = "ts"

[context]
continuous = ["age"]
categorical = ["user", "country"]
key = "user"

[candidate]
continuous = ["price"]
categorical = ["item", "brand"]
key = "item"
""")
NOW = 1_800_000_000.0


def _frame() -> pd.DataFrame:
    """Two users and three items; each entity's last row (by time) is the one to serve."""
    return pd.DataFrame({
        "clicked": [0, 1, 0, 1], "ts": [NOW - 10, NOW - 5, NOW - 7200, NOW - 1],
        "user": ["u1", "u1", "u2", "u1"], "country": ["fr", "de", None, "de"], "age": [30.0, 31.0, None, 31.0],
        "item": ["i1", "i2", "i3", "i1"], "brand": ["a", "b", "c", "a2"], "price": [1.0, 2.0, 3.0, 1.5]})


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = LocalRedis(free_port(), tmp_path_factory.mktemp("redis"), password="s3cret").start()
    materialize.materialize(SPEC, _frame(), server.url)
    yield server.url
    server.stop()


def _lookup(url, **kwargs):
    return online.FeatureLookup(url, SPEC.name, clock=lambda: NOW, **kwargs)


def test_the_latest_row_of_each_entity_is_served(redis_url):
    rows = _lookup(redis_url).rows(b"u1", [b"i1", b"i3", b"i2"])
    assert rows.context_dense.tolist() == [31.0] and rows.context_categorical.tolist() == [b"u1", b"de"]
    assert rows.candidate_dense.ravel().tolist() == [1.5, 3.0, 2.0]
    assert rows.candidate_categorical.tolist() == [[b"i1", b"a2"], [b"i3", b"c"], [b"i2", b"b"]]
    user2 = _lookup(redis_url).rows(b"u2", [b"i1"])
    assert np.isnan(user2.context_dense).all() and user2.context_categorical.tolist() == [b"u2", b""]


def test_unknown_ids_are_dropped_or_defaulted_and_counted(redis_url):
    dropping = _lookup(redis_url)
    rows = dropping.rows(b"nobody", [b"i1", b"zz", b"i1"])
    assert rows.kept.tolist() == [0, 2] and rows.dropped.tolist() == [1]
    assert rows.context_categorical.tolist() == [b"nobody", b""] and np.isnan(rows.context_dense).all()
    assert rows.counts["unknown_user"] == 1 and rows.counts["unknown_item"] == 1
    defaulting = _lookup(redis_url, unknown_items="default")
    rows = defaulting.rows(b"u1", [b"zz", b"i2"])
    assert rows.kept.tolist() == [0, 1] and rows.dropped.size == 0
    assert rows.candidate_categorical[0].tolist() == [b"zz", b""] and np.isnan(rows.candidate_dense[0]).all()


def test_stale_entities_are_served_and_counted_or_refused(redis_url):
    serving = _lookup(redis_url, max_staleness_s=3600)
    rows = serving.rows(b"u2", [b"i1", b"i3"])  # u2 and i3 are two hours old
    assert rows.counts["stale_served"] == 2 and len(rows.kept) == 2
    refusing = _lookup(redis_url, max_staleness_s=3600, stale="refuse")
    with pytest.raises(online.Unservable, match="user 'u2' is stale: its features are 7200 s old"):
        refusing.rows(b"u2", [b"i1"])
    assert refusing.rows(b"u1", [b"i1", b"i2"]).counts["stale_refused"] == 0
    assert refusing.counters()["stale_refused"] == 1


def test_the_cache_is_bounded_and_expires(redis_url):
    now = [0.0]  # the cache's clock: an entry is served for ttl_s however slow the lookups are

    def _cached():
        return _lookup(redis_url, cache_entries=2, ttl_s=0.3, cache_clock=lambda: now[0])

    lookup = _cached()
    first = lookup.rows(b"u1", [b"i1"])
    assert first.counts["store_hit"] == 2
    assert lookup.rows(b"u1", [b"i1"]).counts["cache_hit"] == 2 and lookup.counters()["round_trips"] == 2  # + meta
    # the user from the cache, an item from the store: the same rows as all from the store
    mixed = lookup.rows(b"u1", [b"i1", b"i2"])
    assert mixed.counts["cache_hit"] == 2 and mixed.counts["store_hit"] == 1
    fresh = _lookup(redis_url, cache_entries=0).rows(b"u1", [b"i1", b"i2"])
    for name in ("context_dense", "context_categorical", "candidate_dense", "candidate_categorical"):
        assert getattr(mixed, name).tolist() == getattr(fresh, name).tolist() or name.endswith("dense") and \
            np.array_equal(getattr(mixed, name), getattr(fresh, name), equal_nan=True)
    lookup = _cached()
    lookup.rows(b"u1", [b"i1"])
    lookup.rows(b"u1", [b"i1"])
    lookup.rows(None, [b"i2", b"i3"])  # two more entities: u1 and i1 leave the cache
    assert lookup.rows(b"u1", [b"i3"]).counts == {**dict.fromkeys(online.REASONS, 0), "store_hit": 1, "cache_hit": 1}
    now[0] = 0.29  # within the TTL: both from the cache
    assert lookup.rows(b"u1", [b"i3"]).counts["cache_hit"] == 2
    now[0] = 0.31  # past it: both from the store again
    assert lookup.rows(b"u1", [b"i3"]).counts["store_hit"] == 2
    uncached = _lookup(redis_url, cache_entries=0)
    for _ in range(3):
        assert uncached.rows(b"u1", [b"i1", b"i2", b"i3"]).counts["store_hit"] == 4
    assert uncached.counters()["round_trips"] == 4  # the meta record once, then one MGET per lookup


def test_a_wrong_password_or_an_empty_store_is_said_clearly(redis_url, tmp_path):
    with pytest.raises(online.StoreError, match=r"redis://\*\*\*@127.0.0.1"):
        online.FeatureLookup(redis_url.replace("s3cret", "wrong"), SPEC.name).rows(b"u1", [b"i1"])
    with pytest.raises(online.Unservable, match="holds no other features: run `ensemble materialize"):
        online.FeatureLookup(redis_url, "other").rows(b"u1", [b"i1"])
