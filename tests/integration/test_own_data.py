"""A team's own click log, described by a spec file: train, export, serve, score and rank from the
command line, against a real tritonserver. The log is generated here (seeded): users with an age and
a country, items with a price and a few tags (a multi-hot column), clicks that depend on both sides."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from ensemble import dataset, schema
from ensemble.models.registry import Layout
from ensemble.scoring.pipeline import Pipeline
from ensemble.operate.server import ServerOptions, TritonServer
from ensemble.base.machine import free_port

SPEC = """
name = "shop"
label = "clicked"
time = "ts"

[context]
continuous = ["age"]
categorical = ["user", "country"]

[candidate]
continuous = ["price"]
categorical = ["item", "brand"]
multi_hot = ["tags"]

[max_items]
tags = 2

[freq_threshold_by_column]
item = 2

[hash_buckets]
user = 64
"""


def click_log(rows: int = 12_000, seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    users, items = 400, 300
    user_age = rng.integers(18, 70, users)
    user_country = rng.choice(["fr", "de", "us", "br"], users)
    item_price = np.round(rng.gamma(2.0, 20.0, items), 2)
    item_brand = rng.choice([f"b{i}" for i in range(12)], items)
    item_appeal = rng.normal(0, 1, items)
    words = np.array(["sale", "new", "eco", "premium", "local"])
    item_tags = ["|".join(rng.choice(words, rng.integers(0, 4), replace=False)) for _ in range(items)]
    on_sale = np.array(["sale" in t.split("|") for t in item_tags])
    u, i = rng.integers(0, users, rows), rng.integers(0, items, rows)
    logit = (item_appeal[i] - 0.02 * item_price[i] + 0.03 * (user_age[u] - 40) * (item_price[i] > 40)
             + 1.0 * on_sale[i])
    clicked = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    price = item_price[i].astype(float)
    price[rng.random(rows) < 0.05] = np.nan  # some missing values, as real logs have
    return pd.DataFrame({"ts": np.arange(rows), "user": [f"u{x}" for x in u], "country": user_country[u],
                         "age": user_age[u], "item": [f"i{x:03d}" for x in i], "brand": item_brand[i],
                         "price": price, "tags": [item_tags[x] for x in i], "clicked": clicked})


def _with_tag_lists(frame: pd.DataFrame) -> pd.DataFrame:
    """The tags as lists of strings, as a Parquet file of a real log would hold them."""
    return frame.assign(tags=[t.split("|") if t else [] for t in frame["tags"].fillna("")])


def _ensemble(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ensemble", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    root = tmp_path_factory.mktemp("shop")
    (root / "shop.toml").write_text(SPEC)
    log = click_log()
    log.iloc[:8000].to_csv(root / "part-1.csv", index=False)
    _with_tag_lists(log.iloc[8000:]).to_parquet(root / "part-2.parquet", index=False)  # CSV and Parquet together
    done = _ensemble("train", "--dataset", str(root / "shop.toml"), str(root / "part-1.csv"),
                     str(root / "part-2.parquet"), "--workdir", str(root / "work"), "--xgb-rounds", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    done = _ensemble("export", "--workdir", str(root / "work"), "--repository", str(root / "repository"))
    assert done.returncode == 0, done.stderr[-3000:]
    server = TritonServer(ServerOptions(root / "repository", http_port=free_port(), grpc_port=free_port(),
                                        metrics_port=free_port(), log_file=root / "tritonserver.log",
                                        layout=Layout.NATIVE))
    server.start()
    yield root, log, server
    server.stop()


def test_a_spec_with_an_unknown_column_is_refused_naming_it(tmp_path):
    (tmp_path / "bad.toml").write_text(SPEC.replace('"brand"', '"brnad"'))
    click_log(200).to_csv(tmp_path / "log.csv", index=False)
    done = _ensemble("train", "--dataset", str(tmp_path / "bad.toml"), str(tmp_path / "log.csv"),
                     "--workdir", str(tmp_path / "work"))
    assert done.returncode == 2 and "'brnad'" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_own_data_is_served_at_its_widths_and_scores_like_in_process(shop):
    from clients.triton import RankerClient

    root, log, server = shop
    spec = dataset.load_spec(root / "shop.toml")
    test = log.iloc[-1200:]
    pipeline = Pipeline.from_repository(root / "repository", threads=1)
    # 5 categorical columns in the contract; the models see 6 (the tags as 2 slots)
    assert pipeline.widths == schema.Widths(2, 5, context_dense=1, context_categorical=2, category_ids=6)
    user_rows = pipeline.steps[schema.Model.FEATURES].fn.cardinalities[0]
    assert user_rows <= 3 + 64  # 400 users hashed into 64 buckets (+ the reserved ids)
    from ensemble.features import transforms

    want = pipeline.score(transforms.dense_array(test, spec.continuous),
                          transforms.encode_categorical(test, spec.categorical))[schema.SCORE.name].ravel()
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        got = RankerClient(url, protocol, dataset=spec).score(test)
        assert np.max(np.abs(got - want)) <= 1e-5
    # The tags are a set: order and repeats do not change a score; having "sale" does.
    client, row = RankerClient(server.http_url, dataset=spec), test.iloc[:1]
    same = [client.score(row.assign(tags=t))[0] for t in ("new|sale", "sale|new|sale", " sale | new")]
    assert same[0] == same[1] == same[2] != client.score(row.assign(tags="new"))[0]
    from ensemble.models.metrics import auc

    assert auc(test["clicked"], want) > 0.6  # the generated clicks depend on the item and the price


def test_rank_a_file_of_groups_through_the_server_and_in_process(shop, tmp_path):
    root, log, server = shop
    test = log.iloc[-1200:]
    test.to_csv(tmp_path / "groups.csv", index=False)
    common = ["rank", str(tmp_path / "groups.csv"), "--dataset", str(root / "shop.toml"), "--group-by", "user"]
    served = _ensemble(*common, "--url", f"grpc://{server.grpc_url}", "--output", str(tmp_path / "served.parquet"))
    assert served.returncode == 0, served.stderr[-3000:]
    assert "NDCG@10" in served.stdout, served.stdout
    local = _ensemble(*common, "--local", "--repository", str(root / "repository"),
                      "--output", str(tmp_path / "local.csv"))
    assert local.returncode == 0, local.stderr[-3000:]
    a, b = pd.read_parquet(tmp_path / "served.parquet"), pd.read_csv(tmp_path / "local.csv", dtype={"user": str})
    assert len(a) == len(test) and a["user"].nunique() == test["user"].nunique()
    assert (a["row"].to_numpy() == b["row"].to_numpy()).all() and (a["rank"].to_numpy() == b["rank"].to_numpy()).all()
    assert np.max(np.abs(a["score"].to_numpy() - b["score"].to_numpy())) <= 1e-5
    first = a[a["user"] == a["user"].iloc[0]]
    assert first["rank"].tolist() == list(range(1, len(first) + 1)) and first["score"].is_monotonic_decreasing

    top = _ensemble(*common, "--url", server.http_url, "--k", "2", "--output", str(tmp_path / "top.csv"))
    assert top.returncode == 0, top.stderr[-3000:]
    assert pd.read_csv(tmp_path / "top.csv")["rank"].max() == 2


def test_a_group_whose_context_disagrees_is_refused(shop, tmp_path):
    root, log, server = shop
    rows = log.iloc[-50:].copy()
    rows["user"] = "same-user"  # 50 rows of one 'user' with different ages and countries
    rows.to_csv(tmp_path / "mixed.csv", index=False)
    done = _ensemble("rank", str(tmp_path / "mixed.csv"), "--dataset", str(root / "shop.toml"), "--group-by", "user",
                     "--url", server.http_url, "--output", str(tmp_path / "out.csv"))
    assert done.returncode == 2 and "context column" in done.stderr and "differs" in done.stderr, done.stderr


def test_score_files_of_the_dataset_through_the_server(shop, tmp_path):
    root, log, server = shop
    spec = dataset.load_spec(root / "shop.toml")
    test = log.iloc[-1500:].reset_index(drop=True)
    test.iloc[:700].to_csv(tmp_path / "a.csv", index=False)
    test.iloc[700:1100].to_csv(tmp_path / "b.tsv", sep="\t", index=False)
    _with_tag_lists(test.iloc[1100:]).to_parquet(tmp_path / "c.parquet", index=False)
    inputs = [str(tmp_path / n) for n in ("a.csv", "b.tsv", "c.parquet")]
    done = _ensemble("score", *inputs, "--dataset", str(root / "shop.toml"), "--url", f"grpc://{server.grpc_url}",
                     "--batch-size", "256", "--output", str(tmp_path / "scored.parquet"), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1500 rows" in done.stdout and "AUC" in done.stdout, done.stdout
    scored = pd.read_parquet(tmp_path / "scored.parquet")
    assert list(scored.columns) == ["ts", "clicked", "score"]  # passed-through columns, then the score
    assert scored["ts"].tolist() == test["ts"].tolist()  # input order
    from ensemble.features import transforms

    pipeline = Pipeline.from_repository(root / "repository", threads=1)
    want = pipeline.score(transforms.dense_array(test, spec.continuous),
                          transforms.encode_categorical(test, spec.categorical))[schema.SCORE.name].ravel()
    assert np.max(np.abs(scored["score"].to_numpy() - want)) <= 1e-5


def test_a_release_of_the_dataset_deploys_and_rolls_back_live(shop):
    """deploy's checks score fresh rows of the release's own widths (not Criteo's)."""
    from ensemble import cli
    from ensemble.operate.control import Control

    root, _, server = shop
    control = Control.of(server.http_url)
    first = control.serving_release()
    done = _ensemble("export", "--workdir", str(root / "work"), "--repository", str(root / "repository"))
    assert done.returncode == 0, done.stderr[-3000:]
    urls = ["--url", server.http_url, "--grpc-url", server.grpc_url, "--repository", str(root / "repository")]
    assert cli.main(["deploy", *urls]) == 0
    assert control.serving_release() > first
    assert cli.main(["rollback", *urls]) == 0
    assert control.serving_release() == first
