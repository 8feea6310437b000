"""Each model exports to its native format and loads back to the same numbers."""

import numpy as np
import pytest

from ensemble.models import metrics
from ensemble.models import blend, dlrm_kernel, dlrm_tf, dlrm_torch, xgb
from ensemble.models.dlrm import DLRMConfig

CONFIG = DLRMConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), cardinalities=(5,) * 26)


def _batch(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 13)).astype(np.float32), rng.integers(0, 5, (n, 26)).astype(np.int64)


def test_torch_dlrm_scripts_and_reloads(tmp_path):
    import torch

    model = dlrm_torch.build(CONFIG).eval()
    dense, ids = _batch()
    with torch.no_grad():
        eager = model(torch.from_numpy(dense), torch.from_numpy(ids)).numpy()
    assert eager.shape == (64, 1)
    dlrm_torch.save(model, tmp_path)
    served = dlrm_torch.TorchScorer(tmp_path)(dense, ids)
    np.testing.assert_allclose(served, eager, atol=1e-6)


def test_torch_and_tf_dlrm_have_the_same_architecture():

    n_torch = sum(p.numel() for p in dlrm_torch.build(CONFIG).parameters())
    n_tf = dlrm_tf.build(CONFIG).count_params()
    assert n_torch == n_tf
    assert CONFIG.n_interactions(26) == 351


def test_tf_dlrm_exports_savedmodel_and_reloads(tmp_path):
    model = dlrm_tf.build(CONFIG)
    dense, ids = _batch()
    direct = np.asarray(model([dense, ids]))
    dlrm_tf.save(model, tmp_path)
    dlrm_tf.write_tflite(tmp_path)
    served = dlrm_tf.TFScorer(tmp_path)(dense, ids)
    np.testing.assert_allclose(served, direct, atol=1e-6)


@pytest.mark.skipif(not dlrm_kernel.available(), reason="ensemble.native._dlrm not built, or this CPU lacks AVX2+FMA")
@pytest.mark.parametrize("dim,last", [(4, 12), (16, 16)], ids=["scalar-widths", "vector-widths"])
def test_the_c_forward_pass_reads_both_exported_dlrms_and_gives_their_scores(tmp_path, dim, last):
    """The kernel's weights come from each exported file (TorchScript graph constants, TFLite
    tensors); a scorer uses it only after it agreed with the framework at load, and it keeps agreeing
    on every batch size (tiles of 6 rows x 16 outputs, blocks of 64 rows, and the rows around them;
    a last layer of 12 inputs, not a multiple of 8, and of 16)."""
    config = DLRMConfig(embedding_dim=dim, bottom_mlp=(32,), top_mlp=(48, last), cardinalities=(7,) * 26)
    torch_dir, tf_dir = tmp_path / "torch", tmp_path / "tf"
    torch_dir.mkdir(), tf_dir.mkdir()
    dlrm_torch.save(dlrm_torch.build(config).eval(), torch_dir)
    model = dlrm_tf.build(config)
    dlrm_tf.save(model, tf_dir)
    dlrm_tf.write_tflite(tf_dir)
    for scorer in (dlrm_torch.TorchScorer(torch_dir), dlrm_tf.TFScorer(tf_dir)):
        assert scorer._kernel is not None, type(scorer).__name__
        for rows in (1, 3, 5, 6, 7, 63, 64, 65, 100, 130):
            dense, ids = _batch(rows, seed=rows)
            ids = ids % 7
            np.testing.assert_allclose(scorer(dense, ids), scorer.framework(dense, ids), atol=1e-6)
        dense, ids = _batch(2)
        ids[1, 3] = 7  # beyond column 3's table
        with pytest.raises(ValueError, match="row 1, column 3: id 7 is outside its embedding table"):
            scorer._kernel(dense, ids)
        for row, column in ((20, 5), (37, 25)):  # in a whole group of 16 rows, and past the last one
            dense, ids = _batch(40, seed=row)
            ids = ids % 7
            ids[row, column] = -1
            with pytest.raises(ValueError, match=f"row {row}, column {column}: id -1 is outside"):
                scorer._kernel(dense, ids)


