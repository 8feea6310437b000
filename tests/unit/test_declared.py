"""The declared release: written by deploy/rollback, read by every server start."""

from __future__ import annotations

import json

import pytest

from ensemble.repository import declared
from ensemble.operate.deploy import _declare


def test_a_declared_release_that_is_gone_is_refused_with_its_name_and_the_fix(tmp_path):
    (tmp_path / "ranker" / "3").mkdir(parents=True)
    assert declared.read(tmp_path) is None  # nothing declared: the newest serves
    declared.write(tmp_path, 3, "rollback")
    assert declared.read(tmp_path) == 3 and not list((tmp_path / "ranker").glob(".serving.json*"))
    declared.write(tmp_path, 4, "deploy")  # release 4 is not in the repository (removed by hand, or a typo)
    with pytest.raises(declared.DeclaredMissing, match=r"release 4, declared by deploy .* holds 3\); .*ensemble declare"):
        declared.read(tmp_path)
    with pytest.raises(declared.DeclaredMissing):  # never the newest in its place
        declared.versions(tmp_path)
    declared.path(tmp_path).write_text("{not json")
    with pytest.raises(declared.DeclaredMissing, match="is not a declaration"):
        declared.read(tmp_path)


def test_what_is_declared_is_kept_with_its_steps_and_the_reason(tmp_path):
    for release, steps in ((3, 3), (4, 4), (5, 4), (6, 6)):
        folder = tmp_path / "ranker" / str(release)
        folder.mkdir(parents=True)
        (folder / "release.json").write_text(json.dumps({"versions": {"xgb": steps, "blend": steps}}))
    assert declared.kept(tmp_path) == {}
    declared.write(tmp_path, 3, "rollback", versions=[4],
                   experiment=declared.Experiment(((5, 10.0),)))
    kept = declared.kept(tmp_path)
    assert kept["ranker"] == {3: "the declared release", 4: "listed by the declaration (a release across a fleet)",
                              5: "an experiment's candidate"}
    assert kept["xgb"] == {3: "a step of release 3", 4: "a step of release 4"}  # 5 shares 4's steps
    assert 6 not in kept["ranker"]
    declared.path(tmp_path).write_text("{not json")
    assert declared.kept(tmp_path) == {}  # export never rewrites a declaration it cannot read


def test_a_repository_that_cannot_be_written_leaves_the_switch_standing(tmp_path):
    lines = []
    _declare(tmp_path / "elsewhere", 3, "deploy", lines.append)  # no ranker folder to write into
    assert len(lines) == 1 and "serves but is not declared" in lines[0]
    (tmp_path / "ranker").mkdir()
    _declare(tmp_path, 3, "deploy", lines.append)
    assert "declared in" in lines[1] and declared.path(tmp_path).is_file()


def test_the_declare_command_shows_sets_and_clears(tmp_path, capsys):
    from ensemble import cli

    for release in (3, 4):
        (tmp_path / "ranker" / str(release)).mkdir(parents=True)
        (tmp_path / "ranker" / str(release) / "release.json").write_text("{}")
    repo = ["--repository", str(tmp_path)]
    assert cli.main(["declare", *repo]) == 0 and "declared: none" in capsys.readouterr().out
    assert cli.main(["declare", *repo, "--release", "3"]) == 0 and "release 3" in capsys.readouterr().out
    assert declared.read(tmp_path) == 3
    assert cli.main(["declare", *repo, "--release", "9"]) == 2 and "no release 9" in capsys.readouterr().err
    assert declared.read(tmp_path) == 3  # a refused release changes nothing
    assert cli.main(["declare", *repo, "--clear"]) == 0 and declared.read(tmp_path) is None
    declared.write(tmp_path, 9, "rollback")  # a release that is gone: said in one line, no traceback
    assert cli.main(["declare", *repo]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: release 9, declared by rollback") and "Traceback" not in err


def test_a_release_in_progress_declares_both_versions(tmp_path):
    for version in (3, 4):
        (tmp_path / "ranker" / str(version)).mkdir(parents=True)
    assert declared.versions(tmp_path) is None
    declared.write(tmp_path, 3, "deploy", versions=[3, 4])
    assert declared.read(tmp_path) == 3 and declared.versions(tmp_path) == [3, 4]
    declared.write(tmp_path, 4, "deploy", versions=[4, 5])  # 5 is not in the repository: not loaded
    assert declared.versions(tmp_path) == [4]
    declared.write(tmp_path, 4, "deploy")
    assert declared.versions(tmp_path) == [4]
