"""The project's import graph: layers in pipeline order, every arrow pointing down, no circle.

The layers, bottom up (a module may import its own layer and those below it, nothing above; a
function-level import counts as much as one at the top of a file):

0. ``ensemble.native``: the C modules and their Python faces, and the machine-level helpers beside them.
1. the dataset's contract: ``dataset``, ``schema``.
2. ``data``, 3. ``features``, 4. ``models`` (training and the scorers) and ``tables`` (the row store of tables
   larger than memory), 5. ``repository`` (releases).
6. ``scoring`` (the in-process scorer) and ``online`` (the feature store: its format and lookup).
7. ``serving``: what runs inside Triton's process.
8. the operator's side of one server (``operate``), the store's tools (``online.materialize``, ``online.local``),
   training runs, the README's figures.
9. ``fleet`` and ``check``; 10. ``clients``; 11. ``loadtest``; 12. the composition roots: the command line,
   the demos, the GPU acceptance run and ``benchmarks``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ensemble

PACKAGE = Path(ensemble.__file__).parent
# The composition roots: they wire the library, the clients and the load test together
# (cli/acceptance.py: the GPU acceptance run, `make gpu-acceptance`).
COMPOSERS = "cli/"


def _imported_modules(path: Path, known: frozenset[str] = frozenset()) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names in the file, nested ones included; ``from P
    import m`` also names P.m when P.m is one of ``known``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known)
    return found


def test_ensemble_imports_clients_and_loadtest_only_from_the_command_line_and_demo():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix().startswith(COMPOSERS):
            continue
        consumers = sorted(m for m in _imported_modules(path) if m.split(".")[0] in ("clients", "loadtest"))
        if consumers:
            offenders[path.relative_to(PACKAGE).as_posix()] = consumers
    assert offenders == {}


def test_folders_are_the_roles_and_nesting_stops_at_one_level():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert folders == ["base", "check", "cli", "data", "features", "fleet", "models", "native", "online", "operate",
                       "repository", "runs", "scoring", "serving", "tables"]
    assert not [p for p in PACKAGE.glob("*/*/__init__.py")], "no package deeper than ensemble/<role>/"


# module (or package prefix) -> layer; the longest prefix that matches a module names its layer
LAYERS = {
    "ensemble.native": 0, "ensemble.base": 0,
    "ensemble.dataset": 1, "ensemble.schema": 1,
    "ensemble.data": 2, "ensemble.features": 3, "ensemble.models": 4, "ensemble.tables": 4, "ensemble.repository": 5,
    "ensemble.scoring": 6, "ensemble.online": 6, "ensemble.online.materialize": 8, "ensemble.online.local": 8,
    "ensemble.serving": 7,
    "ensemble.operate": 8, "ensemble.runs": 8,
    "ensemble.fleet": 9, "ensemble.check": 9,
    "clients": 10, "loadtest": 11,
    "ensemble.cli": 12, "ensemble.__main__": 12, "benchmarks": 12, "ensemble": 0,
}
ROOT = PACKAGE.parent
SOURCES = [*PACKAGE.rglob("*.py"), *(ROOT / "clients").rglob("*.py"), *(ROOT / "loadtest").rglob("*.py"),
           *(ROOT / "benchmarks").rglob("*.py")]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    name = module
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    return None


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from P import m`` names module P.m when it is one)."""
    modules = {_module_name(p): p for p in SOURCES}
    known = frozenset(modules)
    return {name: {m for m in _imported_modules(path, known) if m in modules and m != name}
            for name, path in modules.items()}


def test_every_module_has_a_layer():
    assert [m for m in _graph() if _layer(m) is None] == []


def test_no_arrow_runs_back_up():
    graph = _graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))
    assert upward == []


def test_no_circle():
    graph = _graph()
    # Tarjan-free check: a depth-first search that meets a module still on its stack has found a circle.
    state, circles = {}, []

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if target.startswith("ensemble") and module.startswith("ensemble") and \
                    (target == module.rpartition(".")[0]):
                continue  # a module importing its own package's __init__ is not a circle of files
            if state.get(target) == "open":
                circles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert circles == []


def test_clients_use_the_package_below_the_server_only():
    """Clients import the contract, the wire encoding and the in-process scorer, never the server's side."""
    graph = _graph()
    server_side = ("ensemble.serving", "ensemble.operate", "ensemble.fleet")
    assert sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith("clients")
                  for b in targets if b.startswith(server_side)) == []
