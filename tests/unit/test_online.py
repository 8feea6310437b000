"""The online store's row format and settings (ensemble/online/); the lookups against a real
redis-server are tested in tests/integration/test_online_store.py and test_rank_ids.py."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble import dataset, online
from ensemble.online import materialize


def test_a_stored_row_reads_back_exactly():
    dense = np.array([1.5, np.nan, -0.0, 3e38], np.float32)
    cats = (b"1", b"", "é".encode(), b"a|b", b"x" * 70_000)
    freshness, got_dense, got_cats = online.decode_row(online.encode_row(893286638.0, dense, cats))
    assert freshness == 893286638.0 and got_cats == cats
    assert got_dense.tobytes() == dense.tobytes()  # NaN and -0.0 bit for bit


@pytest.mark.parametrize("value", [b"", b"\x00" * 11, online.encode_row(1.0, [1.0], [b"ab"])[:-1],
                                   online.encode_row(1.0, [1.0], [b"ab"]) + b"!"])
def test_a_value_that_is_not_a_row_is_refused(value):
    with pytest.raises(ValueError, match="not a stored feature row"):
        online.decode_row(value)


def test_keys_name_the_dataset_side_and_id():
    assert online.entity_key("movielens100k", online.CANDIDATE, "50") == b"ensemble:movielens100k:candidate:50"
    assert online.meta_key("movielens100k") == "ensemble:movielens100k:meta"


def test_the_meta_record_places_each_key_among_its_sides_values():
    spec = dataset.load_spec("movielens100k")
    assert materialize.layout(spec) == {
        "dataset": "movielens100k",
        "context": {"key": "user_id", "key_index": 0, "dense": 1, "categorical": 4},
        "candidate": {"key": "movie_id", "key_index": 0, "dense": 20, "categorical": 1}}
    side = online.Side(**materialize.layout(spec)["context"])
    dense, cats = side.default(b"42")
    assert np.isnan(dense).all() and dense.shape == (1,) and cats == (b"42", b"", b"", b"")


def test_a_password_never_appears_in_what_is_reported():
    assert online.redacted("redis://user:s3cret@host:6380/1") == "redis://user:***@host:6380/1"
    assert online.redacted("rediss://:s3cret@host/0") == "rediss://***@host/0"
    assert online.redacted("redis://host:6379/0") == "redis://host:6379/0"


def test_settings_travel_through_the_environment_and_bad_ones_are_refused():
    settings = online.StoreSettings("redis://:pw@127.0.0.1:1/0", timeout_ms=20, cache_entries=5, ttl_s=1.5,
                                    unknown_items="default", max_staleness_s=3600, stale="refuse")
    assert online.StoreSettings.from_environment(settings.environment()) == settings
    assert online.StoreSettings.from_environment({}) is None
    assert online.StoreSettings.from_environment(online.StoreSettings("redis://h/0").environment()).max_staleness_s is None
    for bad, message in ((dict(url="http://h"), "redis://"), (dict(url="redis://h", unknown_items="keep"), "drop"),
                         (dict(url="redis://h", stale="ignore"), "serve"), (dict(url="redis://h", timeout_ms=0), "> 0"),
                         (dict(url="redis://h", max_staleness_s=-1), "staleness")):
        with pytest.raises(ValueError, match=message):
            online.StoreSettings(**bad)


def test_a_store_nothing_listens_on_fails_at_once_naming_it():
    from ensemble.base.machine import free_port

    lookup = online.FeatureLookup(f"redis://:pw@127.0.0.1:{free_port()}/0", "movielens100k", timeout_s=0.05)
    with pytest.raises(online.StoreError, match=r"feature store redis://\*\*\*@127.0.0.1:\d+/0") as err:
        lookup.rows(b"1", [b"1"])
    assert "pw" not in str(err.value)
    assert lookup.counters()["store_unavailable"] == 1
