import pytest

from ensemble import cli, data, schema


def test_synth_subcommand_writes_criteo(tmp_path, capsys):
    out = tmp_path / "s.tsv.gz"
    assert cli.main(["synth", "--rows", "2000", "--scale", "0.001", "--output", str(out)]) == 0
    assert "best possible AUC" in capsys.readouterr().out
    frame = data.read_criteo([out])
    assert len(frame) == 2000 and list(frame.columns) == list(schema.CRITEO_COLUMNS)


def test_parser_defaults():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.http_port, args.grpc_port, args.metrics_port) == ("127.0.0.1", 8000, 8001, 8002)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--device", "tpu"])
