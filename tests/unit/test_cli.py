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


def test_cli_reference_page_is_the_parser():
    """docs/cli.md is generated from the parser; it cannot drift from it."""
    from ensemble.cli import reference as cli_reference

    committed = cli_reference.PAGE.read_text() if cli_reference.PAGE.is_file() else ""
    assert committed == cli_reference.render(), (
        f"{cli_reference.PAGE.relative_to(cli_reference.ROOT)} differs from the parser: "
        f"regenerate it with `{cli_reference.COMMAND}`")


def test_cli_reference_names_every_subcommand_and_option():
    from ensemble.cli import reference as cli_reference

    page = cli_reference.render()
    for name, parser in _subparsers().items():
        section = page.split(f"## ensemble {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert f"`{action.option_strings[0]}" in section, f"ensemble {name} {action.option_strings[0]}"


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


def test_the_renamed_engine_flag_still_takes_its_former_name():
    from ensemble.cli import build_parser
    from ensemble.cli.common import _server_options

    for flag in ("--require-engine", "--require-declared"):
        assert _server_options(build_parser().parse_args(["serve", flag])).require_engine is True
    assert _server_options(build_parser().parse_args(["serve"])).require_engine is False
    for flag in ("--choose", "--declare"):  # ensemble engines: a step's engine chosen by hand
        args = build_parser().parse_args(["engines", flag, "dlrm_torch=c", flag, "dlrm_tf=openvino-f32"])
        assert args.choose == ["dlrm_torch=c", "dlrm_tf=openvino-f32"]
