"""The lean serving transform gives the same tensors as NVTabular's Workflow.transform."""

import numpy as np
import pytest

from ensemble import schema
from ensemble.data import criteo
from ensemble.features import transforms
from ensemble.features.transforms import NULL_ID, OOV_ID, LeanTransform


@pytest.fixture(scope="module")
def lean(trained):
    return LeanTransform.load(trained.workdir / "workflow")


@pytest.fixture(scope="module")
def workflow(trained):
    return transforms.load_workflow(trained.workdir / "workflow")


def _fresh_frame(seed: int, rows: int = 3000):
    # A different seed: most values of big columns are unseen; missing values everywhere.
    frame = criteo.synthesize(criteo.SynthConfig(rows=rows, scale=0.002, seed=seed)).frame
    # as the reader returns it: float32 integers with NaN for missing
    for col in schema.DENSE_COLUMNS:
        frame[col] = frame[col].to_numpy(np.float32, na_value=np.nan)
    frame.loc[::7, "I3"] = -50  # negative -> clipped to 0
    frame.loc[::11, "I5"] = 10**9  # huge
    frame.loc[::5, "C1"] = "not-a-hex-value"
    return frame


@pytest.mark.parametrize("seed", [101, 202])
def test_lean_equals_nvtabular_on_fresh_rows(lean, workflow, seed):
    frame = _fresh_frame(seed)
    nvt_dense, nvt_ids = transforms.nvtabular_transform(workflow, frame)
    dense, ids = lean(transforms.dense_array(frame), transforms.encode_categorical(frame))
    assert dense.dtype == np.float32 and dense.shape == (len(frame), schema.N_DENSE)
    assert ids.dtype == np.int64 and ids.shape == (len(frame), schema.N_CATEGORICAL)
    # bit for bit: the trees were trained on NVTabular's values, and a value one ulp off a split
    # threshold would take the other branch
    np.testing.assert_array_equal(dense, nvt_dense.astype(np.float32))
    np.testing.assert_array_equal(ids, nvt_ids)
    # the comparison covered every kind of id
    assert (ids == NULL_ID).any() and (ids == OOV_ID).any() and (ids > OOV_ID).any()


def test_lean_on_training_rows_matches_too(lean, workflow, trained):
    frame = trained.train.iloc[:2000]
    nvt_dense, nvt_ids = transforms.nvtabular_transform(workflow, frame)
    dense, ids = lean(transforms.dense_array(frame), transforms.encode_categorical(frame))
    np.testing.assert_array_equal(dense, nvt_dense.astype(np.float32))
    np.testing.assert_array_equal(ids, nvt_ids)


def test_lean_handles_what_nvtabular_cannot(lean):
    # One row, every categorical missing (NVTabular 23.08 raises here), non-finite integers.
    dense = np.array([[np.nan, np.inf, -np.inf, 3e38, -1e9, 0, 1, 2, 3, 4, 5, 6, 7]], np.float32)
    cats = np.array([[b""] * 26], dtype=object)
    out_dense, out_ids = lean(dense, cats)
    assert np.isfinite(out_dense).all()
    assert (out_ids == NULL_ID).all()
    # inf is treated as missing, exactly like NaN
    np.testing.assert_array_equal(out_dense[0, 1:3], lean(np.full((1, 13), np.nan, np.float32), cats)[0][0, 1:3])
    odd = np.array([[b"\xff\xfe", b"x" * 100_000, "\u00e9".encode()] + [b"zz"] * 23], dtype=object)
    assert (lean(dense, odd)[1] == OOV_ID).all()


def test_ids_stay_inside_embedding_tables(lean, trained):
    frame = _fresh_frame(303)
    _, ids = lean(transforms.dense_array(frame), transforms.encode_categorical(frame))
    assert (ids >= 1).all() and (ids < np.array(lean.cardinalities)).all()


def test_encode_categorical_maps_missing_to_empty_bytes():
    import pandas as pd

    frame = pd.DataFrame({c: ["ab", None] for c in schema.CATEGORICAL_COLUMNS})
    out = transforms.encode_categorical(frame)
    assert out[0, 0] == b"ab" and out[1, 5] == b""


def test_a_compact_vocabulary_gives_nvtabulars_ids_from_strings_and_from_the_wire(lean, workflow, trained):
    from ensemble import native

    if not native.COMPILED:
        pytest.skip("the compact vocabulary is C (ensemble.native._request)")
    compact = LeanTransform.load(trained.workdir / "workflow", compact_from=1)  # every vocabulary compact
    assert not any(isinstance(lookup, dict) for lookup in compact.lookups)
    assert compact.cardinalities == lean.cardinalities
    frame = pd_concat(_fresh_frame(303), trained.train.iloc[:1500])
    cats = transforms.encode_categorical(frame)
    _, nvt_ids = transforms.nvtabular_transform(workflow, frame)
    _, ids = compact(transforms.dense_array(frame), cats)
    np.testing.assert_array_equal(ids, nvt_ids)
    assert (ids == NULL_ID).any() and (ids == OOV_ID).any() and (ids > OOV_ID).any()
    wire = native.join_wire(cats.reshape(-1).tolist())
    np.testing.assert_array_equal(compact.ids_from_wire(wire, len(frame)), nvt_ids)


def pd_concat(*frames):
    import pandas as pd

    return pd.concat(frames, ignore_index=True)


def test_a_compact_vocabulary_costs_under_a_fifth_of_a_dicts_bytes_per_value():
    import sys

    import pyarrow as pa

    from ensemble import native

    if not native.COMPILED:
        pytest.skip("the compact vocabulary is C (ensemble.native._request)")
    n = 1_000_000
    values = [b"%08x" % v for v in np.random.default_rng(1).choice(2**32, n, replace=False)]
    compact = transforms.compact_lookup(pa.array([v.decode() for v in values]))
    assert len(compact) == n + 1 and compact.collisions == 0  # the values and the empty one
    as_dict = {v: i for i, v in enumerate(values)}
    dict_bytes = sys.getsizeof(as_dict) + sum(sys.getsizeof(v) + sys.getsizeof(i) for v, i in as_dict.items())
    assert compact.nbytes / n <= 18 and compact.nbytes * 5 < dict_bytes, (compact.nbytes / n, dict_bytes / n)
    out = np.empty(3, np.int64)
    compact.find([values[0], values[-1], b"unseen!"], OOV_ID, out)
    assert out.tolist() == [transforms.FIRST_ID, transforms.FIRST_ID + n - 1, OOV_ID]
