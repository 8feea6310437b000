"""The README and docs/ stay usable: links resolve, commands parse, no development-log vocabulary."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ensemble import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
COMMAND_PREFIXES = ("ensemble ", ".venv/bin/ensemble ")
PLACEHOLDERS = ("...", "…", "<", ">")
HISTORY = re.compile(r"\bstop[ -]?[0-9]+\b|\bround [0-9]+\b|\b(first|second|third) round\b"
                     r"|\b(this|last|previous|next|earlier) (session|stop)\b|\bbefore this change\b", re.I)


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _split(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(prose lines with code blocks blanked, [(fence language, code lines)])."""
    prose, blocks = [], []
    fence, language, code = None, "", []
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence, language, code = match.group(1), match.group(2).lower(), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            blocks.append((language, code))
            fence = None
            prose.append("")
        elif fence is not None:
            code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than '-' and
    '_' dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    prose, _ = _split(page.read_text())
    for line in prose:
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        n = counts.get(anchor, 0)
        counts[anchor] = n + 1
        found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def _links(page: Path) -> list[str]:
    prose, _ = _split(page.read_text())
    text = re.sub(r"`[^`\n]*`", "", "\n".join(prose))  # inline code is not a link
    return LINK.findall(text)


def test_the_pages_exist():
    names = {_relative(p) for p in PAGES}
    assert {"README.md", "docs/cli.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{_relative(page)}: {broken}"


def _commands(page: Path) -> list[str]:
    """Every `ensemble ...` command line in the page's shell code blocks, continuations joined."""
    _, blocks = _split(page.read_text())
    found = []
    for language, code in blocks:
        if language not in SHELL_FENCES:
            continue
        joined, pending = [], ""
        for line in code:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            joined.append(pending + line)
            pending = ""
        for line in joined:
            line = line.strip().removeprefix("$ ")
            if line.startswith(COMMAND_PREFIXES):
                found.append(line)
    return found


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_every_command_line_parses(page):
    failures = []
    for line in _commands(page):
        words = shlex.split(line, comments=True)
        if any(mark in word for word in words for mark in PLACEHOLDERS):
            continue
        try:
            cli.build_parser().parse_args(words[1:])
        except SystemExit:
            failures.append(line)
    assert not failures, f"{_relative(page)}: these lines do not parse with ensemble.cli.build_parser(): {failures}"


def test_the_readme_shows_commands_that_parse():
    assert any(line.startswith(COMMAND_PREFIXES) for line in _commands(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_no_development_log_vocabulary(page):
    hits = [f"line {i}: {m.group(0)!r}" for i, line in enumerate(page.read_text().splitlines(), 1)
            if (m := HISTORY.search(line))]
    assert not hits, f"{_relative(page)} tells history (git log keeps it): {hits}"


def test_no_development_log_vocabulary_in_docs_file_names():
    pattern = re.compile(r"stop[-_]?[0-9]+|round[-_]?[0-9]+|[-_](before|prior|quiet)\b", re.I)
    names = [_relative(p) for p in (ROOT / "docs").rglob("*") if pattern.search(p.name)]
    assert not names, f"result files are named by what they measure, not by when: {names}"


def test_github_anchor_rules():
    assert github_anchor("Load testing and cost") == "load-testing-and-cost"
    assert github_anchor("`ensemble score`: files") == "ensemble-score-files"
    assert github_anchor("What ran here (and what did not)") == "what-ran-here-and-what-did-not"
    assert github_anchor("ensemble baseline-serve") == "ensemble-baseline-serve"


def _documented_layout() -> dict[str, int]:
    """development.md's layout table: place (``ensemble/x/``, ``ensemble/x.py``, ``clients/``) -> layer."""
    section = (ROOT / "docs" / "development.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    places = {}
    for row in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, re.M):
        folder = ""
        for name in re.findall(r"`([^`]+)`", row[1]):
            if "/" in name.rstrip("/"):
                folder = name.rsplit("/", 1)[0] + "/" if not name.endswith("/") else ""
            place = name if "/" in name else folder + name
            places[place] = int(row[0])
    return places


def test_the_development_layout_lists_the_tree_with_its_layers():
    """docs/development.md's layout table names every package folder and top-level module of the tree,
    and each at the layer tests/unit/test_layout.py holds its imports to."""
    from tests.unit.test_layout import _layer

    package = ROOT / "ensemble"
    actual = {f"ensemble/{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    actual |= {f"ensemble/{p.name}" for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    actual |= {"clients/", "loadtest/", "benchmarks/"}
    documented = _documented_layout()
    assert set(documented) == actual
    module = {place: place.removesuffix("/").removesuffix(".py").replace("/", ".") for place in documented}
    assert {place: layer for place, layer in documented.items() if _layer(module[place]) != layer} == {}


def test_serving_md_stays_a_topic_page():
    """docs/serving.md states current behaviour, commands and one table per claim; narratives and
    superseded runs live under docs/results/."""
    assert len((ROOT / "docs" / "serving.md").read_text().splitlines()) <= 300


def test_no_commit_hash_outside_the_results():
    """History lives in git: no word of README.md or docs/*.md (docs/results/ aside) names a commit of
    this repository."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    words = {}
    for page in PAGES:
        if "results" in page.relative_to(ROOT).parts:
            continue
        for word in set(re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text())):
            words.setdefault(word, []).append(_relative(page))
    if not words:
        return
    checked = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                             input="".join(f"{w}^{{commit}}\n" for w in sorted(words)))
    named = [w for w, line in zip(sorted(words), checked.stdout.splitlines()) if line.split()[1:2] == ["commit"]]
    assert {w: words[w] for w in named} == {}


def _readme_layout() -> list[str]:
    """The places (first column) of the README's Layout block, nested ones as ensemble/<name>/."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout\n"):text.index("\n## ", text.index("## Layout\n") + 1)]
    _, code = _split(section)
    places = []
    for line in code[0][1]:
        match = re.match(r"^( *)(\S+/)\s", line)
        if match:
            places.append(("ensemble/" if match.group(1) else "") + match.group(2))
    return places


def test_the_readme_layout_is_the_tree():
    """Every top-level folder of the repository and every folder of the package is in the README's
    Layout block, and everything it names exists; the package docstring names the same folders."""
    import ensemble

    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    documented = _readme_layout()
    tracked = {f.split("/")[0] + "/" for f in files if "/" in f and not f.startswith(".")}
    package = {"ensemble/" + f.split("/")[1] + "/" for f in files if f.startswith("ensemble/") and f.count("/") >= 2}
    assert set(documented) == tracked | package, sorted(set(documented) ^ (tracked | package))
    assert len(documented) == len(set(documented))
    for folder in package:
        assert f"``{folder.removeprefix('ensemble/')}``" in ensemble.__doc__, folder
