"""Dataset specs: parsing, their errors, the frames they refuse, and what the pipeline derives."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from ensemble import dataset, native, schema
from ensemble.dataset import Kind, SpecError
from ensemble.models.metrics import ranking_quality
from ensemble.models.registry import Layout
from ensemble.repository import configs

SPEC = """
name = "clicks"
label = "clicked"
time = "ts"
freq_threshold = 2

[context]
continuous = ["age"]
categorical = ["user", "country"]

[candidate]
continuous = ["price"]
categorical = ["item"]

[freq_threshold_by_column]
item = 5
"""


def _frame(n: int = 6) -> pd.DataFrame:
    return pd.DataFrame({"clicked": [0, 1] * (n // 2), "ts": range(n), "age": np.arange(n, dtype=float),
                         "user": [f"u{i % 3}" for i in range(n)], "country": ["fr", None] * (n // 2),
                         "price": np.linspace(1, 2, n), "item": [f"i{i}" for i in range(n)]})


def test_criteo_is_the_built_in_default_and_keeps_its_contract():
    spec = dataset.load_spec()
    assert spec.name == "criteo" and spec is not None
    assert spec.continuous == tuple(f"I{i}" for i in range(1, 14)) == schema.DENSE_COLUMNS
    assert spec.categorical == tuple(f"C{i}" for i in range(1, 27)) == schema.CATEGORICAL_COLUMNS
    assert schema.CRITEO_COLUMNS == ("label", *spec.continuous, *spec.categorical)
    assert spec.context == () and set(spec.freq_thresholds.values()) == {3}
    assert schema.CRITEO_WIDTHS == schema.Widths(13, 26)
    assert schema.sized(schema.FUSED_STEP, schema.CRITEO_WIDTHS) is schema.FUSED_STEP


def test_a_spec_orders_columns_context_first_and_keeps_per_column_thresholds():
    spec = dataset.parse_spec(SPEC)
    assert spec.continuous == ("age", "price") and spec.categorical == ("user", "country", "item")
    assert spec.context == ("age", "user", "country") and spec.candidate == ("price", "item")
    assert spec.context_width(Kind.CATEGORICAL) == 2 and spec.context_width(Kind.CONTINUOUS) == 1
    assert spec.freq_thresholds == {"user": 2, "country": 2, "item": 5}
    assert spec.time == "ts" and spec.label == "clicked"
    spec.check_frame(_frame())


def test_movielens_spec_is_built_in():
    spec = dataset.load_spec("movielens100k")
    assert schema.Widths.of(spec) == schema.Widths(21, 5, context_dense=1, context_categorical=4)
    assert "user_id" in spec.context and "movie_id" in spec.candidate
    assert (spec.key(dataset.Side.CONTEXT), spec.key(dataset.Side.CANDIDATE)) == ("user_id", "movie_id")
    assert dataset.load_spec("criteo").keys == ()
    assert set(dataset.builtin_names()) >= {"criteo", "movielens100k"}


@pytest.mark.parametrize("text, message", [
    ('name = "x"\nlabel = "y"\nlabels = 1\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]', "unknown key(s) labels"),
    ('label = "y"\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]', "'name' is required"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = ["a"]\ncategorical = ["a"]', "'a' is listed twice"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = ["y"]\ncategorical = ["b"]', "'y' is the label"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]\nlists = ["c"]',
     "unknown key(s) lists in [candidate]"),
    ('name = "x"\nlabel = "y"\n[context]\ncontinuous = ["a"]\ncategorical = ["b"]', "no candidate column"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncategorical = ["b"]', "at least one continuous and one categorical"),
    ('name = "x"\nlabel = "y"\nfreq_threshold = 0\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]', "integer >= 1"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]\n[freq_threshold_by_column]\na = 2',
     "names 'a', which is not a categorical column"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = "a"\ncategorical = ["b"]', "candidate.continuous must be a list"),
    ('name = "x"\nlabel = [', "not valid TOML"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]\nkey = "a"',
     "[candidate] key 'a' must name one of the side's categorical"),
    ('name = "x"\nlabel = "y"\n[context]\ncategorical = ["u"]\nkey = "b"\n[candidate]\ncontinuous = ["a"]\n'
     'categorical = ["b"]', "[context] key 'b' must name one of the side's categorical"),
    ('name = "x"\nlabel = "y"\n[candidate]\ncontinuous = ["a"]\ncategorical = ["b"]\nmulti_hot = ["g"]\nkey = "g"\n'
     '[max_items]\ng = 2', "key 'g' must name one of the side's categorical (not multi-hot)"),
])
def test_a_wrong_spec_is_refused_naming_what_is_wrong(text, message):
    with pytest.raises(SpecError) as err:
        dataset.parse_spec(text, "mine.toml")
    assert message in str(err.value) and "mine.toml" in str(err.value)


@pytest.mark.parametrize("change, message", [
    (lambda f: f.drop(columns=["price"]), "column(s) 'price' of the spec not in the data"),
    (lambda f: f.assign(country=None), "categorical column 'country' has no values"),
    (lambda f: f.assign(country=""), "categorical column 'country' has no values"),
    (lambda f: f.assign(clicked=[0, 1, 2, 0, 1, 5]), "label 'clicked' must be 0 or 1; found [2, 5]"),
    (lambda f: f.assign(clicked=["no", "yes"] * 3), "label 'clicked' must be 0 or 1"),
    (lambda f: f.assign(clicked=[0, 1, None, 0, 1, 0]), "label 'clicked' is missing in 1 row(s)"),
    (lambda f: f.assign(age=["young"] * 6), "continuous column 'age' is not numeric"),
])
def test_data_that_does_not_match_the_spec_is_refused_naming_the_column(change, message):
    spec = dataset.parse_spec(SPEC)
    with pytest.raises(SpecError) as err:
        spec.check_frame(change(_frame()))
    assert message in str(err.value)


def test_unknown_spec_name_lists_the_built_in_ones(tmp_path):
    with pytest.raises(SpecError, match="criteo, movielens100k"):
        dataset.load_spec("nosuch")
    path = tmp_path / "mine.toml"
    path.write_text(SPEC)
    assert dataset.load_spec(path).name == "clicks"


def test_configs_of_every_layout_take_the_dataset_widths():
    widths = schema.Widths(21, 5)
    for layout in Layout:
        for name, config in configs.layout_configs(layout, widths=widths).items():
            tensors = {t.name: list(t.dims) for t in (*config.input, *config.output)}
            for tensor, dims in tensors.items():
                if tensor in (schema.DENSE.name, schema.DENSE_FEATURES.name):
                    assert dims == [21], (layout, name)
                if tensor in (schema.CATEGORICAL.name, schema.CATEGORY_IDS.name):
                    assert dims == [5], (layout, name)
            for sample in config.model_warmup:  # warm-up samples must have the served shapes too
                for tensor, entry in sample.inputs.items():
                    assert list(entry.dims) == tensors[tensor], (layout, name, tensor)
    # Criteo's configs are what they always were (the committed files are compared in test_configs).
    assert configs.layout_texts(Layout.FUSED) == configs.layout_texts(Layout.FUSED, widths=schema.CRITEO_WIDTHS)


def test_widths_are_read_back_from_a_served_config():
    from google.protobuf import json_format

    config = configs.layout_configs(Layout.NATIVE, widths=schema.Widths(21, 5))["ranker"]
    as_json = json.loads(json_format.MessageToJson(config, preserving_proto_field_name=True))
    assert schema.widths_of_config(as_json) == schema.Widths(21, 5)
    assert schema.widths_of_config({"input": [], "output": []}) == schema.CRITEO_WIDTHS


def test_ranking_quality_by_hand():
    # Group a: the positive ranked second -> NDCG 1/log2(3), RR 1/2. Group b: positive first -> 1, 1.
    # Group c: only positives (every order scores the same) -> skipped.
    groups = ["a", "a", "a", "b", "b", "c"]
    q = ranking_quality(groups, [0, 1, 0, 1, 0, 1], [0.9, 0.5, 0.1, 0.7, 0.2, 0.3], k=10)
    assert q.groups == 2 and q.skipped == 1
    assert q.ndcg == pytest.approx((1 / np.log2(3) + 1) / 2) and q.mrr == pytest.approx(0.75)


def test_ranking_quality_ties_keep_candidate_order_and_k_cuts():
    # All scores tie: the order is the order sent; the positive is third.
    q = ranking_quality([1, 1, 1], [0, 0, 1], [0.5, 0.5, 0.5], k=2)
    assert q.ndcg == 0.0 and q.mrr == pytest.approx(1 / 3)
    q = ranking_quality([1, 1, 1], [1, 0, 0], [0.5, 0.5, 0.5], k=1)
    assert q.ndcg == 1.0 and q.mrr == 1.0
    assert np.isnan(ranking_quality([1, 1], [1, 1], [0.1, 0.2]).ndcg)


def test_broadcast_puts_the_context_first_on_every_candidate():
    from ensemble.scoring.ranking import broadcast

    dense, cats = broadcast(np.array([7.0]), np.array([b"u1", b"fr"], object),
                            np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[b"i1"], [b"i2"]], object), (1, 2))
    assert dense.tolist() == [[7.0, 1.0, 2.0], [7.0, 3.0, 4.0]] and dense.dtype == np.float32
    assert cats.tolist() == [[b"u1", b"fr", b"i1"], [b"u1", b"fr", b"i2"]]
    # No context (Criteo): the candidates are the rows.
    dense, cats = broadcast(None, None, np.ones((3, 13)), np.full((3, 26), b"", object))
    assert dense.shape == (3, 13) and cats.shape == (3, 26)


@pytest.mark.parametrize("call, message", [
    (lambda b: b(np.array([7.0]), np.array([b"u"], object), np.zeros((0, 2)), np.zeros((0, 1), object), (1, 1)),
     "empty candidate list"),
    (lambda b: b(np.array([7.0, 8.0]), np.array([b"u"], object), np.zeros((2, 2)), np.zeros((2, 1), object), (1, 1)),
     "context_dense has 2 values; this dataset's context has 1"),
    (lambda b: b(None, None, np.zeros((2, 2)), np.zeros((3, 1), object)), "candidate_categorical 3"),
    (lambda b: b(None, None, np.zeros(2), np.zeros((2, 1), object)), "[N x columns]"),
])
def test_a_bad_ranking_request_is_refused_clearly(call, message):
    from ensemble.scoring.ranking import RankError, broadcast

    with pytest.raises(RankError) as err:
        call(broadcast)
    assert message in str(err.value)


def test_top_orders_best_first_keeps_ties_and_cuts_at_k():
    from ensemble.scoring.ranking import RankError, top

    scores = np.array([0.2, 0.9, 0.5, 0.9, 0.1], np.float32)
    assert top(scores).tolist() == [1, 3, 2, 0, 4]
    assert top(scores, 2).tolist() == [1, 3] and top(scores, 0).tolist() == [1, 3, 2, 0, 4]
    assert top(scores, 10).tolist() == [1, 3, 2, 0, 4] and top(np.array([0.3]), 1).tolist() == [0]
    with pytest.raises(RankError, match="top_k must be >= 0"):
        top(scores, -1)


def test_hash_buckets_are_parsed_and_checked():
    spec = dataset.parse_spec(SPEC + "\n[hash_buckets]\nuser = 64\n")
    assert spec.hash_buckets == (64, 0, 0)
    for bad, message in (("user = 1", "integer >= 2"), ('user = "8"', "integer >= 2"),
                         ("age = 8", "[hash_buckets] names 'age', which is not a categorical column")):
        with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
            dataset.parse_spec(SPEC + f"\n[hash_buckets]\n{bad}\n")


def test_a_hashed_column_has_exactly_its_buckets_and_ids_from_the_hash_alone():
    import zlib

    from ensemble import native

    spec = dataset.parse_spec(SPEC + "\n[hash_buckets]\nuser = 4\n")
    assert spec.hashed_columns == ("user",)
    values = ["a", None, "", "b", "a", "c", float("nan")]
    ids = native.hash_ids(values, 4)
    assert ids.tolist() == [zlib.crc32(b"a") % 4, 0, 0, zlib.crc32(b"b") % 4, zlib.crc32(b"a") % 4,
                            zlib.crc32(b"c") % 4, 0]  # missing: the empty value's row (crc32(b"") = 0)
    assert native.hash_ids([b"a", "a"], 4).tolist() == [ids[0]] * 2  # bytes and text alike
    frame = _frame().assign(user=["a", None, "", "b", "a", "c"])
    assert spec.prepared(frame) is frame  # values pass through; the features step hashes them


def test_a_table_shape_hashes_every_column_into_its_rows():
    shaped = dataset.with_table_shape(schema.CRITEO, "criteo-1tb")
    assert shaped.hash_buckets == dataset.TABLE_SHAPES["criteo-1tb"] and sum(shaped.hash_buckets) == 204_184_588
    assert shaped.hashed_columns == schema.CRITEO.categorical and dataset.with_table_shape(schema.CRITEO, None) is schema.CRITEO
    with pytest.raises(SpecError, match="no table shape 'criteo-2tb'"):
        dataset.with_table_shape(schema.CRITEO, "criteo-2tb")
    with pytest.raises(SpecError, match="26 tables for 3 categorical columns"):
        dataset.parse_spec(SPEC).with_hash_buckets(dataset.TABLE_SHAPES["criteo-1tb"])


def test_lean_transform_of_a_hashed_column_equals_nvtabular(tmp_path):
    from ensemble.features import transforms

    spec = dataset.parse_spec(SPEC + "\n[hash_buckets]\nuser = 16\n")
    rng = np.random.default_rng(0)
    n = 3000
    train = pd.DataFrame({"clicked": rng.integers(0, 2, n), "ts": range(n), "age": rng.integers(18, 80, n).astype(float),
                          "user": [f"u{v}" for v in rng.integers(0, 500, n)], "country": rng.choice(["fr", "de"], n),
                          "price": rng.gamma(2, 10, n), "item": [f"i{v}" for v in rng.integers(0, 40, n)]})
    transforms.fit_workflow(train, tmp_path / "workflow", spec=spec)
    lean = transforms.LeanTransform.load(tmp_path / "workflow")
    assert lean.hash_buckets == (16, 0, 0) and lean.cardinalities[0] == 16  # exactly its buckets
    assert lean.lookups[0] == {}  # no vocabulary for it
    fresh = train.assign(user=[f"new{v}" for v in range(n)])  # never seen: still hashed into buckets
    fresh.loc[::9, "user"] = None
    want = transforms.nvtabular_transform(tmp_path / "workflow", fresh, spec=spec)
    got = lean(transforms.dense_array(fresh, spec.continuous), transforms.encode_categorical(fresh, spec.categorical))
    assert np.array_equal(got[1], want[1]) and np.allclose(got[0], want[0])
    assert got[1][:, 0].max() < 16 and (got[1][::9, 0] == 0).all()  # missing: the empty value's bucket
    wire = native.join_wire(transforms.encode_categorical(fresh, spec.categorical).reshape(-1).tolist())
    assert np.array_equal(lean.ids_from_wire(wire, n), got[1])  # the C path from Triton's buffer


MULTI_HOT = SPEC.replace('categorical = ["item"]', 'categorical = ["item"]\nmulti_hot = ["tags"]') + "\n[max_items]\ntags = 3\n"


def test_multi_hot_columns_are_parsed_and_checked():
    spec = dataset.parse_spec(MULTI_HOT)
    assert spec.categorical == ("user", "country", "item", "tags")  # the contract: one column
    assert spec.model_categorical == ("user", "country", "item", "tags[0]", "tags[1]", "tags[2]")
    assert spec.max_items == (0, 0, 0, 3) and spec.freq_thresholds["tags[2]"] == 2
    widths = schema.Widths.of(spec)
    assert (widths.categorical, widths.ids) == (4, 6)
    assert widths.dims(schema.CATEGORICAL) == (4,) and widths.dims(schema.CATEGORY_IDS) == (6,)
    assert schema.Widths.of(schema.CRITEO) == schema.Widths(13, 26)  # no slots: one form
    assert spec.list_separator == "|" and dataset.parse_spec('list_separator = ";"\n' + MULTI_HOT).list_separator == ";"
    for text, message in (
            (MULTI_HOT.replace("\n[max_items]\ntags = 3\n", ""), "multi-hot column 'tags' needs its most items"),
            (MULTI_HOT.replace("tags = 3", "tags = 0"), "max_items must be an integer from 1 to 64"),
            (MULTI_HOT.replace("tags = 3", "tags = 3\nitem = 3"), "[max_items] names 'item', which is not a multi-hot"),
            (MULTI_HOT + "\n[hash_buckets]\ntags = 8\n", "multi-hot column 'tags' cannot be hashed"),
            (MULTI_HOT.replace('continuous = ["price"]', 'continuous = ["price", "tags[1]"]'),
             "its slot name 'tags[1]' is taken"),
            (MULTI_HOT.replace("multi_hot", "multihot"), "unknown key(s) multihot in [candidate]"),
            ('list_separator = ""\n' + MULTI_HOT, "'list_separator' must be a non-empty string")):
        with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            dataset.parse_spec(text)


def test_list_slots_are_a_sorted_set_cut_to_max_items():
    assert dataset.list_slots(b"drama|comedy|drama", b"|", 3) == [b"comedy", b"drama", b""]
    assert dataset.list_slots(b"d|c|b|a", b"|", 2) == [b"a", b"b"]
    assert dataset.list_slots(b"", b"|", 2) == [b"", b""] and dataset.list_slots(b"||x| ", b"|", 1) == [b"x"]
    assert dataset.cell_bytes(["b", "a"]) == b"b|a" and dataset.cell_bytes(np.array(["x"], object), ";") == b"x"
    assert dataset.cell_bytes(None) == dataset.cell_bytes(float("nan")) == b""
    spec = dataset.parse_spec(MULTI_HOT)
    frame = _frame().assign(tags=["a|b", None, ["c", "a"], "", "b|b", "z|y|x|w"])
    slots = spec.prepared(frame)
    assert "tags" not in slots and list(slots.columns[-3:]) == ["tags[0]", "tags[1]", "tags[2]"]
    assert slots["tags[0]"].tolist() == ["a", None, "a", None, "b", "w"]
    assert slots["tags[1]"].tolist() == ["b", None, "c", None, None, "x"]


def test_lean_transform_of_a_multi_hot_column_equals_nvtabular(tmp_path):
    from ensemble.features import transforms

    spec = dataset.parse_spec(MULTI_HOT)
    rng = np.random.default_rng(1)
    n = 2000
    words = [f"t{i}" for i in range(12)]
    tags = ["|".join(rng.choice(words, rng.integers(0, 5), replace=False)) for _ in range(n)]
    train = pd.DataFrame({"clicked": rng.integers(0, 2, n), "ts": range(n), "age": rng.integers(18, 80, n).astype(float),
                          "user": [f"u{v}" for v in rng.integers(0, 50, n)], "country": rng.choice(["fr", "de"], n),
                          "price": rng.gamma(2, 10, n), "item": [f"i{v}" for v in rng.integers(0, 40, n)], "tags": tags})
    transforms.fit_workflow(train, tmp_path / "workflow", spec=spec)
    lean = transforms.LeanTransform.load(tmp_path / "workflow")
    assert lean.id_columns == spec.model_categorical and len(lean.cardinalities) == 6
    assert transforms.workflow_widths(tmp_path / "workflow") == schema.Widths(2, 4, 1, 2, 6)
    fresh = train.copy()
    fresh.loc[::7, "tags"] = "unseen|t3"
    fresh.loc[1::7, "tags"] = None
    want = transforms.nvtabular_transform(tmp_path / "workflow", fresh, spec=spec)
    got = lean(transforms.dense_array(fresh, spec.continuous), transforms.encode_categorical(fresh, spec.categorical))
    assert got[1].shape == (n, 6) and np.array_equal(got[1], want[1]) and np.allclose(got[0], want[0])
    assert (got[1][1::7, 3:] == transforms.NULL_ID).all()  # no tags: every slot missing


@pytest.mark.parametrize("value, named", [(None, None), ("7", "7"), (" 12 ", "12"), (7, "7")])
def test_a_ranking_requests_release_is_a_version_number(value, named):
    from ensemble.scoring import ranking

    assert ranking.release_named(value) == named


@pytest.mark.parametrize("value", ["latest", "", "-1", "1.5", "\ufffd\ufffd", "٣"])
def test_anything_else_named_as_the_release_is_the_clients_error(value):
    from ensemble.scoring import ranking

    with pytest.raises(ranking.RankError, match="must name a release"):
        ranking.release_named(value)


def test_more_candidates_than_the_limit_are_refused_naming_it():
    from ensemble.scoring import ranking

    ranking.check_count(8192, 8192)
    with pytest.raises(ranking.RankError, match="at most 8192.*max_candidates"):
        ranking.check_count(8193, 8192)
    assert ranking.max_candidates({}, 8192) == 8192 and ranking.max_candidates({"max_candidates": "100"}, 8192) == 100
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError, match="max_candidates must be a positive integer"):
            ranking.max_candidates({"max_candidates": bad}, 8192)
