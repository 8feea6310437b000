import numpy as np
import pytest

from ensemble import schema
from ensemble.data import shards


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, schema.N_DENSE)).astype(np.float32)
    ids = np.repeat(np.arange(n, dtype=np.int64)[:, None], schema.N_CATEGORICAL, axis=1)  # row id in every column
    return dense, ids, rng.integers(0, 2, n).astype(np.int8)


def _check_epoch(source, n, batch_size):
    batches = list(source.epoch(0))
    assert all(len(b[2]) == batch_size for b in batches[:-1]) and 0 < len(batches[-1][2]) <= batch_size
    for dense, ids, labels in batches:
        assert dense.dtype == np.float32 and dense.shape[1] == schema.N_DENSE
        assert ids.dtype == np.int64 and ids.shape[1] == schema.N_CATEGORICAL and labels.dtype == np.int8
    seen = np.concatenate([b[1][:, 0] for b in batches])
    np.testing.assert_array_equal(np.sort(seen), np.arange(n))  # every row exactly once
    return seen


@pytest.mark.parametrize("buffer_rows", [1, 700, 10_000])
def test_shard_source_visits_every_row_once_per_epoch_and_keeps_rows_whole(tmp_path, buffer_rows):
    dense, ids, labels = _arrays(2_345)
    bounds = [0, 300, 301, 1_000, 1_800, 2_345]
    parts = [(dense[a:b], ids[a:b], labels[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    shard_set = shards.write_shards(tmp_path / "train", parts)
    assert shards.ShardSet.load(tmp_path / "train") == shard_set and shard_set.rows == 2_345
    source = shard_set.source(batch_size=256, seed=4, buffer_rows=buffer_rows)
    assert source.rows == 2_345
    first = _check_epoch(source, 2_345, 256)
    for d, i, y in source.epoch(0):  # a row's dense values and label travel with its ids
        np.testing.assert_array_equal(d, dense[i[:, 0]])
        np.testing.assert_array_equal(y, labels[i[:, 0]])
    again = np.concatenate([b[1][:, 0] for b in source.epoch(0)])
    other = np.concatenate([b[1][:, 0] for b in source.epoch(1)])
    np.testing.assert_array_equal(first, again)  # an epoch index gives the same order
    assert not np.array_equal(first, other)
    assert not np.array_equal(first, np.arange(2_345))
    ordered = np.concatenate([b[1][:, 0] for b in shard_set.source(batch_size=256, shuffle=False).epoch(3)])
    np.testing.assert_array_equal(ordered, np.arange(2_345))


def test_array_source_is_the_same_contract():
    dense, ids, labels = _arrays(1_000, seed=1)
    source = shards.ArraySource(dense, ids, labels, batch_size=128, seed=2)
    first = _check_epoch(source, 1_000, 128)
    assert not np.array_equal(first, np.concatenate([b[1][:, 0] for b in source.epoch(1)]))
    back = shards.collect(shards.ArraySource(dense, ids, labels, batch_size=128, shuffle=False))
    for a, b in zip(back, (dense, ids, labels)):
        np.testing.assert_array_equal(a, b)


def test_partitions_cover_the_shards_once(tmp_path):
    dense, ids, labels = _arrays(500)
    shard_set = shards.write_shards(tmp_path, [(dense[a:a + 100], ids[a:a + 100], labels[a:a + 100])
                                               for a in range(0, 500, 100)])
    halves = [shard_set.partition(r, 2) for r in range(2)]
    assert sorted(halves[0].files + halves[1].files) == sorted(shard_set.files)
    assert halves[0].rows + halves[1].rows == 500
    with pytest.raises(ValueError, match="rank 2"):
        shard_set.partition(2, 2)
    with pytest.raises(FileNotFoundError, match="shards.json"):
        shards.ShardSet.load(tmp_path / "nothing")