@pytest.mark.skipif(not dlrm_kernel.available(), reason="ensemble.native._dlrm not built, or this CPU lacks AVX2+FMA")
def test_the_c_interaction_gives_pairs_in_any_order_the_same_sums():
    """DLRM's pair order (every j < i, row by row) takes the kernel's direct path; any other order
    is picked from the Gram matrix. Both must give the same sums: the top layer's weights permuted
    with the pairs, the same probabilities."""
    from ensemble.native import _dlrm

    rng = np.random.default_rng(3)
    n_columns, dim, rows = 26, 16, 70
    pairs = [(i, j) for i in range(1, n_columns + 1) for j in range(i)]
    bottom = ((rng.normal(size=(13, dim)).astype(np.float32), rng.normal(size=dim).astype(np.float32)),)
    table = rng.normal(size=(n_columns * 5, dim)).astype(np.float32)
    offsets = np.arange(n_columns, dtype=np.int64) * 5
    weights = rng.normal(size=(dim + len(pairs), 1)).astype(np.float32) / 20
    dense = rng.normal(size=(rows, 13)).astype(np.float32)
    ids = rng.integers(0, 5, size=(rows, n_columns)).astype(np.int64)

    def forward(order):
        pair_i = np.array([pairs[p][0] for p in order], np.int32)
        pair_j = np.array([pairs[p][1] for p in order], np.int32)
        top = ((np.ascontiguousarray(np.vstack([weights[:dim], weights[dim:][order]])), np.zeros(1, np.float32)),)
        out = np.empty(rows, np.float32)
        _dlrm.forward(dense, ids, bottom, table, offsets, pair_i, pair_j, top, out)
        return out

    direct = forward(np.arange(len(pairs)))
    shuffled = forward(rng.permutation(len(pairs)))
    assert np.isfinite(direct).all() and direct.std() > 0.01
    np.testing.assert_allclose(shuffled, direct, atol=1e-6)

    # the weights taken once (what the scorers call) give forward()'s probabilities, row for row
    pair_i = np.array([p[0] for p in pairs], np.int32)
    pair_j = np.array([p[1] for p in pairs], np.int32)
    top = ((weights, np.zeros(1, np.float32)),)
    held = _dlrm.Weights(bottom, table.copy(), offsets, pair_i, pair_j, top)  # it holds the copy it was given
    for n in (1, 5, rows):
        out = np.empty(n, np.float32)
        held(dense[:n], ids[:n], out)
        np.testing.assert_array_equal(out, direct[:n])
    with pytest.raises(ValueError, match="dense must be"):
        held(dense[:, :12].copy(), ids, np.empty(rows, np.float32))
    with pytest.raises(ValueError, match="do not chain"):  # embeddings wider than the bottom MLP's output
        _dlrm.Weights(bottom, np.zeros((len(table), dim + 1), np.float32), offsets, pair_i, pair_j, top)


@pytest.mark.skipif(not dlrm_kernel.available(), reason="ensemble.native._dlrm not built, or this CPU lacks AVX2+FMA")
@pytest.mark.parametrize("dim,widths,columns", [(16, (64, 32), (128, 64)), (32, (48, 16), (80, 16)),
                                                (12, (40,), (20, 8)), (16, (16,), (32,))],
                         ids=["exported-shape", "dim-32", "scalar-widths", "one-hidden-layer"])
def test_the_avx512_build_gives_the_avx2_builds_floats(dim, widths, columns):
    """Where the CPU has AVX-512 the layers and the interaction run 16 lanes wide (tiles of 8 rows x 32
    or x 16 outputs, 16 x 16 Gram blocks after an in-register transpose); every output must be the
    AVX2 build's float, bit for bit, at every row count around the tiles and blocks, in DLRM's pair
    order and in another one, and for 27 vectors (the direct path) and 33 (past the Gram blocks)."""
    from ensemble.native import _dlrm

    if not _dlrm.wide(True):
        pytest.skip("this CPU has no AVX-512 (x86-64-v4): only the AVX2 build runs")
    rng = np.random.default_rng(dim)
    try:
        for n_columns in (26, 32):
            pairs = [(i, j) for i in range(1, n_columns + 1) for j in range(i)]
            sizes = (13, *widths, dim)
            bottom = tuple((rng.normal(size=(a, b)).astype(np.float32) / 3, rng.normal(size=b).astype(np.float32))
                           for a, b in zip(sizes[:-1], sizes[1:]))
            sizes = (dim + len(pairs), *columns, 1)
            top = tuple((rng.normal(size=(a, b)).astype(np.float32) / 10, rng.normal(size=b).astype(np.float32))
                        for a, b in zip(sizes[:-1], sizes[1:]))
            table = rng.normal(size=(n_columns * 5, dim)).astype(np.float32)
            offsets = np.arange(n_columns, dtype=np.int64) * 5
            for order in (np.arange(len(pairs)), rng.permutation(len(pairs))):
                pair_i = np.array([pairs[p][0] for p in order], np.int32)
                pair_j = np.array([pairs[p][1] for p in order], np.int32)
                held = _dlrm.Weights(bottom, table, offsets, pair_i, pair_j, top)
                for rows in (1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100, 130):
                    dense = rng.normal(size=(rows, 13)).astype(np.float32)
                    ids = rng.integers(0, 5, size=(rows, n_columns)).astype(np.int64)
                    out = {}
                    for wide in (False, True):
                        _dlrm.wide(wide)
                        out[wide] = np.full(rows, np.nan, np.float32)
                        held(dense, ids, out[wide])
                    assert np.isfinite(out[True]).all() and out[True].std() > 0 or rows == 1
                    np.testing.assert_array_equal(out[True].view(np.int32), out[False].view(np.int32),
                                                  err_msg=f"{n_columns} columns, {rows} rows")
    finally:
        _dlrm.wide(True)


