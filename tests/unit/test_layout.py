"""The package's import graph: the core never imports its consumers."""

from __future__ import annotations

import ast
from pathlib import Path

import ensemble

PACKAGE = Path(ensemble.__file__).parent
# The composition roots: they wire the library, the clients and the load test together
# (acceptance.py: the GPU acceptance run, `make gpu-acceptance`).
COMPOSERS = {"cli.py", "demo.py", "demo_movielens.py", "acceptance.py"}


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names in the file, nested ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_ensemble_imports_clients_and_loadtest_only_from_the_command_line_and_demo():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in COMPOSERS:
            continue
        consumers = sorted(m for m in _imported_modules(path) if m.split(".")[0] in ("clients", "loadtest"))
        if consumers:
            offenders[path.relative_to(PACKAGE).as_posix()] = consumers
    assert offenders == {}


def test_folders_are_the_roles_and_nesting_stops_at_one_level():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert folders == ["check", "data", "features", "fleet", "models", "repository", "serving"]
    assert not [p for p in PACKAGE.glob("*/*/__init__.py")], "no package deeper than ensemble/<role>/"
