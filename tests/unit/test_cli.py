import pytest

from ensemble import cli, schema
from ensemble.data import criteo


def test_synth_subcommand_writes_criteo(tmp_path, capsys):
    out = tmp_path / "s.tsv.gz"
    assert cli.main(["synth", "--rows", "2000", "--scale", "0.001", "--output", str(out)]) == 0
    assert "best possible AUC" in capsys.readouterr().out
    frame = criteo.read_criteo([out])
    assert len(frame) == 2000 and list(frame.columns) == list(schema.CRITEO_COLUMNS)


def test_parser_defaults():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.http_port, args.grpc_port, args.metrics_port) == ("127.0.0.1", 8000, 8001, 8002)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--device", "tpu"])


def _subparsers():
    import argparse

    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_has_help_and_shows_its_default():
    for name, parser in _subparsers().items():
        assert parser.description, f"{name}: no description line"
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings[0]}: no help text"
            if action.default not in (None, False):
                shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
                assert f"(default:{shown})".replace(" ", "") in "".join(text.split()), \
                    f"{name} {action.option_strings[0]}: default {action.default!r} not shown"


def test_every_subcommand_and_option_is_in_the_readme_cli_block():
    """The README's CLI block cannot drift from the parser: each subcommand's line(s) name every
    option it has (`demo` refers to the synth/train/serve flags)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## CLI", 1)[1].split("```", 2)[1]
    segments = dict(re.findall(r"^ensemble ([a-z-]+)(.*?)(?=^ensemble |\Z)", block, re.M | re.S))
    subparsers = _subparsers()
    assert set(segments) == set(subparsers)
    for name, parser in subparsers.items():
        options = [a.option_strings[-1] for a in parser._actions if a.option_strings and a.dest != "help"]
        text = segments[name] + (segments["synth"] + segments["train"] + segments["serve"] if name == "demo" else "")
        missing = [o for o in options if not re.search(re.escape(o) + r"\b", text)]
        assert not missing, f"README CLI block: `ensemble {name}` lacks {missing}"


def test_help_answers_without_importing_pandas():
    from tests.helpers import modules_loaded

    assert modules_loaded("from ensemble import cli; cli.build_parser().format_help()", ("pandas",)) == []


@pytest.mark.parametrize("argv, message", [
    (["--local", "--url", "127.0.0.1:8000", "--output", "o.parquet"], "does not use --url"),
    (["--url", "127.0.0.1:8000", "--output", "o.json"], "Parquet (.parquet) or CSV (.csv), not .json"),
])
def test_score_refuses_contradictory_or_unsupported_options(tmp_path, capsys, argv, message):
    assert cli.main(["score", str(tmp_path / "in.tsv"), *argv]) == 2
    assert message in capsys.readouterr().err