def test_dlrm_training_learns_a_signal():
    rng = np.random.default_rng(1)
    dense, ids = _batch(6000, seed=2)
    labels = (rng.random(6000) < 1 / (1 + np.exp(-(2 * dense[:, 0] + (ids[:, 3] == 1))))).astype(np.int8)
    config = DLRMConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), cardinalities=(5,) * 26, epochs=3,
                        batch_size=256)
    split = (dense[:5000], ids[:5000], labels[:5000]), (dense[5000:], ids[5000:], labels[5000:])
    model = dlrm_torch.train(config, *split, log=lambda _: None)
    assert metrics.auc(labels[5000:], dlrm_torch.predict(model, dense[5000:], ids[5000:])) > 0.7


def test_the_tree_scorer_equals_xgboost_on_trained_rows(trained):
    """The exported model on real feature rows (integer ids sitting on split thresholds), through the
    scorer the CPU layouts run (the C evaluator when built, else XGBoost)."""
    from ensemble.features import transforms
    from ensemble.scoring.pipeline import release_versions
    from ensemble.schema import Model

    versions = release_versions(trained.repository)
    transform = transforms.LeanTransform.load(versions[Model.FEATURES] / "workflow")
    dense, ids = transform(transforms.dense_array(trained.test), transforms.encode_categorical(trained.test))
    scorer = xgb.TreeScorer(versions[Model.XGB])
    assert (scorer.kernel is not None) == (xgb._trees is not None)
    x = xgb.design_matrix(dense, ids)
    np.testing.assert_allclose(scorer(dense, ids).ravel(), scorer.booster.inplace_predict(x), atol=1e-6)
    assert not (versions[Model.XGB] / "trees.so").exists()  # export compiles nothing for the trees


@pytest.mark.skipif(xgb._trees is None, reason="ensemble.native._trees was not built (no C compiler at install)")
def test_tree_arrays_equal_xgboost_with_missing_values_on_every_batch_size(tmp_path):
    """Trees of uneven depth (leaves above the deepest level fill the complete tree below them),
    missing values sent both ways (trained with NaNs, so default directions differ by node)."""
    rng = np.random.default_rng(8)
    dense, ids = _batch(3000, seed=8)
    x = xgb.design_matrix(dense, ids)
    x[rng.random(x.shape) < 0.15] = np.nan
    y = (np.nan_to_num(x[:, 0], nan=0.5) - 0.2 * np.nan_to_num(x[:, 14]) + rng.normal(size=3000) > 0).astype(np.int8)
    booster = xgb.train(xgb.XGBConfig(rounds=40, max_depth=6, early_stopping=40), x[:2000], y[:2000], x[2000:], y[2000:])
    xgb.save(booster, tmp_path)
    arrays = xgb.TreeArrays.from_json(tmp_path / xgb.MODEL_FILE)
    assert arrays is not None and arrays.depth == 6
    # groups of 8 rows, blocks of 64, the rows around them; blocks of under 8 rows walk 16 trees at once
    # (40 trees: two such groups, then 8 trees one at a time); on AVX-512, blocks of 16 rows or more go
    # 16 lanes wide, 1 to 4 groups of 16 (the last one part full)
    for rows in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 48, 49, 63, 64, 65, 71, 1000, 3000):
        np.testing.assert_allclose(arrays(x[:rows]), booster.inplace_predict(x[:rows]), atol=1e-6)
    # either walk adds a row's trees in tree order: the same row gets the same float32 score
    np.testing.assert_array_equal(arrays(x[:5]), arrays(x[:64])[:5])
    with pytest.raises(ValueError, match="features"):
        arrays(x[:, :10])


@pytest.mark.skipif(xgb._trees is None or not xgb._trees.wide(),
                    reason="ensemble.native._trees not built, or this CPU lacks AVX-512")
