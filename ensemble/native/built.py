"""Which of the project's C modules this install has, and what serves in place of a missing one.

Every C module is optional at install (setup.py): a missing one costs speed, never answers. This
says so: ``python -m ensemble.native`` after an install (``make setup`` runs it), a log line at
``ensemble serve``, and the ``ensemble_c_module_built{module}`` metric of every loaded native model.
"""

from __future__ import annotations

import importlib.util
import sys

from ensemble.native import backend

# module -> what serves without it
MODULES = {
    "_request": "Python loops split, look up and prepare every request's strings (slower, same results)",
    "_admission": "the admission policy runs in Python",
    "_trees": "XGBoost scores the trees",
    "_dlrm": "TorchScript and LiteRT score the DLRMs",
    "_chain": "every request goes through the model's Python execute (no C path)",
    "_openvino": "a release that declares OpenVINO scores its DLRMs with the C pass instead",
    "_tables": "a release whose DLRMs keep their tables in a row store (tables larger than memory) does not load",
}


def built() -> dict[str, bool]:
    """module -> whether it is importable here (the backend library under its file name)."""
    found = {name: importlib.util.find_spec(f"ensemble.native.{name}") is not None for name in MODULES}
    try:
        backend.library()
        found[backend.FILE_NAME] = True
    except backend.NotBuilt:
        found[backend.FILE_NAME] = False
    return found


def missing_lines() -> list[str]:
    """One line per missing module: what it is and what serves instead."""
    found = built()
    lines = [f"the C module ensemble.native.{name} is not built: {instead}"
             for name, instead in MODULES.items() if not found[name]]
    if not found[backend.FILE_NAME]:
        lines.append(f"the native backend ({backend.FILE_NAME}) is not built: only the fused layout serves on CPU")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print what this install built; exit 1 when a module is missing and ``--strict`` is given."""
    strict = "--strict" in (argv if argv is not None else sys.argv[1:])
    lines = missing_lines()
    total = len(MODULES) + 1
    if not lines:
        print(f"ensemble: all {total} C modules built")
        return 0
    for line in lines:
        print(f"ensemble: {line}", file=sys.stderr)
    print(f"ensemble: {total - len(lines)} of {total} C modules built; rebuild with `.venv/bin/python setup.py "
          "build_ext --inplace` to see why", file=sys.stderr)
    return 1 if strict else 0
