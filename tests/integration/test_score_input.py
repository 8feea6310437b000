"""`ensemble score` never scores a malformed line silently: file, line and cause, or (with
--skip-bad-lines) skipped and counted; a header is recognised; a missing or empty input is a
one-line error. Uses --local (the same reader as the server path) on small real files."""

from __future__ import annotations

import gzip

import pandas as pd
import pytest

from ensemble import cli, schema
from ensemble.data import criteo
from tests.helpers import SYNTH


@pytest.fixture(scope="module")
def good_lines(tmp_path_factory) -> list[str]:
    frame = criteo.synthesize(criteo.SynthConfig(rows=40, scale=SYNTH.scale, seed=77)).frame
    path = criteo.write_criteo(frame, tmp_path_factory.mktemp("lines") / "good.tsv")
    return path.read_text().splitlines(keepends=True)


def _score(trained, capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["score", *map(str, argv), "--local", "--repository", str(trained.repository), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _with_line(tmp_path, lines, index, replacement, name="in.tsv"):
    lines = list(lines)
    lines[index] = replacement
    path = tmp_path / name
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("fields", [16, 20, 30, 42])
def test_a_line_with_the_wrong_field_count_stops_the_run_naming_file_and_line(trained, capsys, tmp_path,
                                                                             good_lines, fields):
    values = good_lines[6].rstrip("\n").split("\t")
    line = "\t".join((values + ["x"] * 5)[:fields]) + "\n"
    path = _with_line(tmp_path, good_lines, 6, line)
    code, out, err = _score(trained, capsys, path, "--output", tmp_path / "out.parquet")
    assert code == 1 and f"{path}:7: {fields} tab-separated fields, expected 40" in err
    assert not (tmp_path / "out.parquet").exists() and "Traceback" not in err


def test_a_non_numeric_integer_field_is_reported_with_its_column(trained, capsys, tmp_path, good_lines):
    values = good_lines[11].rstrip("\n").split("\t")
    values[3] = "abc"  # I3
    path = _with_line(tmp_path, good_lines, 11, "\t".join(values) + "\n")
    code, _, err = _score(trained, capsys, path, "--output", tmp_path / "out.parquet")
    assert code == 1 and f"{path}:12: I3 b'abc' is not a number" in err


def test_skip_bad_lines_scores_the_rest_and_counts(trained, capsys, tmp_path, good_lines):
    lines = list(good_lines)
    lines[3] = "1\t2\t3\n"
    values = lines[20].rstrip("\n").split("\t")
    values[0] = "yes"
    lines[20] = "\t".join(values) + "\n"
    path = tmp_path / "mixed.tsv"
    path.write_text("".join(lines))
    code, out, _ = _score(trained, capsys, path, "--output", tmp_path / "out.parquet", "--skip-bad-lines")
    assert code == 0 and "2 malformed line(s) skipped" in out and f"{path}:4:" in out and f"{path}:21:" in out
    scored = pd.read_parquet(tmp_path / "out.parquet")
    assert len(scored) == len(good_lines) - 2


def test_a_header_line_is_recognised(trained, capsys, tmp_path, good_lines):
    path = tmp_path / "with_header.tsv.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("\t".join(schema.CRITEO_COLUMNS) + "\n" + "".join(good_lines))
    code, out, _ = _score(trained, capsys, path, "--output", tmp_path / "out.parquet")
    assert code == 0 and len(pd.read_parquet(tmp_path / "out.parquet")) == len(good_lines)


@pytest.mark.parametrize("case", ["missing", "empty", "blank"])
def test_missing_or_empty_input_is_a_one_line_error(trained, capsys, tmp_path, case):
    path = tmp_path / "in.tsv"
    if case != "missing":
        path.write_text("" if case == "empty" else "\n\n")
    code, _, err = _score(trained, capsys, path, "--output", tmp_path / "out.parquet")
    reason = "no such file" if case == "missing" else "empty file"
    assert code == 1 and err.startswith(f"error: {path}: {reason}") and "Traceback" not in err