@pytest.mark.parametrize("depth", [6, 8])
def test_the_16_lane_tree_walk_gives_the_8_lane_walks_floats(depth):
    """Random complete trees (thresholds around the values, both missing-value columns, 39 and 3
    trees: the wide walk takes 2 or 4 trees at once, then the rest one by one) on rows with NaNs,
    infinities and values equal to thresholds: the 16-lane walk and the 8-lane walk give every row the
    same float32 score."""
    from ensemble.native import _trees

    rng = np.random.default_rng(depth)
    n_features, n_internal = 11, (1 << depth) - 1
    for n_trees in (39, 3):
        arrays = xgb.TreeArrays(rng.integers(0, 2 * n_features, n_trees * n_internal).astype(np.uint32),
                                rng.normal(size=n_trees * n_internal).astype(np.float32),
                                rng.normal(size=n_trees << depth).astype(np.float32), depth, 0.3, n_features)
        x = rng.normal(size=(300, n_features)).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = np.nan
        x[rng.random(x.shape) < 0.02] = np.inf
        x[rng.random(x.shape) < 0.02] = -np.inf
        on_threshold = rng.random(x.shape) < 0.3
        x[on_threshold] = rng.choice(arrays.node_threshold, int(on_threshold.sum()))
        for rows in (15, 16, 17, 32, 33, 47, 48, 49, 64, 65, 100, 300):
            try:
                assert _trees.wide(False) is False
                narrow = arrays(x[:rows])
                assert _trees.wide(True) is True
                wide = arrays(x[:rows])
            finally:
                _trees.wide(True)
            np.testing.assert_array_equal(wide.view(np.int32), narrow.view(np.int32), err_msg=f"{n_trees} trees, {rows} rows")


@pytest.mark.skipif(xgb._trees is None, reason="ensemble.native._trees was not built (no C compiler at install)")
def test_tree_arrays_equal_xgboost_on_trained_rows(trained):
    from ensemble.features import transforms
    from ensemble.scoring.pipeline import release_versions
    from ensemble.schema import Model

    versions = release_versions(trained.repository)
    transform = transforms.LeanTransform.load(versions[Model.FEATURES] / "workflow")
    dense, ids = transform(transforms.dense_array(trained.test), transforms.encode_categorical(trained.test))
    scorer = xgb.TreeScorer(versions[Model.XGB])
    assert scorer._arrays is not None
    x = xgb.design_matrix(dense, ids)
    np.testing.assert_allclose(scorer(dense, ids).ravel(), scorer.booster.inplace_predict(x), atol=1e-6)


def test_tree_arrays_leave_other_boosters_to_xgboost(tmp_path):
    import xgboost

    dense, ids = _batch(600, seed=9)
    x = xgb.design_matrix(dense, ids)
    booster = xgboost.train({"objective": "multi:softprob", "num_class": 3, "max_depth": 3},
                            xgboost.DMatrix(x, label=ids[:, 0] % 3), num_boost_round=3)
    booster.save_model(str(tmp_path / xgb.MODEL_FILE))
    assert xgb.TreeArrays.from_json(tmp_path / xgb.MODEL_FILE) is None


def test_xgb_round_trip_and_early_stopping(tmp_path):
    dense, ids = _batch(3000, seed=4)
    y = (dense[:, 0] + 0.1 * ids[:, 0] > 0.2).astype(np.int8)
    x = xgb.design_matrix(dense, ids)
    booster = xgb.train(xgb.XGBConfig(rounds=500, early_stopping=5), x[:2000], y[:2000], x[2000:], y[2000:])
    assert booster.num_boosted_rounds() < 500
    xgb.save(booster, tmp_path)
    np.testing.assert_allclose(xgb.TreeScorer(tmp_path)(dense, ids).ravel(), booster.inplace_predict(x), atol=1e-6)


def test_blend_fit_recovers_weights(tmp_path):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(20000, 3))
    true = np.array([1.0, 0.5, 0.0])
    y = (rng.random(20000) < 1 / (1 + np.exp(-(logits @ true - 0.3)))).astype(int)
    scores = 1 / (1 + np.exp(-logits))
    fitted = blend.Blender.fit(scores, y)
    np.testing.assert_allclose(fitted.weights, true, atol=0.08)
    assert fitted.bias == pytest.approx(-0.3, abs=0.08)
    fitted.save(tmp_path)
    again = blend.Blender.load(tmp_path)
    cols = [scores[:, i:i + 1] for i in range(3)]
    np.testing.assert_array_equal(again(*cols), fitted(*cols))
    assert again(*cols).shape == (20000, 1)
