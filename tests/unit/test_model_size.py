"""Model sizes: a named size, then the dataset spec's [model] table, then the command line's widths."""

from dataclasses import replace

import pytest

from ensemble import cli, dataset
from ensemble.base import model_size
from ensemble.models.dlrm import DLRMConfig
from ensemble.models.xgb import XGBConfig


def _config(argv: list[str]):
    args = cli.build_parser().parse_args(["train", "x.tsv", *argv])
    return cli._train_config(args)


def test_the_demo_size_is_what_training_always_defaulted_to():
    config = _config([])
    defaults = DLRMConfig()
    assert (config.dlrm.embedding_dim, config.dlrm.bottom_mlp, config.dlrm.top_mlp) == \
        (defaults.embedding_dim, defaults.bottom_mlp, defaults.top_mlp)
    assert (config.xgb.rounds, config.xgb.max_depth) == (XGBConfig().rounds, XGBConfig().max_depth)


def test_the_seed_size_is_the_dlrm_references_criteo_configuration():
    config = _config(["--model-size", "seed"])
    assert config.dlrm.embedding_dim == 128 and config.dlrm.bottom_mlp == (512, 256)
    assert config.dlrm.top_mlp == (1024, 1024, 512, 256)
    assert (config.xgb.rounds, config.xgb.max_depth) == (1000, 8)


def test_explicit_widths_change_the_size_they_are_given_with():
    config = _config(["--model-size", "seed", "--top-mlp", "256,128", "--xgb-depth", "6", "--embedding-dim", "64"])
    assert config.dlrm.top_mlp == (256, 128) and config.dlrm.bottom_mlp == (512, 256)
    assert config.dlrm.embedding_dim == 64 and config.xgb.max_depth == 6 and config.xgb.rounds == 1000


def test_a_spec_sets_the_size_and_the_command_line_overrides_it(tmp_path):
    text = dataset.BUILTIN_DIR.joinpath("criteo.toml").read_text()
    spec = tmp_path / "big.toml"
    spec.write_text(text.replace('name = "criteo"', 'name = "criteo-big"')
                    + '\n[model]\nsize = "seed"\nembedding_dim = 32\ntop_mlp = [64]\n')
    config = _config(["--dataset", str(spec)])
    assert (config.dlrm.embedding_dim, config.dlrm.bottom_mlp, config.dlrm.top_mlp) == (32, (512, 256), (64,))
    assert config.xgb.rounds == 1000
    config = _config(["--dataset", str(spec), "--model-size", "demo", "--embedding-dim", "8"])
    assert (config.dlrm.embedding_dim, config.dlrm.bottom_mlp, config.dlrm.top_mlp) == (8, (64, 32), (64,))


@pytest.mark.parametrize("table, message", [
    ('size = "huge"', "size must be one of demo, seed"),
    ("depth = 3", "unknown key"),
    ("top_mlp = [0, 8]", "top_mlp must be a list of positive widths"),
    ("embedding_dim = 1.5", "embedding_dim must be a positive integer"),
    ('xgb_rounds = "many"', "xgb_rounds must be a positive integer"),
])
def test_a_bad_model_table_is_refused_naming_the_setting(table, message):
    text = dataset.BUILTIN_DIR.joinpath("criteo.toml").read_text() + f"\n[model]\n{table}\n"
    with pytest.raises(dataset.SpecError, match=message):
        dataset.parse_spec(text, "bad.toml")


@pytest.mark.parametrize("argv", [["--top-mlp", "1024,x"], ["--bottom-mlp", "0"], ["--model-size", "large"]])
def test_bad_widths_on_the_command_line_are_refused_before_training(argv, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "x.tsv", *argv])
    assert "error" in capsys.readouterr().err


def test_resolve_keeps_every_size_valid():
    for name, size in model_size.SIZES.items():
        assert model_size.resolve(name, {}, {}) == size.check(name)
    with pytest.raises(model_size.SizeError):
        replace(model_size.SIZES["demo"], bottom_mlp=(8, -1)).check()
