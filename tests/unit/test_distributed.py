"""The distributed path on this machine: a LocalCluster of 2 workers for the features and the
trees, two torch.distributed (gloo) processes for the PyTorch DLRM; results equal the
single-process ones within the stated tolerances."""

import numpy as np
import pytest

from ensemble.data import criteo
from ensemble.models import metrics
from ensemble.data import shards
from ensemble.features import out_of_core
from ensemble.models import distributed, dlrm_torch, xgb
from ensemble.models.dlrm import DLRMConfig
from tests.helpers import learnable_tensors

CONFIG = DLRMConfig(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), cardinalities=(5,) * 26, epochs=2, batch_size=256,
                    learning_rate=1e-2)


@pytest.fixture(scope="module")
def client():
    with distributed.dask_client(local_workers=2) as c:
        yield c


@pytest.fixture(scope="module")
def tensors(tmp_path_factory):
    n = 8000
    dense, ids, labels = learnable_tensors(n, seed=5)
    root = tmp_path_factory.mktemp("dist")
    train = shards.write_shards(root / "train", [(dense[a:a + 1500], ids[a:a + 1500], labels[a:a + 1500])
                                                 for a in range(0, 6000, 1500)])
    valid = shards.write_shards(root / "valid", [(dense[6000:7000], ids[6000:7000], labels[6000:7000])])
    return root, train, valid, (dense[7000:], ids[7000:], labels[7000:])


def test_features_on_the_cluster_equal_features_in_process(tmp_path, client):
    path = criteo.write_synthetic(criteo.SynthConfig(rows=5_000, scale=0.002, seed=8), tmp_path / "in.tsv").path
    local = out_of_core.build_shards([path], tmp_path / "local", tmp_path / "local" / "workflow", part_rows=1_500)
    remote = out_of_core.build_shards([path], tmp_path / "remote", tmp_path / "remote" / "workflow", part_rows=1_500,
                                      client=client)
    for split in out_of_core.Split:
        a, b = (shards.collect(s[split].source(shuffle=False)) for s in (local, remote))
        np.testing.assert_array_equal(a[1], b[1])  # ids identical
        np.testing.assert_array_equal(a[2], b[2])
        np.testing.assert_allclose(a[0], b[0], rtol=0, atol=1e-5)  # Normalize statistics summed in another order


def test_trees_on_the_cluster_match_single_process(tensors, client):
    root, train, valid, (dense, ids, labels) = tensors
    config = xgb.XGBConfig(rounds=40, max_depth=4, early_stopping=40, subsample=1.0)
    single = xgb.train_streaming(config, train.source(1500, shuffle=False), valid.source(shuffle=False))
    cluster = distributed.train_trees(client, config, train, valid)
    x = xgb.design_matrix(dense, ids)
    a, b = single.inplace_predict(x), cluster.inplace_predict(x)
    assert metrics.auc(labels, b) > 0.7
    assert abs(metrics.auc(labels, a) - metrics.auc(labels, b)) < 0.01  # sketches merged across workers
    assert np.corrcoef(a, b)[0, 1] > 0.98


@pytest.mark.parametrize("on_cluster", [True, False], ids=["dask-workers", "spawned"])
def test_torch_ddp_matches_single_process(tensors, client, on_cluster, tmp_path):
    root, train, valid, (dense, ids, labels) = tensors
    single = dlrm_torch.train(CONFIG, train.source(CONFIG.batch_size), valid.source(shuffle=False), log=lambda _: None)
    model, ranks = distributed.train_torch(CONFIG, train, valid, tmp_path, client if on_cluster else None, world=2,
                                           log=lambda _: None)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sum(r["rows"] for r in ranks) == train.rows  # rank-partitioned shards cover the split once
    a = metrics.auc(labels, dlrm_torch.predict(single, dense, ids))
    b = metrics.auc(labels, dlrm_torch.predict(model, dense, ids))
    assert b > 0.7
    assert abs(a - b) < 0.02  # other batch orders, the same number of synchronous steps of the same size
