"""The declared release: written by deploy/rollback, read by every server start."""

from __future__ import annotations

from ensemble.operate import declared
from ensemble.operate.deploy import _declare


def test_written_release_is_read_back_only_while_the_repository_holds_it(tmp_path):
    (tmp_path / "ranker" / "3").mkdir(parents=True)
    assert declared.read(tmp_path) is None  # nothing declared: the newest serves
    declared.write(tmp_path, 3, "rollback")
    assert declared.read(tmp_path) == 3 and not list((tmp_path / "ranker").glob(".serving.json*"))
    declared.write(tmp_path, 4, "deploy")  # release 4 is not in the repository (pruned, or a typo)
    assert declared.read(tmp_path) is None
    declared.path(tmp_path).write_text("{not json")
    assert declared.read(tmp_path) is None


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
