"""Features out of core: NVTabular fitted and applied on Dask over parts == the in-memory path."""

import numpy as np
import pytest

from ensemble import schema
from ensemble.data import criteo
from ensemble.features import transforms
from ensemble.data import shards
from ensemble.features import out_of_core


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ooc")
    path = criteo.write_synthetic(criteo.SynthConfig(rows=7_000, scale=0.002, seed=21), root / "in.tsv", chunk_rows=2_500).path
    out = out_of_core.build_shards([path], root / "work", root / "work" / "workflow", part_rows=1_500)
    return root, path, out


def test_split_matches_the_in_memory_split(built):
    _, path, out = built
    train, valid, test = criteo.split(criteo.read_criteo([path]))
    assert [out[s].rows for s in out_of_core.Split] == [len(train), len(valid), len(test)]
    assert len(out[out_of_core.Split.TRAIN].files) == 4  # 5,600 rows in parts of 1,500: several partitions


def test_shards_equal_workflow_transform_on_the_whole_frame(built):
    root, path, out = built
    frames = dict(zip(out_of_core.Split, criteo.split(criteo.read_criteo([path]))))
    workflow = transforms.load_workflow(root / "work" / "workflow")
    for split, frame in frames.items():
        dense, ids = transforms.nvtabular_transform(workflow, frame)
        s_dense, s_ids, s_labels = shards.collect(out[split].source(shuffle=False))
        np.testing.assert_array_equal(s_dense, dense.astype(np.float32))
        np.testing.assert_array_equal(s_ids, ids)
        np.testing.assert_array_equal(s_labels, frame[schema.LABEL].to_numpy())


def test_out_of_core_fit_equals_the_in_memory_fit(built):
    root, path, _ = built
    train, _, test = criteo.split(criteo.read_criteo([path]))
    transforms.fit_workflow(train, root / "in_memory")
    ooc = transforms.nvtabular_transform(transforms.load_workflow(root / "work" / "workflow"), test)
    mem = transforms.nvtabular_transform(transforms.load_workflow(root / "in_memory"), test)
    np.testing.assert_array_equal(ooc[1], mem[1])  # same vocabularies, same ids
    # Normalize's mean/std are summed per partition on Dask: equal up to float rounding.
    np.testing.assert_allclose(ooc[0], mem[0], rtol=0, atol=1e-5)
    assert not (root / "work" / "parts").exists()  # raw parts removed after the shards are written
