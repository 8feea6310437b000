"""Slipstream: the hot/cold split, stale tracking, the skip rule, and a trained model that exports."""

import numpy as np
import pytest
import torch

from ensemble import schema
from ensemble.data.shards import ArraySource, collect
from ensemble.models import dlrm_torch, metrics, slipstream
from ensemble.models.dlrm import DLRMConfig, table_offsets
from ensemble.models.slipstream import SlipstreamConfig, StaleTracker, choose_threshold, kept_batches, split_hot_cold
from tests.helpers import learnable_tensors

CARDS = (50,) * schema.N_CATEGORICAL


def zipf_ids(n: int, seed: int, card: int = 50) -> np.ndarray:
    """[n x 26] per-column ids with Zipf-like frequencies (a few values take most lookups)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, card + 1) ** 1.2
    return rng.choice(card, size=(n, schema.N_CATEGORICAL), p=p / p.sum()).astype(np.int64)


def source_of(ids: np.ndarray, batch_size: int = 512, seed: int = 0) -> ArraySource:
    n = len(ids)
    return ArraySource(np.zeros((n, schema.N_DENSE), np.float32), ids, np.zeros(n, np.int8), batch_size, seed)


def test_hot_rows_are_exactly_those_looked_up_by_a_share_lambda():
    ids = zipf_ids(5000, seed=1)
    lam = 0.02
    split = split_hot_cold(source_of(ids), CARDS, lam)
    flat = (ids + table_offsets(CARDS)).ravel()
    counts = np.bincount(flat, minlength=sum(CARDS))
    assert np.array_equal(split.counts, counts)
    assert np.array_equal(split.hot, counts >= lam * 5000)
    assert 0 < split.hot_rows < sum(CARDS)
    # Boundary: a row looked up by exactly Λ x N inputs is hot, one fewer is not.
    edge = np.flatnonzero(counts == counts[split.hot].min())[0]
    assert split_hot_cold(source_of(ids), CARDS, counts[edge] / 5000).hot[edge]
    assert not split_hot_cold(source_of(ids), CARDS, (counts[edge] + 1) / 5000).hot[edge]
    all_hot = split.hot[ids + table_offsets(CARDS)].all(axis=1).mean()
    assert split.hot_input_share == pytest.approx(all_hot)
    assert split.hot_lookup_share == pytest.approx(counts[split.hot].sum() / counts.sum())


def test_stale_rows_are_hot_rows_that_moved_less_than_t_over_the_window():
    rng = np.random.default_rng(2)
    hot = rng.random(sum(CARDS)) < 0.3
    tracker = StaleTracker(hot, CARDS, SlipstreamConfig(drop_share=0.4, alpha=0.5))
    weight = torch.from_numpy(rng.normal(size=(sum(CARDS), 8)).astype(np.float32))
    tracker.snapshot(weight)
    assert not tracker.active and not tracker.skip(zipf_ids(10, 3)).any()  # nothing stale before a window closes
    moved = weight.clone()
    step = torch.from_numpy(rng.exponential(size=(sum(CARDS), 1)).astype(np.float32))
    moved += step * torch.from_numpy(rng.normal(size=(sum(CARDS), 8)).astype(np.float32))
    expected_change = (moved - weight).norm(dim=1).numpy()
    change = tracker.change(moved)
    assert np.allclose(change[hot], expected_change[hot], rtol=1e-5)
    assert np.isinf(change[~hot]).all()  # cold rows are never tracked
    threshold = tracker.close_window(moved, zipf_ids(4000, 4))
    assert tracker.active and threshold > 0
    assert np.array_equal(tracker.stale, hot & (expected_change < threshold))
    # The next window measures from the new snapshot: no move, every hot row is stale.
    assert np.allclose(tracker.change(moved)[hot], 0.0)


def test_threshold_reaches_the_target_share_on_its_sample():
    rng = np.random.default_rng(5)
    change = rng.exponential(size=(10_000, schema.N_CATEGORICAL))
    change[rng.random(change.shape) < 0.1] = np.inf  # cold lookups
    for k, share in ((1, 0.3), (21, 0.3), (26, 0.05), (13, 0.0)):
        t = choose_threshold(change, k, share)
        kth = np.sort(change, axis=1)[:, k - 1]
        assert (kth < t).mean() == pytest.approx(share, abs=1e-3)
    # Fewer skippable inputs than D asks for: every input with k finite changes is skipped.
    t = choose_threshold(change, 26, 0.9)
    assert (np.sort(change, axis=1)[:, 25] < t).mean() == pytest.approx(np.isfinite(change).all(axis=1).mean())


@pytest.mark.parametrize("alpha,drop", [(1.0, 0.1), (0.8, 0.3), (0.5, 0.5)])
def test_skip_rule_drops_inputs_with_stale_lookups_at_about_share_d(alpha, drop):
    rng = np.random.default_rng(6)
    config = SlipstreamConfig(hot_share=0.001, drop_share=drop, alpha=alpha, sample_rows=20_000)
    train_ids = zipf_ids(20_000, seed=7)
    split = split_hot_cold(source_of(train_ids), CARDS, config.hot_share)
    tracker = StaleTracker(split.hot, CARDS, config)
    weight = torch.zeros(sum(CARDS), 4)
    tracker.snapshot(weight)
    weight += torch.from_numpy(rng.exponential(size=(sum(CARDS), 1)).astype(np.float32))  # each row moves its own amount
    tracker.close_window(weight, train_ids)
    fresh = zipf_ids(20_000, seed=8)  # inputs the sample did not contain, same distribution
    skipped = tracker.skip(fresh)
    assert skipped.mean() == pytest.approx(drop, abs=0.02)
    stale_lookups = tracker.stale[fresh + table_offsets(CARDS)].sum(axis=1)
    assert np.array_equal(skipped, stale_lookups >= config.stale_lookups)


def test_kept_batches_pack_every_kept_row_once_into_full_batches():
    ids = zipf_ids(3000, seed=9)
    ids[:, 0] = np.arange(3000) % 50
    source = source_of(ids, batch_size=256)
    hot = np.zeros(sum(CARDS), bool)
    hot[:10] = True  # column 0, ids 0..9
    tracker = StaleTracker(hot, CARDS, SlipstreamConfig(alpha=1 / 26))
    tracker.stale, tracker.threshold = hot.copy(), 1.0  # as if a window had closed
    counts, recent = {"rows": 0, "skipped": 0}, []
    batches = list(kept_batches(source.epoch(0), tracker, 100, counts, recent))
    kept = np.concatenate([b[1] for b in batches])
    assert [len(b[2]) for b in batches[:-1]] == [100] * (len(batches) - 1) and 0 < len(batches[-1][2]) <= 100
    assert counts == {"rows": 3000, "skipped": int((ids[:, 0] < 10).sum())}
    assert len(kept) == 3000 - counts["skipped"] and not (kept[:, 0] < 10).any()
    assert sum(len(r) for r in recent) == 3000  # T's sample sees the inputs before skipping
    expected = collect(source)[1]
    assert sorted(map(tuple, kept)) == sorted(map(tuple, expected[expected[:, 0] >= 10]))


def test_config_rejects_out_of_range_settings():
    for bad in ({"hot_share": 0}, {"drop_share": 1.0}, {"alpha": 0}, {"window": 0}):
        with pytest.raises(ValueError):
            SlipstreamConfig(**bad)
    assert SlipstreamConfig(alpha=1.0).stale_lookups == 26 and SlipstreamConfig(alpha=0.5).stale_lookups == 13


def test_trained_model_skips_learns_and_exports_as_torchscript(tmp_path):
    dense, ids, labels = learnable_tensors(12_000, seed=10)
    config = DLRMConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), cardinalities=(5,) * 26, epochs=2,
                        batch_size=200, learning_rate=1e-2)
    slip = SlipstreamConfig(hot_share=0.01, drop_share=0.3, alpha=0.5, window=5, warmup_steps=10, sample_rows=2000)
    model, stats = slipstream.train(config, slip, (dense[:10_000], ids[:10_000], labels[:10_000]),
                                    (dense[10_000:11_000], ids[10_000:11_000], labels[10_000:11_000]),
                                    log=lambda _: None)
    assert isinstance(model, dlrm_torch.DLRM)
    assert stats.rows_per_epoch == [10_000, 10_000] and stats.hot_rows == 26 * 5
    assert 0.15 < stats.skipped_share < 0.35 and stats.thresholds
    assert sum(stats.steps_per_epoch) < 2 * 10_000 / 200  # skipped rows save whole steps
    test_dense, test_ids, test_labels = dense[11_000:], ids[11_000:], labels[11_000:]
    expected = dlrm_torch.predict(model, test_dense, test_ids)
    assert metrics.auc(test_labels, expected) > 0.7
    dlrm_torch.save(model, tmp_path)
    scored = dlrm_torch.TorchScorer(tmp_path)(test_dense, test_ids).reshape(-1)
    np.testing.assert_allclose(scored, expected, atol=1e-5)
