"""Every model trains from streamed shards as it does from in-memory arrays."""

import numpy as np
import pytest

from ensemble.models import metrics
from ensemble.data import shards
from ensemble.models import dlrm_tf, dlrm_torch, xgb
from ensemble.models.dlrm import DLRMConfig
from tests.helpers import learnable_tensors

CONFIG = DLRMConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), cardinalities=(5,) * 26, epochs=2, batch_size=256,
                    learning_rate=1e-2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    n = 8000
    dense, ids, labels = learnable_tensors(n, seed=3)
    root = tmp_path_factory.mktemp("stream")
    cut = [(a, min(a + 900, 6000)) for a in range(0, 6000, 900)]
    train = shards.write_shards(root / "train", [(dense[a:b], ids[a:b], labels[a:b]) for a, b in cut])
    valid = shards.write_shards(root / "valid", [(dense[6000:7000], ids[6000:7000], labels[6000:7000])])
    test = (dense[7000:], ids[7000:], labels[7000:])
    return root, train, valid, test


@pytest.mark.parametrize("module", [dlrm_torch, dlrm_tf])
def test_dlrms_learn_from_a_shard_source(data, module):
    _, train, valid, (dense, ids, labels) = data
    model = module.train(CONFIG, train.source(CONFIG.batch_size, buffer_rows=2000), valid.source(shuffle=False),
                         log=lambda _: None)
    assert metrics.auc(labels, module.predict(model, dense, ids)) > 0.7


@pytest.mark.parametrize("matrix", list(xgb.XGBMatrix))
def test_trees_from_an_iterator_match_trees_from_a_dmatrix(data, matrix):
    root, train, valid, (dense, ids, labels) = data
    config = xgb.XGBConfig(rounds=40, max_depth=4, early_stopping=40, subsample=1.0)
    streamed = xgb.train_streaming(config, train.source(1000, shuffle=False), valid.source(shuffle=False), matrix,
                                   root / f"cache-{matrix.value}")
    tr, va = (shards.collect(s.source(shuffle=False)) for s in (train, valid))
    whole = xgb.train(config, xgb.design_matrix(tr[0], tr[1]), tr[2], xgb.design_matrix(va[0], va[1]), va[2])
    x = xgb.design_matrix(dense, ids)
    a, b = streamed.inplace_predict(x), whole.inplace_predict(x)
    assert metrics.auc(labels, a) > 0.7
    # Quantile sketches merged batch by batch put a few bin edges elsewhere than one sketch of
    # all rows: the two forests differ slightly, not in quality.
    assert abs(metrics.auc(labels, a) - metrics.auc(labels, b)) < 0.01
    assert np.corrcoef(a, b)[0, 1] > 0.98
