"""The CLI reference (``docs/cli.md``), rendered from the real parser.

Every subcommand of :func:`ensemble.cli.build_parser` becomes a section: its description, its usage
line and a table of its arguments with their help text and defaults, in the order the parser
declares them. ``tests/unit/test_cli.py`` regenerates the page and fails when the committed copy
differs. Regenerate with::

    .venv/bin/python -m ensemble.cli.reference --write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"
COMMAND = ".venv/bin/python -m ensemble.cli.reference --write"
WIDTH = 100  # usage lines wrap here, whatever the terminal (COLUMNS) says

HEADER = f"""# Command-line reference

<!-- Generated from ensemble.cli.build_parser() by `{COMMAND}`; do not edit by hand
     (tests/unit/test_cli.py fails when this page and the parser differ). -->

One entry point, `ensemble` (`.venv/bin/ensemble` after `make demo` or `make test`), with its
subcommands in pipeline order. `ensemble SUBCOMMAND --help` prints the same text.
"""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no pipes, no line breaks, no absolute paths)."""
    text = " ".join(text.split()).replace(str(ROOT) + "/", "")
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;")):
        text = text.replace(char, escaped)
    return text


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    rows = []
    for action in parser._actions:
        if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
            continue
        invocation = formatter._format_action_invocation(action)
        if action.choices is not None and not action.option_strings:
            invocation = action.dest
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| `{_cell(invocation)}` | {_cell(help_text)} |")
    return rows


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page as Markdown."""
    if parser is None:
        from ensemble.cli import build_parser

        parser = build_parser()
    parser.prog = "ensemble"
    sections = [HEADER]
    subcommands = _subcommands(parser)
    sections.append("| subcommand | what it does |\n| --- | --- |\n" + "\n".join(
        f"| [`{name}`](#ensemble-{name}) | {_cell(sub.description or '')} |" for name, sub in subcommands.items()))
    for name, sub in subcommands.items():
        lines = [f"## ensemble {name}", "", _cell(sub.description or ""), "", "```text", _usage(sub), "```", ""]
        rows = _argument_rows(sub)
        if rows:
            lines += ["| argument | meaning |", "| --- | --- |", *rows]
        sections.append("\n".join(lines).rstrip())
    return "\n\n".join(sections).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ensemble.cli.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)} (default: print it)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text)
        print(f"wrote {PAGE.relative_to(ROOT)}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
