import gzip

import numpy as np
import pandas as pd
import pytest

from ensemble import schema
from ensemble.data import criteo
from ensemble.models import metrics


@pytest.fixture(scope="module")
def synth():
    return criteo.synthesize(criteo.SynthConfig(rows=40_000, scale=0.002, seed=3))


def test_reader_round_trip_plain_gz_and_several_files(tmp_path, synth):
    frame = synth.frame.iloc[:500]
    plain = criteo.write_criteo(frame.iloc[:300], tmp_path / "day_0.tsv")
    packed = criteo.write_criteo(frame.iloc[300:], tmp_path / "day_1.tsv.gz")
    with gzip.open(packed, "rt") as handle:
        assert len(handle.readline().rstrip("\n").split("\t")) == 40
    back = criteo.read_criteo([plain, packed])
    assert list(back.columns) == list(schema.CRITEO_COLUMNS)
    assert len(back) == 500
    np.testing.assert_array_equal(back[schema.LABEL].to_numpy(), frame[schema.LABEL].to_numpy())
    np.testing.assert_array_equal(back[list(schema.DENSE_COLUMNS)].to_numpy(np.float64),
                                  frame[list(schema.DENSE_COLUMNS)].to_numpy(np.float64, na_value=np.nan))
    for col in schema.CATEGORICAL_COLUMNS:
        assert back[col].tolist() == frame[col].tolist()
    assert len(criteo.read_criteo([plain, packed], nrows=350)) == 350


def test_reader_empty_fields_are_missing(tmp_path):
    line = "\t".join(["1", "", "-2"] + [""] * 11 + ["68fd1e64", ""] + ["abc"] * 24)
    path = tmp_path / "one.tsv"
    path.write_text(line + "\n")
    row = criteo.read_criteo([path]).iloc[0]
    assert np.isnan(row["I1"]) and row["I2"] == -2
    assert row["C1"] == "68fd1e64" and row["C2"] is None


def test_synthetic_is_criteo_shaped(synth):
    frame = synth.frame
    assert 0.2 < frame[schema.LABEL].mean() < 0.3
    assert (frame["I2"].dropna() < 0).any()
    assert frame["I1"].isna().mean() == pytest.approx(0.45, abs=0.03)
    assert frame["C22"].isna().mean() == pytest.approx(0.76, abs=0.03)
    # Heavy-tailed: the most frequent value of a big column covers far more than its share.
    counts = frame["C3"].value_counts()
    assert counts.iloc[0] > 50 * len(frame) / counts.size
    values = frame["C1"].dropna()
    assert values.str.fullmatch("[0-9a-f]{8}").all()


def test_synthetic_labels_are_learnable_but_noisy(synth):
    best = metrics.auc(synth.frame[schema.LABEL], synth.probability)
    assert 0.7 < best < 0.95


def test_synthetic_is_seeded():
    a = criteo.synthesize(criteo.SynthConfig(rows=1000, seed=5)).frame
    b = criteo.synthesize(criteo.SynthConfig(rows=1000, seed=5)).frame
    c = criteo.synthesize(criteo.SynthConfig(rows=1000, seed=6)).frame
    pd.testing.assert_frame_equal(a, b)
    assert not a.equals(c)


def test_full_scale_cardinalities_reach_millions():
    cards = criteo.SynthConfig(scale=1.0).cardinalities()
    assert sum(c > 1_000_000 for c in cards) >= 3
    assert criteo.SynthConfig(scale=0.01).cardinalities()[2] == 101_313


def test_split_keeps_order():
    frame = pd.DataFrame({"x": range(100)})
    train, valid, test = criteo.split(frame, 0.1, 0.2)
    assert (len(train), len(valid), len(test)) == (70, 10, 20)
    assert train.x.iloc[-1] == 69 and valid.x.iloc[0] == 70 and test.x.iloc[0] == 80


def test_chunked_generator_writes_what_synthesize_draws(tmp_path):
    config = criteo.SynthConfig(rows=2_500, scale=0.002, seed=9)
    # One chunk: byte-identical to the whole-frame generator's file.
    whole = criteo.write_criteo(criteo.synthesize(config).frame, tmp_path / "whole.tsv")
    summary = criteo.write_synthetic(config, tmp_path / "one_chunk.tsv", chunk_rows=10_000)
    assert summary.path.read_bytes() == whole.read_bytes()
    # Several chunks: the file is synthesize(config, chunk_rows), and chunks differ from each other.
    chunked = criteo.synthesize(config, chunk_rows=1_000)
    summary = criteo.write_synthetic(config, tmp_path / "chunked.tsv", chunk_rows=1_000)
    assert summary.path.read_bytes() == criteo.write_criteo(chunked.frame, tmp_path / "ref.tsv").read_bytes()
    assert summary.rows == 2_500
    assert summary.click_rate == pytest.approx(chunked.frame[schema.LABEL].mean())
    assert summary.best_auc == pytest.approx(metrics.auc(chunked.frame[schema.LABEL], chunked.probability), abs=1e-4)
    assert not chunked.frame.iloc[:1000].reset_index(drop=True).equals(chunked.frame.iloc[1000:2000].reset_index(drop=True))
