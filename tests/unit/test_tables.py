"""The row store (ensemble.tables, ensemble/native/_tables.c) on real files: formats, blocks and their checksums,
the rows nobody trained, the hot tier, cold reads through every I/O mode, deltas and faults."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble.tables import files, training

_tables = pytest.importorskip("ensemble.native._tables")
IO_MODES = ["pread", "mmap", *(["uring"] if _tables.has_uring() else [])]


def _table(tmp_path, rows: int, dim: int, fmt: str, seed: int = 3, trained: int = 0, name: str = "t.rows"):
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(rows, trained, replace=False)).astype(np.int64) if trained else None
    values = rng.normal(0, 0.1, (trained, dim)).astype(np.float32) if trained else None
    path = tmp_path / name
    files.write_table(path, rows, dim, fmt, seed, ids, values)
    return path, ids, values


def _expected(seed: int, ids: np.ndarray, dim: int, fmt: str, trained_ids=None, trained=None) -> np.ndarray:
    rows = files.init_rows(seed, ids, dim)
    if trained_ids is not None:
        at = np.searchsorted(trained_ids, ids)
        hit = (at < len(trained_ids)) & (trained_ids[np.minimum(at, len(trained_ids) - 1)] == ids)
        rows[hit] = trained[at[hit]]
    return files.decode(files.encode(rows, fmt), fmt, dim)


def test_the_rows_nobody_trained_are_a_function_of_table_and_row():
    a = files.init_rows(7, np.array([0, 5, 10**9], np.int64), 16)
    assert np.array_equal(a, files.init_rows(7, np.array([0, 5, 10**9], np.int64), 16))
    assert not np.array_equal(a, files.init_rows(8, np.array([0, 5, 10**9], np.int64), 16))
    assert a.min() >= -0.05 and a.max() < 0.05 and len(np.unique(a)) == a.size
    whole = np.empty((11, 16), np.float32)
    _tables.init_rows(7, 0, 16, whole)
    assert np.array_equal(whole[[0, 5, 10]], files.init_rows(7, np.array([0, 5, 10], np.int64), 16))
    assert files.table_seed("dlrm_torch", "C1") != files.table_seed("dlrm_tf", "C1")


@pytest.mark.parametrize("fmt", files.FORMATS)
def test_each_format_keeps_a_row_within_its_precision(fmt):
    rows = np.random.default_rng(0).normal(0, 0.2, (500, 128)).astype(np.float32)
    rows[0] = 0.25  # a constant row: int8's scale is 0
    back = files.decode(files.encode(rows, fmt), fmt, 128)
    error = np.abs(back - rows).max(axis=1)
    if fmt == "fp32":
        assert error.max() == 0
    elif fmt == "fp16":  # 11 significant bits
        assert (error <= np.abs(rows).max(axis=1) * 2.0**-11).all()
    else:  # half a step of (max - min) / 255, and a float32's rounding
        assert (error <= (rows.max(axis=1) - rows.min(axis=1)) / 510 + 1e-6).all() and error[0] == 0
    assert files.row_bytes(fmt, 128) == {"fp32": 512, "fp16": 256, "int8": 136}[fmt]  # FBGEMM's 8-bit rowwise: 128 + 8


@pytest.mark.parametrize("fmt", files.FORMATS)
def test_a_table_file_holds_every_row_in_blocks_each_checked(tmp_path, fmt):
    path, ids, values = _table(tmp_path, 10_000, 16, fmt, trained=300)
    header = files.read_header(path)
    assert (header.fmt, header.dim, header.rows) == (fmt, 16, 10_000)
    assert path.stat().st_size == files.file_bytes(10_000, fmt, 16)
    probe = np.array([0, 1, ids[0], ids[-1], 9_999, *ids[100:110]], np.int64)
    assert np.array_equal(files.read_rows(path, probe), _expected(3, probe, 16, fmt, ids, values))
    data = bytearray(path.read_bytes())
    data[files.BLOCK * 2 + 100] ^= 1  # one bit of the second data block
    path.write_bytes(bytes(data))
    with pytest.raises(files.TableFileError, match="block 1 fails its checksum"):
        files.read_rows(path, np.array([files.per_block(fmt, 16) + 1], np.int64))
    files.read_rows(path, np.array([0], np.int64))  # the other blocks still read


def _store(specs, budget=1 << 20, **kwargs):
    return _tables.Store([(n, str(p), r, d, small, None, None) for n, p, r, d, small in specs], budget, **kwargs)


@pytest.mark.parametrize("io", IO_MODES)
def test_a_gather_reads_every_row_from_ram_or_disk_and_counts_unique_keys(tmp_path, io):
    big, ids, values = _table(tmp_path, 50_000, 16, "int8", seed=3, trained=500, name="big.rows")
    small, _, _ = _table(tmp_path, 40, 16, "int8", seed=4, name="small.rows")
    store = _store([("big", big, 50_000, 16, False), ("small", small, 40, 16, True)], io=io, admission="always")
    rng = np.random.default_rng(1)
    keys = np.stack([rng.integers(0, 50_000, 300), rng.integers(0, 40, 300)], axis=1).astype(np.int64)
    keys[10] = keys[20]  # a repeated key is one lookup on disk
    out = np.empty((300, 2, 16), np.float32)
    store.gather(keys, out)
    assert np.array_equal(out[:, 0], _expected(3, keys[:, 0], 16, "int8", ids, values))
    assert np.array_equal(out[:, 1], _expected(4, keys[:, 1], 16, "int8"))
    first = store.stats()
    unique = len(np.unique(keys[:, 0]))
    assert first["tables"]["big"]["unique"] == unique and first["tables"]["big"]["cold_rows"] == unique
    assert first["tables"]["small"]["hits"] == first["tables"]["small"]["unique"] == len(np.unique(keys[:, 1]))
    store.gather(keys, out)  # the same keys again: every one from the hot tier now
    second = store.stats()["tables"]["big"]
    assert second["hits"] == unique and second["cold_rows"] == unique and second["hot_rows"] == unique


def test_the_hot_tier_holds_its_budget_and_the_admission_policy_decides_what_enters(tmp_path):
    big, _, _ = _table(tmp_path, 200_000, 16, "int8", name="big.rows")
    row_slot = files.row_bytes("int8", 16) + 9
    budget = 8 * 64 * row_slot  # 64 sets of 8 ways: 512 rows
    keys = np.arange(0, 4_000, 20, dtype=np.int64).reshape(-1, 1)  # 200 keys, each missed once
    out = np.empty((len(keys), 1, 16), np.float32)
    for policy, most in (("always", 200), ("second", 20), ("none", 0)):
        store = _store([("big", big, 200_000, 16, False)], budget, admission=policy, io="pread")
        store.gather(keys, out)
        stats = store.stats()
        assert stats["hot_capacity_rows"] == 512 and stats["hot_rows"] <= most, policy
        assert policy != "always" or stats["hot_rows"] > 150  # a few collide in their 8-way set
        assert stats["hot_bytes"] == stats["hot_rows"] * files.row_bytes("int8", 16)  # the doorkeeper's collisions
    many = np.arange(0, 200_000, 10, dtype=np.int64).reshape(-1, 1)
    store = _store([("big", big, 200_000, 16, False)], budget, admission="always", io="pread")
    store.gather(many, np.empty((len(many), 1, 16), np.float32))
    assert store.stats()["hot_rows"] == 512 and store.stats()["evictions"] > 0  # full, never past its budget
    store = _store([("big", big, 200_000, 16, False)], budget, admission="second", io="pread")
    store.gather(keys[:100], out[:100])
    store.gather(keys[:100], out[:100])  # missed twice: admitted
    assert store.stats()["hot_rows"] >= 90


def test_the_warm_file_fills_the_tier_in_its_order_and_skips_what_is_not_the_stores(tmp_path):
    big, _, _ = _table(tmp_path, 100_000, 16, "fp16", name="big.rows")
    keys = np.array([5, 7, 99_999, (1 << files.KEY_SHIFT) | 3, 11], np.int64)  # the 4th: a table this store lacks
    encoded = files.encode(files.read_rows(big, np.array([5, 7, 99_999, 0, 11], np.int64)), "fp16")
    files.write_rows_file(tmp_path / "warm.rows", encoded, "fp16", 16)
    store = _store([("big", big, 100_000, 16, False)], 1 << 20, admission="none", io="pread")
    assert store.warm(str(tmp_path / "warm.rows"), keys) == 4
    out = np.empty((4, 1, 16), np.float32)
    store.gather(np.array([[5], [7], [99_999], [11]], np.int64), out)
    assert store.stats()["tables"]["big"]["cold_rows"] == 0 and store.stats()["warmed_rows"] == 4
    with pytest.raises(_tables.TableError, match="does not match its keys"):
        store.warm(str(tmp_path / "warm.rows"), keys[:3])


def test_a_delta_overrides_the_shared_file_and_stays_in_ram(tmp_path):
    big, _, _ = _table(tmp_path, 100_000, 16, "int8", name="big.rows")
    delta_ids = np.array([3, 50_000], np.int64)
    delta = files.encode(np.full((2, 16), 0.5, np.float32), "int8")
    store = _tables.Store([("big", str(big), 100_000, 16, False, delta_ids, delta)], 1 << 20, io="pread")
    out = np.empty((3, 1, 16), np.float32)
    store.gather(np.array([[3], [4], [50_000]], np.int64), out)
    assert np.allclose(out[[0, 2], 0], 0.5) and not np.allclose(out[1, 0], 0.5)
    stats = store.stats()["tables"]["big"]
    assert stats["delta_rows"] == 2 and stats["hits"] == 2 and stats["cold_rows"] == 1
    with pytest.raises(ValueError, match="sorted and distinct"):
        _tables.Store([("big", str(big), 100_000, 16, False, delta_ids[::-1].copy(), delta)], 1 << 20)


def test_a_small_tables_delta_overrides_its_rows_in_ram(tmp_path):
    small, _, _ = _table(tmp_path, 1000, 16, "fp16", name="small.rows")
    before = files.read_rows(small, np.array([2, 3], np.int64))
    delta = files.encode(np.full((1, 16), -0.25, np.float32), "fp16")
    store = _tables.Store([("small", str(small), 1000, 16, True, np.array([3], np.int64), delta)], 0, io="pread")
    out = np.empty((2, 1, 16), np.float32)
    store.gather(np.array([[2], [3]], np.int64), out)
    assert np.allclose(out[0, 0], before[0]) and np.allclose(out[1, 0], -0.25) and not np.allclose(before[1], -0.25)
    assert store.stats()["tables"]["small"]["hits"] == 2


@pytest.mark.parametrize("io", IO_MODES)
def test_a_block_failing_its_checksum_is_never_scored_and_the_rest_still_is(tmp_path, io):
    big, _, _ = _table(tmp_path, 50_000, 16, "int8", name="big.rows")
    per = files.per_block("int8", 16)
    data = bytearray(big.read_bytes())
    data[files.BLOCK * (1 + 7) + 5] ^= 0x40  # block 7
    big.write_bytes(bytes(data))
    store = _store([("big", big, 50_000, 16, False)], 1 << 20, io=io)
    out = np.empty((1, 1, 16), np.float32)
    with pytest.raises(_tables.TableError, match=r"table big: block 7 of .*big.rows fails its checksum"):
        store.gather(np.array([[7 * per + 1]], np.int64), out)
    assert store.stats()["tables"]["big"]["checksum_errors"] == 1 and store.stats()["hot_rows"] == 0
    store.gather(np.array([[8 * per]], np.int64), out)  # another block: served
    with pytest.raises(ValueError, match="outside its 50000 rows"):
        store.gather(np.array([[50_000]], np.int64), out)


def test_a_missing_or_foreign_table_file_fails_the_store_naming_it(tmp_path):
    with pytest.raises(_tables.TableError, match=r"table C3: cannot open .*nowhere.rows"):
        _store([("C3", tmp_path / "nowhere.rows", 10, 16, False)])
    (tmp_path / "foreign.rows").write_bytes(b"\0" * 8192)
    with pytest.raises(_tables.TableError, match="foreign.rows is not a table file"):
        _store([("C3", tmp_path / "foreign.rows", 10, 16, False)])
    path, _, _ = _table(tmp_path, 1000, 16, "int8")
    with pytest.raises(_tables.TableError, match="the release expects 2000 rows"):
        _store([("C3", path, 2000, 16, False)])
    path.write_bytes(path.read_bytes()[:-files.BLOCK])  # truncated
    with pytest.raises(_tables.TableError, match="truncated"):
        _store([("C3", path, 1000, 16, False)])


def test_training_touches_only_its_batches_rows_and_spills_past_its_budget(tmp_path):
    shapes = [training.TableShape("a", 40_000_000, 1), training.TableShape("b", 10, 2)]
    rows = training.TrainingRows(shapes, 8, learning_rate=0.1, budget_bytes=0, spill=tmp_path / "spill")
    ids = np.array([[39_999_999, 3], [5, 3], [39_999_999, 9]], np.int64)
    unique, where = rows.gather(ids)
    assert unique.shape == (4, 8) and rows.touched == 4  # 2 + 2 unique, not 40M rows
    assert np.array_equal(unique[where[0, 0]], files.init_rows(1, np.array([39_999_999]), 8)[0])
    assert where[0, 0] == where[2, 0] and where[0, 1] == where[1, 1]
    rows.apply(np.ones((4, 8), np.float32))
    after = rows.rows_of(np.array([[39_999_999, 3], [6, 3]], np.int64))
    assert np.allclose(after[0, 0], files.init_rows(1, np.array([39_999_999]), 8)[0] - 0.1, atol=1e-6)
    assert np.array_equal(after[1, 0], files.init_rows(1, np.array([6]), 8)[0])  # untouched: its initialization
    assert rows.touched == 4  # rows_of adds nothing
    assert any(t.on_disk for t in rows.tables)  # a budget of 0: the rows live in a file
    with pytest.raises(ValueError, match="table b: id 10 is outside its 10 rows"):
        rows.gather(np.array([[0, 10]], np.int64))
    folder = rows.save(tmp_path / "model")
    dim, touched = training.load_touched(tmp_path / "model")
    assert dim == 8 and touched[0].ids.tolist() == [5, 39_999_999] and touched[0].counts.tolist() == [1, 2]
    assert (folder / "tables.json").is_file()


def test_the_compact_map_costs_far_less_than_a_dict_per_entry():
    m = _tables.Map()
    keys = np.random.default_rng(0).integers(0, 1 << 40, 1_000_000).astype(np.int64)
    out = np.empty(len(keys), np.int32)
    m.add(keys, out)
    assert m.nbytes / len(m) <= 32  # 12 bytes a slot, 3/8 to 3/4 of them full (a dict of ints: ~100 an entry)
    found = np.empty(3, np.int32)
    m.find(np.array([keys[0], keys[-1], -5], np.int64), found)
    assert found[0] == out[0] and found[1] == out[-1] and found[2] == -1


def test_the_warm_file_keeps_the_most_looked_up_rows_up_to_its_cap(tmp_path):
    from ensemble.tables import export

    (tmp_path / files.TABLES_DIR).mkdir()
    rng = np.random.default_rng(4)
    touched = []
    for c, rows in enumerate([2_000_000, 50, 3_000_000]):  # the small table (50 rows) stays out of it
        ids = np.sort(rng.choice(rows, 40, replace=False)).astype(np.int64)
        touched.append(training.Touched(training.TableShape(f"t{c}", rows, c), ids,
                                        rng.random((40, 8), dtype=np.float32), rng.integers(1, 1000, 40).astype(np.uint32)))
    said = []
    cap = 30 * files.row_bytes("fp16", 8)
    export._write_warm(tmp_path, touched, "fp16", 8, {}, max_bytes=cap, log=said.append)
    keys = np.load(tmp_path / files.TABLES_DIR / files.WARM_KEYS)
    everyone = [(int(n), (c << files.KEY_SHIFT) | int(i)) for c in (0, 2) for i, n in zip(touched[c].ids, touched[c].counts)]
    expected = [k for _, k in sorted(everyone, key=lambda e: (-e[0], e[1]))[:30]]
    assert keys.tolist() == expected
    assert files.read_header(tmp_path / files.TABLES_DIR / files.WARM_ROWS).rows == 30
    assert said and "30 most looked-up of 80" in said[0]
